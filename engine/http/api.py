"""The head's HTTP app: OpenAI's routes over the Engine, llama-server's native ones (llama_routes,
included here), /slots, and the /health, /status and /metrics every worker serves. It only routes: `workers.head` builds and starts the
parts it reads. Every bad request is a 4xx in OpenAI's error shape; requests before the engine
is ready, or beyond its queue, get 503 with Retry-After. `http_gate.Gate` runs in front (API key,
body limit, the log line). Tokenizer and chat-template work runs in a thread: a long prompt must not
stall the event loop (and /health with it).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import TYPE_CHECKING, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import ContextOverflow, Overloaded, Unavailable, UserError
from ..serving.context_shift import n_predict_of
from . import slot_files
from .anthropic import anthropic_routes
from .bodies import MAX_LOGPROBS, ChatBody, CommonBody, sampler_fields
from .chat_completions import respond_chat
from .common import (
    chat_requests,
    choices,
    pinned_slot,
    ready_engine,
    sampling_params,
    speculative_config,
    stop_list,
)
from .cors import Cors
from .embeddings import embedding_routes
from .errors import APIError, error_response
from .gate import Gate
from .json_body import JsonBody
from .limits import capped_json, json_response
from .llama_routes import BUILD_INFO
from .llama_routes import router as llama_router
from .logprobs import CompletionLogprobs, merge_logprobs
from .predict import add_predict_route
from .prompts import check_token_ids
from .rerank import rerank_routes
from .responses import responses_routes
from .streaming import Run, check_finish, sse, stream_error, usage_of
from .wake import Wake
from .worker import add_observation_routes

if TYPE_CHECKING:  # the engine's modules bring torch: imported when the model loads, after the port is up
    from ..serving.sequence import Event
    from ..serving.sequence import Request as EngineRequest
    from .handle import Head


def _loc_param(loc) -> str | None:
    parts = [str(p) for p in loc if p not in ("body", "query", "path")]
    return ".".join(parts) or None


# ---- request bodies -----------------------------------------------------------------------------


class CompletionBody(CommonBody):
    prompt: Union[str, list[str], list[int], list[list[int]]] = Field(
        ..., description="text, token ids, or a list holding one of those"
    )
    max_tokens: int | None = Field(16, ge=0)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    return_tokens_as_token_ids: bool = False


class SlotFileBody(BaseModel):
    filename: str = ""


# ---- the app -----------------------------------------------------------------------------------


def create_app(head: Head) -> FastAPI:
    # every JSON answer is capped at --max-response (http/limits.py)
    app = FastAPI(title="Hydra head", version="0.1.0", default_response_class=capped_json(head.cfg.max_response))
    app.state.head = head
    app.add_middleware(JsonBody)  # innermost: a body is JSON whatever its declared type
    app.add_middleware(Wake, head=head)  # behind the gate: a refused request does not wake a sleeping head
    app.add_middleware(Gate, api_key=head.cfg.api_key, max_body=head.cfg.max_body, drain=head.drain)
    app.add_middleware(Cors, origins=head.cfg.cors_origins)  # outermost: a preflight needs no key
    add_observation_routes(app, head.status, head.metrics if head.cfg.metrics else None)
    app.include_router(embedding_routes(head))
    app.include_router(rerank_routes(head))

    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        return e.response()

    @app.exception_handler(Unavailable)  # Engine.submit: the queue is full (Overloaded)
    async def _unavailable(_, e: Unavailable):
        code = "server_overloaded" if isinstance(e, Overloaded) else None
        return error_response(503, str(e), "unavailable_error", code=code, retry_after=e.retry_after)

    @app.exception_handler(ContextOverflow)
    async def _overflow(_, e: ContextOverflow):
        return error_response(
            400, str(e), "exceed_context_size_error", e.param, n_prompt_tokens=e.n_prompt_tokens, n_ctx=e.n_ctx
        )

    @app.exception_handler(UserError)  # sampling.InvalidParam names the parameter
    async def _user(_, e: UserError):
        return error_response(400, str(e), "invalid_request_error", getattr(e, "param", None))

    @app.exception_handler(RequestValidationError)
    async def _validation(_, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {"loc": (), "msg": "invalid request"}
        if first.get("type") == "json_invalid":  # FastAPI's loc: ("body", the character it failed at)
            why = first.get("ctx", {}).get("error", first.get("msg"))
            at = first["loc"][-1]
            return error_response(
                400, f"the request body is not valid JSON: {why} at character {at}", "invalid_request_error"
            )
        msg = "; ".join(f"{_loc_param(x.get('loc', ())) or 'body'}: {x.get('msg')}" for x in errs[:5])
        return error_response(400, msg or "invalid request", "invalid_request_error", _loc_param(first.get("loc", ())))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_, e: StarletteHTTPException):
        res = error_response(
            e.status_code, str(e.detail), "invalid_request_error" if e.status_code < 500 else "server_error"
        )
        res.headers.update(e.headers or {})  # a 408 closes its connection (the rest of the body never came)
        return res

    @app.get("/v1/models")
    @app.get("/models", include_in_schema=False)
    async def models():
        data = []
        if head.status.startup_stage >= 2:
            meta = {"n_ctx": head.cfg.model.ctx, "n_vocab": head.tok.vocab_size, **head.status.model.to_json()}
            data.append(
                {
                    "id": head.model_name,
                    "aliases": list(head.cfg.aliases),
                    "tags": list(head.cfg.tags),
                    "object": "model",
                    "created": head.created,
                    "owned_by": "hydra",
                    "meta": meta,
                }
            )
        return {"object": "list", "data": data}

    @app.get("/slots")
    async def slots(fail_on_no_slot: str | None = None):
        if not head.cfg.slots:
            raise APIError(
                501, "This server does not support slots endpoint. Start it with `--slots`", "not_supported_error"
            )
        info = _llama_slots(ready_engine(head))
        if fail_on_no_slot and all(s["is_processing"] for s in info):
            raise APIError(503, "no slot available", "unavailable_error")
        return info

    @app.post("/slots/{slot}")
    async def slot_action(slot: int, action: str, body: SlotFileBody | None = None):
        """llama-server's slot save / restore / erase, files under --slot-save-path (http/slot_files.py).
        The slot, the action and the name are checked before any file is touched."""
        engine = ready_engine(head)
        if not 0 <= slot < engine.n_slots:
            raise APIError(400, f"slot {slot} does not exist ({engine.n_slots} slots)", param="slot")
        if action == "erase":
            return {"id_slot": slot, "n_erased": await asyncio.to_thread(engine.erase_slot, slot)}
        if action not in ("save", "restore"):
            raise APIError(400, f"action must be save, restore or erase, not {action!r}", param="action")
        folder = head.cfg.slot_save_path
        if folder is None:
            raise APIError(
                501, "slot save/restore is off: start the server with --slot-save-path", "not_supported_error"
            )
        name, t0 = slot_files.checked_name(body.filename if body else ""), time.perf_counter()
        if action == "save":
            n, written = await asyncio.to_thread(
                slot_files.save, folder, name, lambda write: engine.save_slot(slot, write)
            )
            return {
                "id_slot": slot,
                "filename": name,
                "n_saved": n,
                "n_written": written,
                "timings": {"save_ms": (time.perf_counter() - t0) * 1e3},
            }
        data = await asyncio.to_thread(slot_files.read, folder, name)

        def restore() -> int:
            from ..slot_state import read_all

            return engine.restore_slot(slot, slot_files.check_states(read_all(data)))

        n = await asyncio.to_thread(restore)
        return {
            "id_slot": slot,
            "filename": name,
            "n_restored": n,
            "n_read": len(data),
            "timings": {"restore_ms": (time.perf_counter() - t0) * 1e3},
        }

    app.include_router(llama_router(head))
    app.include_router(anthropic_routes(head))
    app.include_router(responses_routes(head))

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, http: Request):
        from ..serving.sequence import Request as EngineRequest

        engine = ready_engine(head)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(400, "only one prompt per request is supported", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = await asyncio.to_thread(head.tok.encode, prompt, add_special=True, parse_special=True)
            prompt_text = prompt
        else:
            ids = check_token_ids(head, list(prompt))
            prompt_text = await asyncio.to_thread(head.tok.decode, ids, skip_special=True) if body.echo else ""
        max_tokens = body.max_tokens if body.max_tokens is not None else 16
        engine.check(len(ids), max_tokens)
        req = EngineRequest(
            prompt=ids,
            params=sampling_params(head, body, body.logprobs),
            max_tokens=max_tokens,
            stop=stop_list(body.stop),
            ignore_eos=body.ignore_eos,
            prompt_logprobs=body.logprobs if body.echo and body.logprobs is not None else None,
            spec=speculative_config(engine, body),
            id_slot=pinned_slot(engine, body),
            cache_prompt=body.cache_prompt,
            return_progress=body.stream and body.return_progress,
            n_keep=body.n_keep,
            n_discard=body.n_discard,
        )
        return await _respond_completion(head, http, body, await choices(head, body, req), prompt_text)

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions", include_in_schema=False)
    async def chat_completions(body: ChatBody, http: Request):
        reqs, calls = await chat_requests(head, body)
        return await respond_chat(head, http, body, reqs, calls)

    if head.cfg.predict_route is not None:  # last: it dispatches to the routes above
        add_predict_route(app, head.cfg.predict_route)

    return app


def _llama_slots(engine) -> list[dict]:
    """llama-server's /slots entries: ours (`Engine.slot_info`, what /status shows) plus its names
    for what maps: `is_processing`, `speculative`, and for a busy slot the prompt and cache counts,
    `params` and `next_token`."""
    out = []
    for info, seq in zip(engine.slot_info(), engine.slots):
        spec = (seq.req.spec if seq is not None and seq.req.spec else engine.spec_config).active
        entry = {**info, "speculative": spec, "is_processing": seq is not None}
        if seq is not None:
            p, n_predict = seq.req.params, n_predict_of(seq.req.max_tokens)
            entry.update(
                n_prompt_tokens_processed=max(min(seq.n_past + seq.n_discarded, seq.n_prompt) - seq.n_cached, 0),
                n_prompt_tokens_cache=seq.n_cached,
                params={
                    "n_predict": n_predict,
                    "max_tokens": n_predict,
                    "seed": p.seed,
                    **sampler_fields(p),
                    "ignore_eos": seq.req.ignore_eos,
                    "stop": seq.req.stop,
                    "n_probs": p.logprobs or 0,
                },
                next_token=[
                    {
                        "has_next_token": seq.finish_reason is None,
                        "n_remain": -1 if n_predict < 0 else n_predict - seq.n_gen,
                        "n_decoded": seq.n_gen,
                    }
                ],
            )
        out.append(entry)
    return out


async def _respond_completion(
    head: Head, http: Request, body: CompletionBody, reqs: list[EngineRequest], prompt_text: str
):
    cid, created, n = f"cmpl-{uuid.uuid4().hex}", int(time.time()), len(reqs)
    want_lp = body.logprobs is not None
    lps = [CompletionLogprobs(head, body.return_tokens_as_token_ids) for _ in reqs]
    run = Run(head, http, reqs, streamed=body.stream)

    def prompt_part(i: int, ev: Event) -> dict:
        return lps[i].add([(lp, None) for lp in ev.prompt_logprobs])

    def gen_part(i: int, ev: Event) -> dict | None:
        if not want_lp:
            return None
        return lps[i].add([(t.logprob, t.text) for t in ev.tokens if t.logprob is not None])

    def chunk(i: int, text: str, logprobs, finish=None, **extra) -> dict:
        choice = {"text": text, "index": i, "logprobs": logprobs, "finish_reason": finish}
        return {
            "id": cid,
            "object": "text_completion",
            "created": created,
            "model": head.model_name,
            "system_fingerprint": BUILD_INFO,
            "choices": [choice],
            **extra,
        }

    if body.stream:

        async def stream():
            echoed = [not body.echo] * n
            finals: list[Event] = []
            async for i, ev in run.events():
                if ev.finish_reason == "error":
                    yield sse(stream_error(ev))
                    break
                if ev.progress is not None:
                    yield sse(
                        chunk(
                            i, "", None, prompt_progress=ev.progress, **({"timings": ev.timings} if ev.timings else {})
                        )
                    )
                    continue
                if ev.prompt_logprobs is not None:
                    yield sse(chunk(i, "" if echoed[i] else prompt_text, prompt_part(i, ev)))
                    echoed[i] = True
                    continue
                if not echoed[i]:
                    yield sse(chunk(i, prompt_text, None))
                    echoed[i] = True
                if ev.finish_reason is None:
                    yield sse(chunk(i, ev.text, gen_part(i, ev)))
                    continue
                finals.append(ev)
                last = {"usage": usage_of(finals), "timings": ev.timings} if len(finals) == n else {}
                yield sse(chunk(i, ev.text, gen_part(i, ev) if ev.tokens else None, ev.finish_reason, **last))
            yield b"data: [DONE]\n\n"

        return run.response(stream())

    texts, parts, finals = [[] for _ in reqs], [[] for _ in reqs], [None] * n
    async for i, ev in run.events():
        if ev.prompt_logprobs is not None:
            parts[i].append(prompt_part(i, ev))
            continue
        texts[i].append(ev.text)
        if want_lp and ev.tokens:
            parts[i].append(gen_part(i, ev))
        if ev.finish_reason is not None:
            finals[i] = ev
    if None in finals:  # the client left; nobody reads this
        return Response(status_code=499)
    for ev in finals:
        check_finish(ev)
    out = [
        chunk(
            i,
            (prompt_text if body.echo else "") + "".join(texts[i]),
            merge_logprobs(parts[i]) if want_lp else None,
            finals[i].finish_reason,
        )["choices"][0]
        for i in range(n)
    ]
    answer = {
        "id": cid,
        "object": "text_completion",
        "created": created,
        "model": head.model_name,
        "system_fingerprint": BUILD_INFO,
        "choices": out,
        "usage": usage_of(finals),
        "timings": finals[0].timings,
    }
    return await json_response(answer, head.cfg.max_response)


# ---- serve -----------------------------------------------------------------------------------
