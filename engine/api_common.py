"""What the OpenAI routes (api.py) and llama-server's native routes (llama_routes.py) share: the
common request fields and how they become engine parameters (sampling with the server's defaults,
stop strings, speculative override), prompts as text / token ids / llama-server's mixed lists, the
chat prompt, the bridge from an engine request to asyncio (`Run`), SSE framing and how a failed
generation is answered.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from typing import TYPE_CHECKING, Any, AsyncIterator, Union

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field

from .errors import Unavailable, UserError, describe
from .http_errors import APIError
from .http_gate import record_of

if TYPE_CHECKING:  # the engine's modules bring torch: imported when the model loads, after the port is up
    from .sampling import SamplingParams
    from .sequence import Event
    from .sequence import Request as EngineRequest
    from .speculative import SpecConfig
    from .workers.head import HeadWorker as Head

DISCONNECT_POLL_S = 0.25
MAX_LOGPROBS = 20  # = sampling.MAX_LOGPROBS, which also checks it
LOADING_RETRY_S = 5
SEED_RANDOM = -1  # llama-server's "pick a seed": a random one per request

Stop = Union[str, list[str], None]
PROMPT_FORMS = ("\"prompt\" elements must be a string, a list of tokens, a JSON object containing a prompt string, "
                "or a list of mixed strings & tokens.")  # llama-server's words


class CommonBody(BaseModel):
    """Fields every generation request may carry (OpenAI's and llama-server's names)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

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
    timings_per_token: bool = False  # llama-server: `timings` on every streamed chunk, not just the last
    n: int = Field(1, ge=1, le=1, description="only one choice per request is supported")
    # Speculative decoding for this request: {"type": "off"|"ngram"|"draft", "n_max", "n_min", "p_min"},
    # or llama-server's flat fields; checked against the server's drafters by the engine's Speculator.
    speculative: Union[bool, dict[str, Any], None] = None
    speculative_n_max: int | None = Field(None, alias="speculative.n_max", ge=0)
    speculative_n_min: int | None = Field(None, alias="speculative.n_min", ge=0)
    speculative_p_min: float | None = Field(None, alias="speculative.p_min", ge=0.0, le=1.0)


SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repeat_penalty", "repeat_last_n", "presence_penalty",
                   "frequency_penalty", "seed")  # fmt: skip


def sampling_params(head: Head, body: CommonBody, logprobs: int | None) -> SamplingParams:
    """The request's sampling: its own fields, else the server's defaults (`--temp`, `--seed`, ...).
    The seed is always fixed here (a random one when none is given) so that responses can report it."""
    from .sampling import SamplingParams

    given = {**head.cfg.sampling.given(), **{k: getattr(body, k) for k in SAMPLING_FIELDS if getattr(body, k) is not None}}
    if given.get("seed", SEED_RANDOM) == SEED_RANDOM:
        given["seed"] = secrets.randbits(32)
    return SamplingParams(**given, logprobs=logprobs)


def speculative_config(engine, body: CommonBody) -> SpecConfig | None:
    """The request's speculative override, validated against what this server can draft with."""
    over = {"speculative": body.speculative} if body.speculative is not None else {}
    for key in ("n_max", "n_min", "p_min"):
        if getattr(body, f"speculative_{key}") is not None:
            over[f"speculative.{key}"] = getattr(body, f"speculative_{key}")
    try:
        return engine.spec.request_config(over)
    except UserError as e:
        raise APIError(400, str(e), param="speculative") from None


def stop_list(stop: Stop) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not s for s in stops):
        raise APIError(400, "stop strings must not be empty", param="stop")
    if len(stops) > 16:
        raise APIError(400, "at most 16 stop strings", param="stop")
    return stops


