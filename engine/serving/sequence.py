"""What flows through the engine: a `Request` as the consumer submits it, the `Sequence` it becomes
once it holds a slot, and the `Event`s (with their `GenToken`s) its sink receives.

Kept apart from the scheduler and the output processor so both can work on the same plain state.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from ..errors import ContextOverflow
from .sampling_params import InvalidParam, Sampler, SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from ..spec import SpecConfig
    from ..text.structured import Constraint


@dataclass
class GenToken:
    """A generated token released to the consumer: its id, its text piece, its logprobs if asked."""

    id: int
    text: str
    logprob: TokenLogprob | None = None


@dataclass
class Event:
    """What a request's sink receives: text and tokens as they are released; on the last event
    `finish_reason` ("stop", "length", "cancelled", "error"), `usage`, `timings`, the stop string
    that ended it (`stop_word`, "" when none did), on "error" the exception itself (`error`), so the
    API can answer by its type, and for an embedding request the prompt's final-norm hidden states
    (`hidden`, [n_prompt, n_embd] float32 on the CPU); with `Request.return_progress`, an event with
    only `progress` (llama-server's prompt_progress: total, cache, processed, time_ms) as the prompt is
    computed."""

    text: str = ""
    tokens: list[GenToken] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    usage: dict | None = None
    timings: dict | None = None
    error: BaseException | None = None
    hidden: torch.Tensor | None = None
    stop_word: str = ""
    progress: dict | None = None
    truncated: bool = False  # the context ran out: generation stopped there, or a context shift dropped tokens


@dataclass
class Request:
    prompt: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    prompt_logprobs: int | None = None  # score the prompt: logprob of each prompt token + top N
    spec: SpecConfig | None = None  # this request's speculative decoding; None: the engine's default
    cache_prompt: bool = True  # reuse the KV of a prefix a slot already holds (llama-server's default)
    embedding: bool = False  # run the prompt only and return its hidden states (Event.hidden), no tokens
    constraint: Constraint | None = None  # structured output: this request's own grammar matcher
    timings_per_token: bool = False  # every event carries the timings so far, not only the last
    return_progress: bool = False  # an Event.progress when it takes a slot and after each prompt chunk
    n_keep: int | None = None  # context shift: prompt tokens kept after the BOS (-1: all); None: the server's --keep
    n_discard: int = 0  # context shift: tokens dropped after the kept ones (0: half of the rest)
    # control tokens its text keeps (llama-server's preserved_tokens: a tool call's markers)
    preserved_tokens: frozenset[int] = frozenset()
    sink: Callable[[Event], None] = lambda ev: None
    id: int = 0
    slot: int = -1  # the slot the scheduler gave it (llama-server reports it as id_slot)
    id_slot: int = -1  # llama-server's id_slot: the slot it must run in (it waits for that one); -1: any
    cancelled: bool = False
    t_submit: float = field(default_factory=time.perf_counter)  # arrival: time to first token counts from here

    def check(self, n_ctx: int, vocab: int) -> None:
        """Refuse a prompt token outside the vocabulary, then what can never fit a slot (`check_fits`)."""
        bad = next((t for t in self.prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidParam(f"token id {bad} is outside the vocabulary of {vocab} tokens", "prompt")
        check_fits(len(self.prompt), self.max_tokens, n_ctx)


def check_fits(n_prompt: int, max_tokens: int, n_ctx: int) -> None:
    """Reject up front what can never fit a slot of `n_ctx` tokens (the API answers 400): a prompt
    that leaves no room. A max_tokens past the context is llama-server's n_predict: generation
    stops where the slot is full ("length", truncated), or goes on with context shift."""
    if n_prompt == 0:
        raise InvalidParam("the prompt is empty", "prompt")
    if max_tokens < 0:
        raise InvalidParam(f"max_tokens must be >= 0, got {max_tokens}", "max_tokens")
    if n_prompt >= n_ctx:
        raise ContextOverflow(n_prompt, n_ctx)


class Sequence:
    """A request bound to a slot (its KV rows): its tokens, how many of them are in the KV cache, and
    why it finished once it has. `tokens` are what the slot's KV holds, by position: a context shift
    (`shift`) takes tokens out of the middle, counted in `n_discarded`, so every token the request
    ever had is `n_total` (prompt and generated: the prompt/generation boundary and the output's
    place are counted in those)."""

    def __init__(self, req: Request, slot: int):
        self.req = req
        self.slot = slot
        self.tokens = list(req.prompt)
        self.n_prompt = len(req.prompt)
        self.n_past = 0  # tokens whose KV is written
        self.n_cached = 0  # of those, how many a previous request left in the slot (prompt cache)
        self.n_gen = 0
        self.n_discarded = 0  # tokens context shifts took out of `tokens` and the KV
        self.truncated = False  # the context ran out (Event.truncated)
        self.sampler = Sampler(req.params)
        self.n_drafted = 0  # draft tokens verified for this request, and how many were accepted
        self.n_accepted = 0
        self.t_start = time.perf_counter()  # when it took the slot: its prompt time counts from here
        # Prefill/decode disaggregation: True while the prompt's state is fetched from the prefill
        # worker (not scheduled meanwhile); `transfer` (contracts.status.Transfer) once it is decided.
        self.remote_prefill = False
        self.transfer = None
        self.finish_reason: str | None = None
        self.hidden: list[torch.Tensor] = []  # an embedding request's hidden states, chunk by chunk
        self.at_eog = False  # it ended on an end-of-generation token (counted, never shown)

    @property
    def prefilling(self) -> bool:
        return self.n_past + self.n_discarded < self.n_prompt

    @property
    def n_total(self) -> int:
        """Every token the request has had: those in `tokens` and those a context shift discarded."""
        return len(self.tokens) + self.n_discarded

    def since(self, i: int) -> list[int]:
        """The tokens from the `i`-th the request had (an index into `n_total`, past any discarded)."""
        return self.tokens[i - self.n_discarded :]

    def shift(self, keep: int, discard: int) -> None:
        """A context shift: the tokens at positions [keep, keep + discard) leave the KV, those after
        move down (the KV manager moved their KV)."""
        del self.tokens[keep : keep + discard]
        self.n_past -= discard
        self.n_discarded += discard
        self.truncated = True

    def append(self, tid: int) -> None:
        self.tokens.append(tid)
        self.n_gen += 1
        if self.req.constraint is not None:
            self.req.constraint.advance(tid)

    def take_back(self, n: int) -> None:
        """Forget the last `n` generated tokens: a stop string ended the text before them."""
        del self.tokens[len(self.tokens) - n :]
        self.n_gen -= n
