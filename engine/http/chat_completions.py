"""OpenAI's /v1/chat/completions answer (`respond_chat`): llama-server's stream (a role chunk per
choice, content chunks, tool calls whole at the end, a finish chunk, the usage chunk with
stream_options.include_usage), or one chat.completion object; its logprobs and tool calls. The
route (api.py) builds the engine requests with `common.chat_requests`."""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import Response

from .bodies import ChatBody
from .limits import json_response
from .llama_routes import BUILD_INFO
from .logprobs import chat_logprob_content
from .streaming import Run, check_finish, sse, stream_error, usage_of

if TYPE_CHECKING:
    from ..serving.sequence import Event, GenToken
    from ..serving.sequence import Request as EngineRequest
    from ..text.tool_calls import ToolFormat
    from .handle import Head


def _finish_reason(ev: Event, calls: list) -> str:
    """llama-server's: a generation that ended by itself with calls ended for them."""
    return "tool_calls" if calls and ev.finish_reason == "stop" else ev.finish_reason


async def respond_chat(head: Head, http: Request, body: ChatBody, reqs: list[EngineRequest], calls: ToolFormat | None):
    """`calls`: the template's tool-call format when the request's generations are parsed for calls."""
    cid, created, n = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), len(reqs)
    as_ids = body.return_tokens_as_token_ids
    run = Run(head, http, reqs, streamed=body.stream)
    common = {
        "id": cid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": head.model_name,
        "system_fingerprint": BUILD_INFO,
    }

    def chunk(i: int, delta: dict, tokens: list[GenToken], finish=None, **extra) -> dict:
        logprobs = {"content": chat_logprob_content(head, tokens, as_ids)} if body.logprobs and tokens else None
        choice = {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return {**common, "choices": [choice], **extra}

    if body.stream:
        # llama-server's stream: a first chunk with the role and content null (per choice); content
        # chunks (each with `timings` when timings_per_token); a finish chunk with an empty delta; the
        # usage chunk (choices []) only with stream_options.include_usage. The last chunk carries `timings`.
        include_usage = bool((body.stream_options or {}).get("include_usage"))

        # With tools, text that may start a call is held back; the calls come whole at the end.
        held = [calls.stream() if calls is not None else None for _ in reqs]

        async def stream():
            for i in range(n):
                yield sse(chunk(i, {"role": "assistant", "content": None}, []))
            finals: list[Event] = []
            async for i, ev in run.events():
                if ev.finish_reason == "error":
                    yield sse(stream_error(ev))
                    break
                per_token = {"timings": ev.timings} if ev.timings else {}
                if ev.progress is not None:  # as llama-server: a role delta carrying prompt_progress
                    yield sse(
                        chunk(i, {"role": "assistant", "content": None}, [], prompt_progress=ev.progress, **per_token)
                    )
                    continue
                text = held[i].push(ev.text) if held[i] is not None else ev.text
                if text or (ev.tokens and (held[i] is None or body.logprobs)):  # no empty chunks for held text
                    yield sse(chunk(i, {"content": text} if text else {}, ev.tokens, **per_token))
                if ev.finish_reason is None:
                    continue
                finals.append(ev)
                rest, tool_calls = held[i].finish() if held[i] is not None else ("", [])
                if rest:
                    yield sse(chunk(i, {"content": rest}, []))
                for k, call in enumerate(tool_calls):
                    yield sse(chunk(i, {"tool_calls": [{"index": k, **call.to_json()}]}, []))
                timings = {"timings": ev.timings}
                yield sse(chunk(i, {}, [], _finish_reason(ev, tool_calls), **({} if include_usage else timings)))
                if include_usage and len(finals) == n:
                    yield sse({**common, "choices": [], "usage": usage_of(finals), **timings})
            yield b"data: [DONE]\n\n"

        return run.response(stream())

    texts, tokens, finals = [[] for _ in reqs], [[] for _ in reqs], [None] * n
    async for i, ev in run.events():
        texts[i].append(ev.text)
        tokens[i] += ev.tokens
        if ev.finish_reason is not None:
            finals[i] = ev
    if None in finals:
        return Response(status_code=499)
    for ev in finals:
        check_finish(ev)

    def choice(i: int) -> dict:
        logprobs = {"content": chat_logprob_content(head, tokens[i], as_ids)} if body.logprobs else None
        from ..text.tool_calls import reply_parts

        content, tool_calls = reply_parts(calls, "".join(texts[i]))
        message = {"role": "assistant", "content": content}
        if tool_calls:
            message["tool_calls"] = [c.to_json() for c in tool_calls]
        return {
            "index": i,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": _finish_reason(finals[i], tool_calls),
        }

    out = {
        "id": cid,
        "object": "chat.completion",
        "created": created,
        "model": head.model_name,
        "system_fingerprint": BUILD_INFO,
        "choices": [choice(i) for i in range(n)],
        "usage": usage_of(finals),
        "timings": finals[0].timings,
    }
    if body.verbose or head.cfg.verbose:
        # llama-server's: the prompt as the model saw it, its tokens as text (the BOS included)
        seen = head.tok.decode(reqs[0].prompt)
        out["__verbose"] = {"prompt": seen, "content": out["choices"][0]["message"]["content"]}
    return await json_response(out, head.cfg.max_response)