def check_token_ids(head: Head, ids: list[int], param: str = "prompt") -> list[int]:
    bad = next((t for t in ids if not 0 <= t < head.tok.vocab_size), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is outside the vocabulary of {head.tok.vocab_size}", param=param)
    return ids


def tokenize_mixed(head: Head, prompt, add_special: bool = True, parse_special: bool = True) -> list[int]:
    """llama-server's prompt forms in one: text, token ids, or a list mixing both (only the first
    element, if it is text, gets the BOS), or {"prompt_string": text}."""
    if isinstance(prompt, dict):
        if "multimodal_data" in prompt:
            raise APIError(400, "Multimodal data provided, but model does not support multimodal requests.",
                           param="prompt")  # fmt: skip
        if not isinstance(prompt.get("prompt_string"), str):
            raise APIError(400, "a prompt object must hold a prompt_string", param="prompt")
        prompt = prompt["prompt_string"]
    if isinstance(prompt, str):
        return head.tok.encode(prompt, add_special=add_special, parse_special=parse_special)
    if not isinstance(prompt, list):
        raise APIError(400, PROMPT_FORMS, param="prompt")
    ids: list[int] = []
    for i, part in enumerate(prompt):
        if isinstance(part, str):
            ids += head.tok.encode(part, add_special=add_special and i == 0, parse_special=parse_special)
        elif isinstance(part, int) and not isinstance(part, bool):
            ids.append(part)
        else:
            raise APIError(400, PROMPT_FORMS, param="prompt")
    return check_token_ids(head, ids)


def split_prompts(prompt) -> list:
    """llama-server's rule: a list that holds no token id at its top level is a list of prompts;
    anything else is one prompt."""
    if isinstance(prompt, list) and prompt and not any(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        return prompt
    return [prompt]


def chat_prompt(head: Head, messages: list[dict], add_generation_prompt: bool = True,
                continue_final_message: bool | None = None, **extra) -> str:  # fmt: skip
    """The chat prompt text (tokenize it with add_special=True, parse_special=True)."""
    return head.chat_template.prompt(messages, add_generation_prompt, continue_final_message, **extra)


class Run:
    """One engine request seen from asyncio: events arrive on a queue via call_soon_threadsafe."""

    def __init__(self, head: Head, http: Request, req: EngineRequest):
        self.head, self.http, self.req = head, http, req
        self.record = record_of(http)
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        req.sink = lambda ev: loop.call_soon_threadsafe(self.queue.put_nowait, ev)
        head.engine.submit(req)

    async def events(self) -> AsyncIterator[Event]:
        """The request's events; a client that goes away cancels it (its slot is freed at once)."""
        loop = asyncio.get_running_loop()
        checked = loop.time()
        try:
            while True:
                try:
                    ev = await asyncio.wait_for(self.queue.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    ev = None
                # checked while events flow too: a non-streamed request's client may leave mid-generation
                if ev is None or loop.time() - checked >= DISCONNECT_POLL_S:
                    checked = loop.time()
                    if await self.http.is_disconnected():
                        return
                if ev is None:
                    continue
                if ev.finish_reason is not None and self.record is not None:
                    self.record.usage(ev.usage)
                    if ev.error is not None:  # a stream has sent its 200 already: the log says why it ended
                        self.record.reason = describe(ev.error)
                yield ev
                if ev.finish_reason is not None:
                    return
        finally:
            self.head.engine.cancel(self.req)


def generation_error(ev: Event) -> APIError:
    """A failed generation by the type of its exception: a peer gone away (retry once it is back) is
    503, anything else 500."""
    message = f"generation failed: {describe(ev.error)}"
    if isinstance(ev.error, Unavailable):
        return APIError(503, message, "unavailable_error", retry_after=ev.error.retry_after)
    return APIError(500, message, "server_error")


def stream_error(ev: Event) -> dict:
    e = generation_error(ev)
    return {"error": {"message": describe(ev.error), "type": e.type, "param": None, "code": str(e.status)}}


def check_finish(ev: Event) -> None:
    if ev.finish_reason == "error":
        raise generation_error(ev)


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def ready_engine(head: Head):
    if not head.ready:
        raise APIError(503, "Loading model", "unavailable_error", retry_after=LOADING_RETRY_S)
    return head.engine
