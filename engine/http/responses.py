"""OpenAI's Responses API as llama-server serves it: `POST /v1/responses` (and `/responses`),
streamed or not, stateless (no `previous_response_id`).

A responses request becomes a chat request (`to_chat`: `instructions` as the system message, `input`
text or message items with input_text / output_text parts, `function_call` items as the assistant's
tool calls, `function_call_output` items as tool messages, flat function tools, `max_output_tokens`)
and runs as one (`tool_choice` too). The answer is a `response` object with a `message` output
item and a `function_call` item per call the model wrote (engine/tool_calls.py); the stream sends
response.created / in_progress (also per prompt batch with `return_progress`), output_item /
content_part added, output_text deltas, their done events, the calls' items and response.completed.
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any, Union

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from .bodies import ChatBody, chat_body
from .common import chat_requests, input_tokens
from .errors import APIError
from .streaming import Run, generation_error, named_sse, single_reply

if TYPE_CHECKING:
    from ..serving.sequence import Event
    from ..text.tool_calls import ToolCall, ToolFormat
    from .handle import Head

TEXT_PARTS = ("input_text", "output_text")


class ResponsesBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: Union[str, list[dict[str, Any]]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=0)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None  # none / auto / required / {"type": "function", "name"}
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    timings_per_token: bool = False  # llama-server's
    return_progress: bool = False  # llama-server's


def _content(parts: Any, i: int) -> Any:
    if isinstance(parts, str):
        return parts
    out = []
    for j, part in enumerate(parts if isinstance(parts, list) else []):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in TEXT_PARTS and isinstance(part.get("text"), str):
            out.append({"type": "text", "text": part["text"]})
        elif kind == "input_image":
            out.append({"type": "image_url", "image_url": {"url": part.get("image_url", "")}})
        else:
            raise APIError(
                400, f"input[{i}].content[{j}]: type must be input_text, output_text or input_image", param="input"
            )
    return out


def _messages(body: ResponsesBody) -> list[dict]:
    out: list[dict] = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
    if isinstance(body.input, str):
        return [*out, {"role": "user", "content": body.input}]
    for i, item in enumerate(body.input):
        kind = item.get("type", "message")
        if kind == "message":
            out.append({"role": item.get("role", "user"), "content": _content(item.get("content"), i)})
        elif kind == "function_call":
            call = {
                "id": item.get("call_id", ""),
                "type": "function",
                "function": {"name": item.get("name", ""), "arguments": item.get("arguments", "")},
            }
            if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output", "")
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": item.get("call_id", ""),
                    "content": output if isinstance(output, str) else _content(output, i),
                }
            )
        elif kind != "reasoning":  # earlier reasoning items are not replayed
            raise APIError(
                400,
                f"input[{i}]: type {kind!r} is not supported (message, function_call, function_call_output, reasoning)",
                param="input",
            )
    return out


def to_chat(body: ResponsesBody) -> ChatBody:
    if body.previous_response_id is not None:
        raise APIError(
            400,
            "previous_response_id is not supported: this server keeps no responses; send the whole "
            "conversation as input",
            param="previous_response_id",
        )
    chat: dict[str, Any] = {
        "messages": _messages(body),
        "max_tokens": body.max_output_tokens,
        "stream": body.stream,
        "timings_per_token": body.timings_per_token,
        "return_progress": body.return_progress,
    }
    if body.tools is not None:
        chat["tools"] = [
            {"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters") if k in t}}
            for t in body.tools
            if t.get("type") == "function"
        ]
    choice = body.tool_choice
    if isinstance(choice, dict) and choice.get("type") == "function":  # the Responses API's flat form
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    chat["tool_choice"] = choice
    return chat_body(chat, body, ("model", "temperature", "top_p", "parallel_tool_calls"))


def _usage(ev: Event) -> dict:
    u = ev.usage
    return {
        "input_tokens": u["prompt_tokens"],
        "output_tokens": u["completion_tokens"],
        "total_tokens": u["total_tokens"],
        "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
    }


def responses_routes(head: Head) -> APIRouter:
    r = APIRouter()

    @r.post("/v1/responses/input_tokens")
    @r.post("/responses/input_tokens", include_in_schema=False)
    async def responses_input_tokens(body: ResponsesBody):
        return {"object": "response.input_tokens", "input_tokens": await input_tokens(head, to_chat(body))}

    @r.post("/v1/responses")
    @r.post("/responses", include_in_schema=False)
    async def responses(body: ResponsesBody, http: Request):
        reqs, calls = await chat_requests(head, to_chat(body))
        ids = {"resp": f"resp_{uuid.uuid4().hex}", "msg": f"msg_{uuid.uuid4().hex}"}
        if body.stream:
            run = Run(head, http, reqs[:1], streamed=True)
            return run.response(_stream(run, ids, calls))
        reply = await single_reply(head, http, reqs[0], calls)
        if reply is None:  # the client left; nobody reads this
            return Response(status_code=499)
        content, tool_calls, final = reply
        return _response(head, ids, content, final, [_function_call(c) for c in tool_calls])

    return r


def _message(ids: dict, text: str, status: str) -> dict:
    part = {"type": "output_text", "annotations": [], "logprobs": [], "text": text}
    return {
        "type": "message",
        "id": ids["msg"],
        "role": "assistant",
        "status": status,
        "content": [part] if text else [],
    }


def _function_call(call: ToolCall) -> dict:
    """A call the model wrote, as llama-server's `function_call` item."""
    return {
        "id": f"fc_{call.id}",
        "type": "function_call",
        "status": "completed",
        "arguments": call.arguments,
        "call_id": f"call_{call.id}",
        "name": call.name,
    }


