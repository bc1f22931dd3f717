"""The head's HTTP routes: OpenAI and llama-server endpoints over the Engine, plus the /health,
/status and /metrics every worker serves. It only routes: `workers.head` builds and starts the
parts it reads. Every bad request is a 4xx in OpenAI's error shape; requests before the engine
is ready, or beyond its queue, get 503 with Retry-After. `http_gate.Gate` runs in front (API key,
body limit, the log line). Tokenizer and chat-template work runs in a thread: a long prompt must not
stall the event loop (and /health with it).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import TYPE_CHECKING, Any, AsyncIterator, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from .errors import Overloaded, Unavailable, UserError, describe
from .http_cors import Cors
from .http_errors import APIError, error_response
from .http_gate import Gate, record_of
from .worker_http import add_observation_routes

if TYPE_CHECKING:  # the engine's modules bring torch: imported when the model loads, after the port is up
    from .sampling import SamplingParams, TokenLogprob
    from .sequence import Event, GenToken
    from .sequence import Request as EngineRequest
    from .speculative import SpecConfig
    from .workers.head import HeadWorker as Head

DISCONNECT_POLL_S = 0.25
MAX_LOGPROBS = 20  # = sampling.MAX_LOGPROBS, which also checks it
MAX_CHOICES = 128  # OpenAI's bound on `n`


def _loc_param(loc) -> str | None:
    parts = [str(p) for p in loc if p not in ("body", "query", "path")]
    return ".".join(parts) or None


# ---- request bodies -----------------------------------------------------------------------------

Stop = Union[str, list[str], None]


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float | None = Field(None, ge=0.0, le=100.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repeat_penalty: float | None = Field(None, gt=0.0, le=100.0)
    repeat_last_n: int | None = Field(None, ge=-1)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stop: Stop = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    ignore_eos: bool = False
    cache_prompt: bool = True  # llama-server: reuse the KV of a prefix a slot already holds
    n: int = Field(1, ge=1, le=MAX_CHOICES, description="choices: one engine request each")
    # OpenAI's {"token id": bias}; llama-server's [[id or text, bias]] too; a bias of false bans the token
    logit_bias: Union[dict[str, Any], list[Any], None] = None  # checked by _logit_bias
    # Structured output (engine/structured.py): at most one of these
    response_format: dict[str, Any] | None = None
    json_schema: dict[str, Any] | None = None  # llama-server
    grammar: str | None = None  # llama-server: GBNF (or Lark)
    # Speculative decoding for this request: {"type": "off"|"ngram"|"draft", "n_max", "n_min", "p_min"},
    # or llama-server's flat fields; checked against the server's drafters by the engine's Speculator.
    speculative: Union[bool, dict[str, Any], None] = None
    speculative_n_max: int | None = Field(None, alias="speculative.n_max", ge=0)
    speculative_n_min: int | None = Field(None, alias="speculative.n_min", ge=0)
    speculative_p_min: float | None = Field(None, alias="speculative.p_min", ge=0.0, le=1.0)


class CompletionBody(_Common):
    prompt: Union[str, list[str], list[int], list[list[int]]] = Field(
        ..., description="text, token ids, or a list holding one of those"
    )
    max_tokens: int | None = Field(16, ge=0)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    return_tokens_as_token_ids: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: Union[str, list[dict[str, Any]], None] = None


class ChatBody(_Common):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    return_tokens_as_token_ids: bool = False


class TokenizeBody(BaseModel):
    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class SlotFileBody(BaseModel):
    filename: str = ""


class DetokenizeBody(BaseModel):
    tokens: list[int]


# ---- turning events into OpenAI objects -------------------------------------------------------


def _token_str(head: Head, tid: int, as_ids: bool, text: str | None = None) -> str:
    if as_ids:
        return f"token_id:{tid}"
    return text if text is not None else head.tok.token_bytes(tid).decode("utf-8", "replace")


class _CompletionLogprobs:
    """OpenAI completions logprobs: parallel lists tokens / token_logprobs / top_logprobs / text_offset."""

    def __init__(self, head: Head, as_ids: bool, offset: int = 0):
        self.head, self.as_ids, self.offset = head, as_ids, offset

    def add(self, entries: list[tuple[TokenLogprob, str | None]]) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for lp, text in entries:
            s = _token_str(self.head, lp.token, self.as_ids, text)
            out["tokens"].append(s)
            out["token_logprobs"].append(lp.logprob)
            out["top_logprobs"].append(
                None if lp.logprob is None else {_token_str(self.head, t, self.as_ids): v for t, v in lp.top}
            )
            out["text_offset"].append(self.offset)
            self.offset += len(text if text is not None else s)
        return out


def _merge_logprobs(parts: list[dict]) -> dict:
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for p in parts:
        for k in out:
            out[k] += p[k]
    return out


def _chat_logprob_content(head: Head, tokens: list[GenToken], as_ids: bool) -> list[dict]:
    def entry(tid: int, lp: float, text: str | None = None) -> dict:
        s = _token_str(head, tid, as_ids, text)
        return {"token": s, "logprob": lp, "bytes": list(head.tok.token_bytes(tid))}

    return [
        {**entry(t.id, t.logprob.logprob, t.text), "top_logprobs": [entry(i, v) for i, v in t.logprob.top]}
        for t in tokens
        if t.logprob is not None
    ]


def _sampling(head: Head, body: _Common, logprobs: int | None) -> SamplingParams:
    from .sampling import SamplingParams

    given = {k: getattr(body, k) for k in ("temperature", "top_p", "top_k", "min_p", "repeat_penalty",
                                          "repeat_last_n", "presence_penalty", "frequency_penalty", "seed")}  # fmt: skip
    return SamplingParams(**{k: v for k, v in given.items() if v is not None}, logprobs=logprobs,
                          logit_bias=_logit_bias(head, body.logit_bias))  # fmt: skip


def _logit_bias(head: Head, raw) -> tuple[tuple[int, float], ...]:
    """(token id, bias) pairs from OpenAI's map or llama-server's pairs; a text key biases each of
    its tokens, `false` bans."""
    if not raw:
        return ()
    pairs = raw.items() if isinstance(raw, dict) else raw
    out: dict[int, float] = {}
    for pair in pairs:
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise APIError(400, f"logit_bias entries are [token, bias] pairs, got {pair!r}", param="logit_bias")
        key, bias = pair
        if bias is False:
            bias = float("-inf")
        elif isinstance(bias, bool) or not isinstance(bias, (int, float)) or bias != bias or abs(bias) == float("inf"):
            raise APIError(400, f"logit_bias for {key!r} must be a finite number or false, got {bias!r}", param="logit_bias")
        if isinstance(key, int) and not isinstance(key, bool) or isinstance(key, str) and key.lstrip("-").isdigit():
            ids = [int(key)]
        elif isinstance(key, str):
            ids = head.tok.encode(key, add_special=False, parse_special=False)
        else:
            raise APIError(400, f"logit_bias keys are token ids or text, got {key!r}", param="logit_bias")
        for t in ids:
            if not 0 <= t < head.tok.vocab_size:
                raise APIError(400, f"logit_bias token id {t} is outside the vocabulary of {head.tok.vocab_size}", param="logit_bias")
            out[t] = float(bias)
    return tuple(out.items())


def _grammar(body: _Common) -> tuple[str, str] | None:
    """(the compiled llguidance grammar, the field it came from) of a structured-output request."""
    from .structured import compile_grammar

    sources = []
    rf = body.response_format
    if rf is not None:
        kind = rf.get("type")
        if kind == "json_object":  # llama-server also takes a schema here
            sources.append(("json_schema", rf.get("schema", {"type": "object"}), "response_format"))
        elif kind == "json_schema":
            wrapper = rf.get("json_schema")
            if not isinstance(wrapper, dict):
                raise APIError(400, "response_format.json_schema must be an object holding `schema`", param="response_format")
            sources.append(("json_schema", wrapper.get("schema", {}), "response_format"))
        elif kind != "text":
            raise APIError(400, f"response_format.type must be text, json_object or json_schema, not {kind!r}",
                           param="response_format")  # fmt: skip
    if body.json_schema is not None:
        sources.append(("json_schema", body.json_schema, "json_schema"))
    if body.grammar is not None:
        sources.append(("gbnf", body.grammar, "grammar"))
    if len(sources) > 1:
        fields = ", ".join(f for _, _, f in sources)
        raise APIError(400, f"give one of response_format, json_schema and grammar, not {fields}", param=sources[1][2])
    if not sources:
        return None
    kind, source, field = sources[0]
    return compile_grammar(kind, source, field), field


async def _choices(head: Head, body: _Common, req: EngineRequest) -> list[EngineRequest]:
    """The engine requests of `body.n` choices: each its own grammar matcher and, when seeded, its
    own seed (seed + index), so seeded sampled choices differ and each one is reproducible."""
    from dataclasses import replace

    engine = head.engine
    if engine.max_queue is not None and body.n > engine.n_slots + engine.max_queue:
        raise APIError(400, f"n={body.n} choices are more than this server holds at once ({engine.n_slots} slots + "
                            f"--max-queue {engine.max_queue})", param="n")  # fmt: skip
    grammar = await asyncio.to_thread(_grammar, body)
    if grammar is not None:  # built on the model's llguidance tokenizer: the first one builds it (seconds)
        req.constraint = await asyncio.to_thread(engine.grammars.constraint, *grammar)
    reqs = [req]
    for i in range(1, body.n):
        params = req.params if req.params.seed is None else replace(req.params, seed=(req.params.seed + i) % 2**64)
        reqs.append(replace(req, params=params, constraint=req.constraint and req.constraint.copy()))
    return reqs


def _usage(finals: list[Event]) -> dict | None:
    """One usage for all choices: the prompt once, every choice's completion tokens."""
    usages = [ev.usage for ev in finals if ev.usage]
    if not usages:
        return None
    completion = sum(u["completion_tokens"] for u in usages)
    return {**usages[0], "completion_tokens": completion, "total_tokens": usages[0]["prompt_tokens"] + completion}


