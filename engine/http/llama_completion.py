"""llama-server's /completion (and /completions) and /infill: their bodies, the completion object
they answer with (`content`, `tokens`, `stop`, `stop_type`, `timings`, `generation_settings`,
`completion_probabilities` for `n_probs`, ...), a list of them for a list of prompts; streamed, one
`data: {...}` per token and a last one with `stop: true`, no `[DONE]`. The routes are registered by
llama_routes.py."""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Union

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import Field

from ..serving.context_shift import UNLIMITED, n_predict_of
from .bodies import MAX_LOGPROBS, CommonBody, sampler_fields
from .common import constrain, pinned_slot, ready_engine, sampling_params, speculative_config, stop_list
from .errors import APIError
from .limits import json_response
from .prompts import tokenize_mixed
from .streaming import Run, check_finish, engine_share, sse, stream_error

if TYPE_CHECKING:
    from ..serving.sequence import Event, GenToken
    from .handle import Head

# The samplers llama-server names that we apply, in our fixed order (sampling.py); others are refused.
SAMPLERS = ("penalties", "temperature", "top_k", "top_p", "min_p")
# Fields llama-server reports in generation_settings for samplers we do not have, at their "off" values.
OFF_SAMPLERS = {
    "dynatemp_range": 0.0,
    "dynatemp_exponent": 1.0,
    "top_n_sigma": -1.0,
    "xtc_probability": 0.0,
    "xtc_threshold": 0.1,
    "typical_p": 1.0,
    "dry_multiplier": 0.0,
    "dry_base": 1.75,
    "dry_allowed_length": 2,
    "dry_penalty_last_n": -1,
    "mirostat": 0,
    "mirostat_tau": 5.0,
    "mirostat_eta": 0.1,
    "adaptive_target": -1.0,
    "adaptive_decay": 0.9,
}

Prompt = Union[str, list[Any], dict[str, Any]]


class NativeCompletionBody(CommonBody):
    prompt: Prompt = ""
    n_predict: int | None = Field(None, ge=-1)
    max_tokens: int | None = Field(None, ge=-1)  # OpenAI's name, an alias of n_predict
    n_probs: int = Field(0, ge=0, le=MAX_LOGPROBS)
    return_tokens: bool = False
    samplers: list[str] | None = None
    response_fields: list[str] | None = None
    post_sampling_probs: bool = False  # n_probs as probabilities of the distribution drawn from


class InfillBody(NativeCompletionBody):
    prompt: str = ""
    input_prefix: str
    input_suffix: str
    input_extra: list[dict[str, Any]] = []


def n_predict_for(head: Head, requested: int | None) -> int:
    """llama-server's n_predict: the request's, else (absent or -1) the server's `-n` (-1: unbounded,
    `UNLIMITED`); generation stops where the slot's context ends (with context shift it goes on)."""
    n = requested if requested is not None and requested >= 0 else head.cfg.n_predict
    return UNLIMITED if n < 0 else n


def _probs(head: Head, tokens: list[GenToken], post_sampling: bool) -> list[dict]:
    """llama-server's completion_probabilities: each token with its logprob and its top alternatives
    (post_sampling: probabilities, `prob` / `top_probs`)."""

    def entry(tid: int, lp: float, text: str | None = None) -> dict:
        raw = head.tok.token_bytes(tid)
        value = {"prob": math.exp(lp)} if post_sampling else {"logprob": lp}
        return {
            "id": tid,
            "token": text if text is not None else raw.decode("utf-8", "ignore"),
            "bytes": list(raw),
            **value,
        }

    top = "top_probs" if post_sampling else "top_logprobs"
    return [
        {**entry(t.id, t.logprob.logprob, t.text), top: [entry(i, lp) for i, lp in t.logprob.top]}
        for t in tokens
        if t.logprob is not None
    ]


def _nested(fields: list[str], doc: dict) -> dict:
    """llama-server's response_fields: only these, "a/b" read from doc["a"]["b"] and named "a/b"."""
    out = {}
    for f in fields:
        value: Any = doc
        for part in f.split("/"):
            value = value.get(part) if isinstance(value, dict) else None
        if value is not None:
            out[f] = value
    return out


