"""Anthropic's Messages API as llama-server serves it: `POST /v1/messages` (streamed or not) and
`POST /v1/messages/count_tokens`.

A messages request becomes a chat request (`to_chat`, llama-server's conversion: `system` first,
text blocks as content parts, `tool_use` blocks as the assistant's `tool_calls`, `tool_result`
blocks as `tool` messages after their turn, `thinking` blocks as `reasoning_content`, tools'
`input_schema` as their parameters, `tool_choice` auto / any / tool / none as OpenAI's (and its
`disable_parallel_tool_use`),
`stop_sequences` as stop strings) and runs as one; the answer has Anthropic's shape: content blocks
(calls the model writes as `tool_use` blocks, engine/tool_calls.py), `stop_reason`
(`tool_use` after calls), and `usage` with `cache_read_input_tokens`
(prompt tokens taken from the prompt cache), no `timings`.
"""

from __future__ import annotations

import json
import uuid
from typing import TYPE_CHECKING, Any, Union

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from .bodies import ChatBody, chat_body
from .common import chat_requests, input_tokens
from .streaming import Run, generation_error, named_sse, single_reply

if TYPE_CHECKING:
    from ..serving.sequence import Event
    from ..text.tool_calls import ToolCall, ToolFormat
    from .handle import Head

DEFAULT_MAX_TOKENS = 4096  # Anthropic requires max_tokens; llama-server defaults it to this (ends at the context's end)


class MessagesBody(BaseModel):
    """Anthropic's request fields; `thinking` and `metadata` are accepted and have no effect here."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    messages: list[dict[str, Any]]
    system: Union[str, list[dict[str, Any]], None] = None
    max_tokens: int = Field(DEFAULT_MAX_TOKENS, ge=0)
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None


def _image_part(block: dict) -> dict:
    source = block.get("source") or {}
    if source.get("type") == "base64":
        url = f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"
    else:
        url = source.get("url", "")
    return {"type": "image_url", "image_url": {"url": url}}


def _tool_result(block: dict) -> dict:
    content = block.get("content")
    if isinstance(content, list):
        parts = [
            {"type": "text", "text": c.get("text", "")} if c.get("type") == "text" else _image_part(c)
            for c in content
            if c.get("type") in ("text", "image")
        ]
        has_image = any(p["type"] == "image_url" for p in parts)
        content = parts if has_image else "".join(p["text"] for p in parts)
    elif not isinstance(content, str):
        content = ""
    return {"role": "tool", "tool_call_id": block.get("tool_use_id", ""), "content": content}


def _messages(body: MessagesBody) -> list[dict]:
    out: list[dict] = []
    if body.system is not None:
        system = (
            body.system
            if isinstance(body.system, str)
            else "".join(b.get("text", "") for b in body.system if b.get("type") == "text")
        )
        out.append({"role": "system", "content": system})
    for msg in body.messages:
        content = msg.get("content")
        if not isinstance(content, list):
            if content is not None or msg.get("role") != "assistant":
                out.append(msg)
            continue
        parts, calls, results, reasoning = [], [], [], ""
        for block in content:
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                parts.append({"type": "text", "text": block.get("text", "")})
            elif kind == "thinking":
                reasoning += block.get("thinking", "")
            elif kind == "image":
                parts.append(_image_part(block))
            elif kind == "tool_use":
                calls.append(
                    {
                        "id": block.get("id", ""),
                        "type": "function",
                        "function": {"name": block.get("name", ""), "arguments": json.dumps(block.get("input", {}))},
                    }
                )
            elif kind == "tool_result":
                results.append(_tool_result(block))
        if parts or calls or reasoning:
            turn: dict[str, Any] = {"role": msg.get("role"), "content": parts or ""}
            if calls:
                turn["tool_calls"] = calls
            if reasoning:
                turn["reasoning_content"] = reasoning
            out.append(turn)
        out += results
    return out


def to_chat(body: MessagesBody) -> ChatBody:
    """The chat request a messages request stands for (llama-server's conversion)."""
    chat: dict[str, Any] = {"messages": _messages(body), "max_tokens": body.max_tokens, "stream": body.stream}
    if body.tools is not None:
        chat["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": t.get("name", ""),
                    "description": t.get("description", ""),
                    "parameters": t.get("input_schema", {}),
                },
            }
            for t in body.tools
        ]
    if body.stop_sequences is not None:
        chat["stop"] = body.stop_sequences
    kind = (body.tool_choice or {}).get("type")
    if kind in ("auto", "none"):
        chat["tool_choice"] = kind
    elif kind == "any":
        chat["tool_choice"] = "required"
    elif kind == "tool":
        chat["tool_choice"] = {"type": "function", "function": {"name": body.tool_choice.get("name")}}
    if (body.tool_choice or {}).get("disable_parallel_tool_use"):
        chat["parallel_tool_calls"] = False
    return chat_body(chat, body, ("model", "temperature", "top_p", "top_k", "chat_template_kwargs"))