def _speculative(engine, body: _Common) -> SpecConfig | None:
    """The request's speculative override, validated against what this server can draft with."""
    over = {"speculative": body.speculative} if body.speculative is not None else {}
    for key in ("n_max", "n_min", "p_min"):
        if getattr(body, f"speculative_{key}") is not None:
            over[f"speculative.{key}"] = getattr(body, f"speculative_{key}")
    try:
        return engine.spec.request_config(over)
    except UserError as e:
        raise APIError(400, str(e), param="speculative") from None


def _stops(stop: Stop) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not s for s in stops):
        raise APIError(400, "stop strings must not be empty", param="stop")
    if len(stops) > 16:
        raise APIError(400, "at most 16 stop strings", param="stop")
    return stops


class _Run:
    """The engine requests of one HTTP request (one per choice) seen from asyncio: their events
    arrive on one queue via call_soon_threadsafe, tagged with the choice index."""

    def __init__(self, head: Head, http: Request, reqs: list[EngineRequest]):
        self.head, self.http, self.reqs = head, http, reqs
        self.record = record_of(http)
        self.queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        for i, req in enumerate(reqs):
            req.sink = lambda ev, i=i: loop.call_soon_threadsafe(self.queue.put_nowait, (i, ev))
        if head.cfg.role == "prefill":
            raise APIError(400, "this worker only prefills for decode heads (--role prefill): send requests to a decode head")
        try:
            for req in reqs:
                head.engine.submit(req)
        except Exception:  # a full queue refuses the whole request, not some of its choices
            self._cancel()
            raise

    def _cancel(self) -> None:
        for req in self.reqs:
            self.head.engine.cancel(req)

    async def events(self) -> AsyncIterator[tuple[int, Event]]:
        """(choice index, event) until every choice has finished; a client that goes away cancels
        them (their slots are freed at once)."""
        finals: list[Event] = []
        try:
            while len(finals) < len(self.reqs):
                try:
                    i, ev = await asyncio.wait_for(self.queue.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    if await self.http.is_disconnected():
                        return
                    continue
                if ev.finish_reason is not None:
                    finals.append(ev)
                    if self.record is not None:
                        self.record.usage(_usage(finals))
                        if ev.error is not None:  # a stream has sent its 200 already: the log says why it ended
                            self.record.reason = describe(ev.error)
                yield i, ev
        finally:
            self._cancel()


def _generation_error(ev: Event) -> APIError:
    """A failed generation by the type of its exception: a peer gone away (retry once it is back) is
    503, anything else 500."""
    message = f"generation failed: {describe(ev.error)}"
    if isinstance(ev.error, Unavailable):
        return APIError(503, message, "unavailable_error", retry_after=ev.error.retry_after)
    return APIError(500, message, "server_error")


def _stream_error(ev: Event) -> dict:
    e = _generation_error(ev)
    return {"error": {"message": describe(ev.error), "type": e.type, "param": None, "code": str(e.status)}}


def _check_finish(ev: Event) -> None:
    if ev.finish_reason == "error":
        raise _generation_error(ev)


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


# ---- the app -----------------------------------------------------------------------------------


LOADING_RETRY_S = 5


def _engine(head: Head):
    if not head.ready:
        raise APIError(503, "Loading model", "unavailable_error", retry_after=LOADING_RETRY_S)
    return head.engine


def create_app(head: Head) -> FastAPI:
    app = FastAPI(title="Hydra head", version="0.1.0")
    app.state.head = head
    from .api_embeddings import embedding_routes  # it reads this module's request runner

    app.add_middleware(Gate, api_key=head.cfg.api_key, max_body=head.cfg.max_body)
    app.add_middleware(Cors, origins=head.cfg.cors_origins)  # outermost: a preflight needs no key
    add_observation_routes(app, head.status, head.metrics if head.cfg.metrics else None)
    app.include_router(embedding_routes(head))

    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        return e.response()

    @app.exception_handler(Unavailable)  # Engine.submit: the queue is full (Overloaded)
    async def _unavailable(_, e: Unavailable):
        code = "server_overloaded" if isinstance(e, Overloaded) else None
        return error_response(503, str(e), "unavailable_error", code=code, retry_after=e.retry_after)

    @app.exception_handler(UserError)  # sampling.InvalidParam names the parameter
    async def _user(_, e: UserError):
        return error_response(400, str(e), "invalid_request_error", getattr(e, "param", None))

    @app.exception_handler(RequestValidationError)
    async def _validation(_, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {"loc": (), "msg": "invalid request"}
        msg = "; ".join(f"{_loc_param(x.get('loc', ())) or 'body'}: {x.get('msg')}" for x in errs[:5])
        return error_response(400, msg or "invalid request", "invalid_request_error", _loc_param(first.get("loc", ())))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_, e: StarletteHTTPException):
        return error_response(e.status_code, str(e.detail), "invalid_request_error" if e.status_code < 500 else "server_error")

    @app.get("/v1/models")
    @app.get("/models", include_in_schema=False)
    async def models():
        data = []
        if head.status.startup_stage >= 2:
            meta = {"n_ctx": head.cfg.model.ctx, "n_vocab": head.tok.vocab_size, **head.status.model.to_json()}
            data.append({"id": head.model_name, "aliases": list(head.cfg.aliases), "tags": list(head.cfg.tags),
                         "object": "model", "created": head.created, "owned_by": "hydra", "meta": meta})  # fmt: skip
        return {"object": "list", "data": data}

    @app.get("/slots")
    async def slots(fail_on_no_slot: str | None = None):
        if not head.cfg.slots:
            raise APIError(501, "This server does not support slots endpoint. Start it with `--slots`",
                           "not_supported_error")  # fmt: skip
        info = _llama_slots(_engine(head))
        if fail_on_no_slot and all(s["is_processing"] for s in info):
            raise APIError(503, "no slot available", "unavailable_error")
        return info

    @app.post("/slots/{slot}")
    async def slot_action(slot: int, action: str, body: SlotFileBody | None = None):
        """llama-server's slot save / restore / erase, files under --slot-save-path."""
        engine = _engine(head)
        if action == "erase":
            return {"id_slot": slot, "n_erased": await asyncio.to_thread(engine.erase_slot, slot)}
        if action not in ("save", "restore"):
            raise APIError(400, f"action must be save, restore or erase, not {action!r}", param="action")
        folder = head.cfg.slot_save_path
        if folder is None:
            raise APIError(501, "slot save/restore is off: start the server with --slot-save-path", "not_supported_error")
        name = body.filename if body else ""
        if not name or "/" in name or "\\" in name or name.startswith("."):
            raise APIError(400, f"filename {name!r} must be a plain file name", param="filename")
        path, t0 = folder / name, time.perf_counter()
        if action == "save":
            def save():
                with open(path, "wb") as f:
                    return engine.save_slot(slot, f.write)

            n, written = await asyncio.to_thread(save)
            return {"id_slot": slot, "filename": name, "n_saved": n, "n_written": written,
                    "timings": {"save_ms": (time.perf_counter() - t0) * 1e3}}  # fmt: skip
        if not path.is_file():
            raise APIError(404, f"no saved slot named {name!r}", "not_found_error", "filename")
        data = await asyncio.to_thread(path.read_bytes)
        n = await asyncio.to_thread(engine.restore_slot, slot, data)
        return {"id_slot": slot, "filename": name, "n_restored": n, "n_read": len(data),
                "timings": {"restore_ms": (time.perf_counter() - t0) * 1e3}}  # fmt: skip

    @app.post("/tokenize")
    async def tokenize(body: TokenizeBody):
        _engine(head)
        return await asyncio.to_thread(_tokenize, head, body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeBody):
        _engine(head)
        bad = next((t for t in body.tokens if not 0 <= t < head.tok.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary of {head.tok.vocab_size}", param="tokens")
        return {"content": await asyncio.to_thread(head.tok.decode, body.tokens)}

    @app.post("/v1/completions")
    @app.post("/completions", include_in_schema=False)
    async def completions(body: CompletionBody, http: Request):
        from .sequence import Request as EngineRequest

        engine = _engine(head)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(400, "only one prompt per request is supported", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = await asyncio.to_thread(head.tok.encode, prompt, add_special=True, parse_special=True)
            prompt_text = prompt
        else:
            ids = list(prompt)
            bad = next((t for t in ids if not 0 <= t < head.tok.vocab_size), None)
            if bad is not None:
                raise APIError(400, f"token id {bad} is outside the vocabulary of {head.tok.vocab_size}", param="prompt")
            prompt_text = await asyncio.to_thread(head.tok.decode, ids, skip_special=True) if body.echo else ""
        max_tokens = body.max_tokens if body.max_tokens is not None else 16
        engine.check(len(ids), max_tokens)
        req = EngineRequest(
            prompt=ids, params=_sampling(head, body, body.logprobs), max_tokens=max_tokens, stop=_stops(body.stop),
            ignore_eos=body.ignore_eos, prompt_logprobs=body.logprobs if body.echo and body.logprobs is not None else None,
            spec=_speculative(engine, body), cache_prompt=body.cache_prompt,
        )  # fmt: skip
        return await _respond_completion(head, http, body, await _choices(head, body, req), prompt_text)

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions", include_in_schema=False)
    async def chat_completions(body: ChatBody, http: Request):
        from .sequence import Request as EngineRequest

        engine = _engine(head)
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        ids = await asyncio.to_thread(_chat_prompt, head, messages)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if max_tokens is None:  # llama-server's --n-predict: the server's default, within the context
            room = max(engine.n_ctx - len(ids), 0)
            max_tokens = room if head.cfg.n_predict < 0 else min(head.cfg.n_predict, room)
        engine.check(len(ids), max_tokens)
        n_top = (body.top_logprobs or 0) if body.logprobs else None
        req = EngineRequest(prompt=ids, params=_sampling(head, body, n_top), max_tokens=max_tokens,
                            stop=_stops(body.stop), ignore_eos=body.ignore_eos, spec=_speculative(engine, body),
                            cache_prompt=body.cache_prompt)  # fmt: skip
        return await _respond_chat(head, http, body, await _choices(head, body, req))

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
            p = seq.req.params
            entry.update(
                n_prompt_tokens_processed=max(min(seq.n_past, seq.n_prompt) - seq.n_cached, 0),
                n_prompt_tokens_cache=seq.n_cached,
                params={"n_predict": seq.req.max_tokens, "max_tokens": seq.req.max_tokens, "seed": p.seed,
                        "temperature": p.temperature, "top_k": p.top_k, "top_p": p.top_p, "min_p": p.min_p,
                        "repeat_last_n": p.repeat_last_n, "repeat_penalty": p.repeat_penalty,
                        "presence_penalty": p.presence_penalty, "frequency_penalty": p.frequency_penalty,
                        "ignore_eos": seq.req.ignore_eos, "stop": seq.req.stop, "n_probs": p.logprobs or 0},
                next_token=[{"has_next_token": seq.finish_reason is None, "n_remain": seq.req.max_tokens - seq.n_gen,
                             "n_decoded": seq.n_gen}],
            )  # fmt: skip
        out.append(entry)
    return out


def _tokenize(head: Head, body: TokenizeBody) -> dict:
    ids = head.tok.encode(body.content, add_special=body.add_special, parse_special=body.parse_special)
    if not body.with_pieces:
        return {"tokens": ids}
    pieces = []
    for t in ids:
        raw = head.tok.token_bytes(t)
        try:
            piece: Any = raw.decode("utf-8")
        except UnicodeDecodeError:
            piece = list(raw)
        pieces.append({"id": t, "piece": piece})
    return {"tokens": pieces}


def _chat_prompt(head: Head, messages: list[dict]) -> list[int]:
    from .chat import apply_chat_template

    text = apply_chat_template(head.tok, head.gguf, messages, add_generation_prompt=True)
    return head.tok.encode(text, add_special=True, parse_special=True)


async def _respond_completion(head: Head, http: Request, body: CompletionBody, reqs: list[EngineRequest], prompt_text: str):
    cid, created, n = f"cmpl-{uuid.uuid4().hex}", int(time.time()), len(reqs)
    want_lp = body.logprobs is not None
    lps = [_CompletionLogprobs(head, body.return_tokens_as_token_ids) for _ in reqs]
    run = _Run(head, http, reqs)

    def prompt_part(i: int, ev: Event) -> dict:
        return lps[i].add([(lp, None) for lp in ev.prompt_logprobs])

    def gen_part(i: int, ev: Event) -> dict | None:
        if not want_lp:
            return None
        return lps[i].add([(t.logprob, t.text) for t in ev.tokens if t.logprob is not None])

    def chunk(i: int, text: str, logprobs, finish=None, **extra) -> dict:
        choice = {"text": text, "index": i, "logprobs": logprobs, "finish_reason": finish}
        return {"id": cid, "object": "text_completion", "created": created, "model": head.model_name,
                "choices": [choice], **extra}  # fmt: skip

    if body.stream:

        async def stream():
            echoed = [not body.echo] * n
            finals: list[Event] = []
            async for i, ev in run.events():
                if ev.finish_reason == "error":
                    yield _sse(_stream_error(ev))
                    break
                if ev.prompt_logprobs is not None:
                    yield _sse(chunk(i, "" if echoed[i] else prompt_text, prompt_part(i, ev)))
                    echoed[i] = True
                    continue
                if not echoed[i]:
                    yield _sse(chunk(i, prompt_text, None))
                    echoed[i] = True
                if ev.finish_reason is None:
                    yield _sse(chunk(i, ev.text, gen_part(i, ev)))
                    continue
                finals.append(ev)
                last = {"usage": _usage(finals), "timings": ev.timings} if len(finals) == n else {}
                yield _sse(chunk(i, ev.text, gen_part(i, ev) if ev.tokens else None, ev.finish_reason, **last))
            yield b"data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

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
        _check_finish(ev)
    choices = [chunk(i, (prompt_text if body.echo else "") + "".join(texts[i]),
                     _merge_logprobs(parts[i]) if want_lp else None, finals[i].finish_reason)["choices"][0]
               for i in range(n)]  # fmt: skip
    return {"id": cid, "object": "text_completion", "created": created, "model": head.model_name,
            "choices": choices, "usage": _usage(finals), "timings": finals[0].timings}  # fmt: skip


async def _respond_chat(head: Head, http: Request, body: ChatBody, reqs: list[EngineRequest]):
    cid, created, n = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), len(reqs)
    as_ids = body.return_tokens_as_token_ids
    run = _Run(head, http, reqs)

    def chunk(i: int, delta: dict, tokens: list[GenToken], finish=None, **extra) -> dict:
        logprobs = {"content": _chat_logprob_content(head, tokens, as_ids)} if body.logprobs and tokens else None
        choice = {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": head.model_name,
                "choices": [choice], **extra}  # fmt: skip

    if body.stream:
        include_usage = bool((body.stream_options or {}).get("include_usage"))

        async def stream():
            for i in range(n):
                yield _sse(chunk(i, {"role": "assistant", "content": ""}, []))
            finals: list[Event] = []
            async for i, ev in run.events():
                if ev.finish_reason == "error":
                    yield _sse(_stream_error(ev))
                    break
                delta = {"content": ev.text} if ev.text else {}
                if ev.finish_reason is None:
                    yield _sse(chunk(i, delta, ev.tokens))
                    continue
                finals.append(ev)
                yield _sse(chunk(i, delta, ev.tokens, ev.finish_reason, timings=ev.timings))
                if include_usage and len(finals) == n:
                    yield _sse({"id": cid, "object": "chat.completion.chunk", "created": created,
                                "model": head.model_name, "choices": [], "usage": _usage(finals)})  # fmt: skip
            yield b"data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    texts, tokens, finals = [[] for _ in reqs], [[] for _ in reqs], [None] * n
    async for i, ev in run.events():
        texts[i].append(ev.text)
        tokens[i] += ev.tokens
        if ev.finish_reason is not None:
            finals[i] = ev
    if None in finals:
        return Response(status_code=499)
    for ev in finals:
        _check_finish(ev)

    def choice(i: int) -> dict:
        logprobs = {"content": _chat_logprob_content(head, tokens[i], as_ids)} if body.logprobs else None
        message = {"role": "assistant", "content": "".join(texts[i])}
        return {"index": i, "message": message, "logprobs": logprobs, "finish_reason": finals[i].finish_reason}

    return {"id": cid, "object": "chat.completion", "created": created, "model": head.model_name,
            "choices": [choice(i) for i in range(n)], "usage": _usage(finals), "timings": finals[0].timings}  # fmt: skip


# ---- serve -----------------------------------------------------------------------------------