class _Completion:
    """One prompt's llama-server completion: the engine request and the objects it answers with."""

    def __init__(self, head: Head, body: NativeCompletionBody, ids: list[int], index: int):
        from ..serving.sequence import Request as EngineRequest

        engine = ready_engine(head)
        if body.samplers is not None:
            unknown = [s for s in body.samplers if s not in SAMPLERS]
            if unknown:
                raise APIError(
                    400, f"samplers {unknown} are not supported (available: {', '.join(SAMPLERS)})", param="samplers"
                )
        requested = body.n_predict if body.n_predict is not None else body.max_tokens
        engine.check(len(ids), 0)
        self.head, self.body, self.ids, self.index = head, body, ids, index
        self.params = replace(sampling_params(head, body, body.n_probs or None), post_sampling=body.post_sampling_probs)
        self.req: EngineRequest = EngineRequest(
            prompt=ids,
            params=self.params,
            max_tokens=n_predict_for(head, requested),
            stop=stop_list(body.stop),
            ignore_eos=body.ignore_eos,
            spec=speculative_config(engine, body),
            id_slot=pinned_slot(engine, body),
            cache_prompt=body.cache_prompt,
            timings_per_token=body.timings_per_token,
            return_progress=body.stream and body.return_progress,
            n_keep=body.n_keep,
            n_discard=body.n_discard,
        )
        self.text: list[str] = []
        self.tokens: list[GenToken] = []

    def generation_settings(self) -> dict:
        p, body = self.params, self.body
        n_predict = n_predict_of(self.req.max_tokens)
        return {
            "seed": p.seed,
            **sampler_fields(p),
            **OFF_SAMPLERS,
            "stop": self.req.stop,
            "max_tokens": n_predict,
            "n_predict": n_predict,
            "n_keep": body.n_keep if body.n_keep is not None else self.head.cfg.n_keep,
            "n_discard": body.n_discard,
            "ignore_eos": body.ignore_eos,
            "stream": body.stream,
            "logit_bias": [{"bias": None if b == float("-inf") else b, "token": t} for t, b in p.logit_bias],
            "n_probs": body.n_probs,
            "min_keep": 0,
            "samplers": list(body.samplers or SAMPLERS),
            "timings_per_token": body.timings_per_token,
            "post_sampling_probs": p.post_sampling,
            "lora": [],
        }

    def partial(self, text: str, tokens: list[GenToken], n_decoded: int) -> dict:
        out = {
            "index": self.index,
            "content": text,
            "tokens": [t.id for t in tokens],
            "stop": False,
            "id_slot": self.req.slot,
            "tokens_predicted": n_decoded,
            "tokens_evaluated": len(self.ids),
        }
        if self.body.n_probs:
            out["completion_probabilities"] = _probs(self.head, tokens, self.params.post_sampling)
        return out

    def final(self, ev: Event, content: str) -> dict:
        reason = "limit" if ev.finish_reason == "length" else ("word" if ev.stop_word else "eos")
        n_gen = ev.usage["completion_tokens"]
        out = {
            "index": self.index,
            "content": content,
            "tokens": [t.id for t in self.tokens] if self.body.return_tokens else [],
            "id_slot": self.req.slot,
            "stop": True,
            "model": self.head.model_name,
            "tokens_predicted": n_gen,
            "tokens_evaluated": len(self.ids),
            "generation_settings": self.generation_settings(),
            "prompt": self.head.tok.decode(self.ids),
            "has_new_line": "\n" in content,
            "truncated": ev.truncated,
            "stop_type": reason,
            "stopping_word": ev.stop_word,
            "tokens_cached": len(self.ids) + n_gen,
            "timings": ev.timings,
        }
        if self.body.n_probs and not self.body.stream:
            out["completion_probabilities"] = _probs(self.head, self.tokens, self.params.post_sampling)
        return _nested(self.body.response_fields, out) if self.body.response_fields else out

    async def run(self, http: Request) -> dict | None:
        final = None
        async for _, ev in Run(self.head, http, [self.req]).events():
            self.text.append(ev.text)
            self.tokens += ev.tokens
            if ev.finish_reason is not None:
                final = ev
        if final is None:
            return None
        check_finish(final)
        return self.final(final, "".join(self.text))

    async def stream(self, http: Request):
        """One chunk per token (llama-server sends each token's text and probabilities alone)."""
        n = 0
        async for _, ev in Run(self.head, http, [self.req]).events():
            if ev.finish_reason == "error":
                yield sse(stream_error(ev))
                return
            if ev.progress is not None:
                timings = {"timings": ev.timings} if ev.timings else {}
                yield sse({**self.partial("", [], n), "prompt_progress": ev.progress, **timings})
                continue
            self.tokens += ev.tokens
            pieces = _per_token(ev)
            for text, tokens in pieces[:-1] if ev.finish_reason is not None else pieces:
                n += len(tokens)
                chunk = self.partial(text, tokens, n)
                if ev.timings is not None:
                    chunk["timings"] = ev.timings
                yield sse(chunk)
            if ev.finish_reason is not None:
                last = pieces[-1][0] if pieces else ""
                yield sse(self.final(ev, last))