def _response(head: Head, ids: dict, text: str, final: Event, calls: list[dict] = ()) -> dict:
    """The finished response; "completed" also when max_output_tokens cut it, as llama-server's."""
    now = int(time.time())
    output = ([_message(ids, text, "completed")] if text else []) + list(calls)
    return {
        "id": ids["resp"],
        "object": "response",
        "created_at": now,
        "completed_at": now,
        "status": "completed",
        "model": head.model_name,
        "output": output,
        "usage": _usage(final),
    }


async def _stream(run: Run, ids: dict, calls: ToolFormat | None):
    """The response.* events; with tools, text where a call may start is held back, and each call
    comes at the end as a function_call output item (added, then done)."""
    head = run.head
    pending = {"id": ids["resp"], "object": "response", "status": "in_progress", "model": head.model_name}
    held = calls.stream() if calls is not None else None
    yield named_sse("response.created", {"response": pending})
    yield named_sse("response.in_progress", {"response": pending})
    text: list[str] = []
    where = {"item_id": ids["msg"], "output_index": 0, "content_index": 0}
    async for _, ev in run.events():
        if ev.finish_reason == "error":
            e = generation_error(ev)
            yield named_sse("error", {"code": e.type, "message": e.message})
            return
        timings = {"timings": ev.timings} if ev.timings else {}
        if ev.progress is not None:
            yield named_sse("response.in_progress", {"response": pending, "prompt_progress": ev.progress, **timings})
            continue
        pieces, tool_calls = [held.push(ev.text) if held is not None else ev.text], []
        if ev.finish_reason is not None and held is not None:
            rest, tool_calls = held.finish()
            pieces.append(rest)
        for piece in filter(None, pieces):
            if not text:
                yield named_sse(
                    "response.output_item.added", {"output_index": 0, "item": _message(ids, "", "in_progress")}
                )
                yield named_sse(
                    "response.content_part.added",
                    {**where, "part": {"type": "output_text", "text": "", "annotations": []}},
                )
            text.append(piece)
            yield named_sse("response.output_text.delta", {**where, "delta": piece, **timings})
        if ev.finish_reason is not None:
            content = "".join(text)
            if content:
                item = _message(ids, content, "completed")
                yield named_sse("response.output_text.done", {**where, "text": content})
                yield named_sse("response.content_part.done", {**where, "part": item["content"][0]})
                yield named_sse("response.output_item.done", {"output_index": 0, "item": item})
            items = [_function_call(c) for c in tool_calls]
            for index, item in enumerate(items, start=int(bool(content))):
                yield named_sse(
                    "response.output_item.added", {"output_index": index, "item": {**item, "status": "in_progress"}}
                )
                yield named_sse("response.output_item.done", {"output_index": index, "item": item})
            yield named_sse(
                "response.completed", {"response": _response(head, ids, content, ev, items), "timings": ev.timings}
            )