def _stop_reason(ev: Event, calls: list) -> str:
    if ev.finish_reason == "length":
        return "max_tokens"
    return "tool_use" if calls else "end_turn"


def _tool_use(call: ToolCall) -> dict:
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": json.loads(call.arguments)}


def _usage(n_prompt: int, n_cached: int, n_out: int) -> dict:
    return {"cache_read_input_tokens": n_cached, "input_tokens": n_prompt - n_cached, "output_tokens": n_out}


def anthropic_routes(head: Head) -> APIRouter:
    r = APIRouter()

    @r.post("/v1/messages/count_tokens")
    async def count_tokens(body: MessagesBody):
        return {"input_tokens": await input_tokens(head, to_chat(body))}

    @r.post("/v1/messages")
    async def messages(body: MessagesBody, http: Request):
        chat = to_chat(body)
        reqs, calls = await chat_requests(head, chat)
        req = reqs[0]
        mid = f"msg_{uuid.uuid4().hex}"
        message = {"id": mid, "type": "message", "role": "assistant", "model": head.model_name}
        if body.stream:
            req.return_progress = True  # its first report carries the prompt-cache hit message_start tells
            run = Run(head, http, [req], streamed=True)
            return run.response(_stream(run, message, calls))
        reply = await single_reply(head, http, req, calls)
        if reply is None:  # the client left; nobody reads this
            return Response(status_code=499)
        content, tool_calls, final = reply
        u = final.usage
        blocks = ([{"type": "text", "text": content}] if content else []) + [_tool_use(c) for c in tool_calls]
        return {
            **message,
            "content": blocks,
            "stop_reason": _stop_reason(final, tool_calls),
            "stop_sequence": final.stop_word or None,
            "usage": _usage(u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"], u["completion_tokens"]),
        }

    return r


async def _stream(run: Run, message: dict, calls: ToolFormat | None):
    """Anthropic's event stream: message_start, one text block (content_block_start, its deltas,
    content_block_stop), a tool_use block per call (its input as one input_json_delta), message_delta
    with the stop reason and output tokens, message_stop. With tools, text where a call may start
    is held back until the end."""
    started, text_open = False, False
    held = calls.stream() if calls is not None else None
    async for _, ev in run.events():
        if ev.finish_reason == "error":
            e = generation_error(ev)
            yield named_sse("error", {"error": {"type": e.type, "message": e.message}})
            return
        if ev.progress is not None:
            if not started:
                started = True
                usage = _usage(ev.progress["total"], ev.progress["cache"], 0)
                yield named_sse(
                    "message_start",
                    {"message": {**message, "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage}},
                )
            continue
        texts = [held.push(ev.text) if held is not None else ev.text]
        tool_calls = []
        if ev.finish_reason is not None and held is not None:
            rest, tool_calls = held.finish()
            texts.append(rest)
        for text in filter(None, texts):
            if not text_open:
                text_open = True
                yield named_sse("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
            yield named_sse("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": text}})
        if ev.finish_reason is not None:
            if text_open:
                yield named_sse("content_block_stop", {"index": 0})
            for index, call in enumerate(tool_calls, start=int(text_open)):
                yield named_sse(
                    "content_block_start", {"index": index, "content_block": {**_tool_use(call), "input": {}}}
                )
                yield named_sse(
                    "content_block_delta",
                    {"index": index, "delta": {"type": "input_json_delta", "partial_json": call.arguments}},
                )
                yield named_sse("content_block_stop", {"index": index})
            yield named_sse(
                "message_delta",
                {
                    "delta": {"stop_reason": _stop_reason(ev, tool_calls), "stop_sequence": ev.stop_word or None},
                    "usage": {"output_tokens": ev.usage["completion_tokens"]},
                },
            )
            yield named_sse("message_stop", {})