def _per_token(ev: Event) -> list[tuple[str, list[GenToken]]]:
    """An event's text split into one piece per token where the tokens' texts spell it (a held-back
    stop-string prefix released later, or cut, does not): else one piece with all of them."""
    tokens = ev.tokens
    if not tokens:
        return [(ev.text, [])] if ev.text or ev.finish_reason is not None else []
    joined = "".join(t.text for t in tokens[:-1])
    if len(tokens) > 1 and ev.text.startswith(joined):
        return [(t.text, [t]) for t in tokens[:-1]] + [(ev.text[len(joined) :], [tokens[-1]])]
    return [(ev.text, tokens)]


def infill_prompt(head: Head, body: InfillBody) -> list[int]:
    """llama-server's FIM layout: [extra chunks] [BOS] <PRE> prefix prompt <SUF> suffix <MID> (the
    repo-level pattern with <REP>/<SEP> when the vocabulary has them)."""
    tok, fim = head.tok, head.fim_tokens
    missing = [k for k in ("pre", "suf", "mid") if fim.get(k) is None]
    if missing:
        raise APIError(
            501,
            "Infill is not supported by this model: "
            + " ".join(
                f"{ {'pre': 'prefix', 'suf': 'suffix', 'mid': 'middle'}[k] } token is missing." for k in missing
            ),
            "not_supported_error",
        )
    for i, chunk in enumerate(body.input_extra):
        if not isinstance(chunk.get("text"), str):
            raise APIError(
                400,
                'extra_context chunk must contain a "text" field with a string value',
                param=f"input_extra[{i}].text",
            )
        if "filename" in chunk and not isinstance(chunk["filename"], str):
            raise APIError(
                400, 'extra_context chunk\'s "filename" field must be a string', param=f"input_extra[{i}].filename"
            )
    enc = lambda text: tok.encode(text, add_special=False, parse_special=False)  # noqa: E731
    extra: list[int] = []
    if fim.get("rep") is not None:
        extra += [fim["rep"], *enc("myproject\n")]
    for chunk in body.input_extra:
        if fim.get("sep") is not None:
            extra += [fim["sep"], *enc(chunk.get("filename", "tmp") + "\n")]
        else:
            extra += enc("\n\n--- snippet ---\n\n")
        extra += enc(chunk["text"])
    if fim.get("sep") is not None:
        extra += [fim["sep"], *enc("filename\n")]
    n_ctx, n_batch = head.engine.n_ctx, head.engine.scheduler.batch_tokens
    prompt = tokenize_mixed(head, body.prompt, add_special=False, parse_special=False)
    prefix, suffix = enc(body.input_prefix), enc(body.input_suffix)
    # llama-server keeps prefix:suffix at 3:1 of a batch, and fills the rest of the context with extra chunks
    prefix = prefix[len(prefix) - min(len(prefix), 3 * (n_batch // 4)) :]
    suffix = suffix[: min(len(suffix), max(0, n_batch // 4 - (2 + len(prompt))))]
    n_predict = head.cfg.n_predict if head.cfg.n_predict >= 0 else 0
    n_extra = min(max(0, n_ctx - n_batch - 2 * n_predict), len(extra))
    bos = [tok.bos_id] if tok.add_bos and tok.bos_id is not None else []
    return extra[len(extra) - n_extra :] + bos + [fim["pre"], *prefix, *prompt, fim["suf"], *suffix, fim["mid"]]


async def respond(head: Head, http: Request, body: NativeCompletionBody, prompts: list[list[int]]):
    """A list of prompts runs as `streaming.Run`'s choices do: at most `engine_share` in the engine at once."""
    runs = [_Completion(head, body, ids, i) for i, ids in enumerate(prompts)]
    await constrain(head, body, [c.req for c in runs])
    turns = asyncio.Semaphore(engine_share(head.engine.n_slots))
    if body.stream:

        async def stream():
            queue: asyncio.Queue[bytes | None] = asyncio.Queue()

            async def pump(c: _Completion):
                try:
                    async with turns:
                        async for chunk in c.stream(http):
                            await queue.put(chunk)
                finally:
                    await queue.put(None)

            tasks = [asyncio.create_task(pump(c)) for c in runs]
            try:
                left = len(tasks)
                while left:
                    chunk = await queue.get()
                    if chunk is None:
                        left -= 1
                    else:
                        yield chunk
            finally:
                for t in tasks:
                    t.cancel()

        return StreamingResponse(stream(), media_type="text/event-stream")

    async def run(c: _Completion):
        async with turns:
            return await c.run(http)

    if len(runs) == 1:  # its Run refuses it at once when the queue is full
        results = [await runs[0].run(http)]
    else:
        results = await asyncio.gather(*(run(c) for c in runs))
    if any(r is None for r in results):  # the client left; nobody reads this
        return Response(status_code=499)
    return await json_response(results[0] if len(results) == 1 else list(results), head.cfg.max_response)
