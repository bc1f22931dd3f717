"""What a request asks of sampling and what it gets back, as plain values (no torch: the HTTP
layer checks and reports them before the model loads): `SamplingParams` (checked on creation,
`InvalidParam` naming the field), `Sampler` (the parameters and the request's seed),
`TokenLogprob` (one position's logprobs). sampling.py turns logits into tokens with them."""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from ..errors import UserError

MAX_LOGPROBS = 20


class InvalidParam(UserError):
    """A request parameter out of range; `param` names it (the OpenAI error's `param` field)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    repeat_penalty: float = 1.0  # 1 = off; llama.cpp's: divide positive logits, multiply negative ones
    repeat_last_n: int = 64  # how many recent tokens the penalties look at; -1 = all
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logprobs: int | None = None  # None: none; N: the chosen token's logprob and the top N alternatives
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit; -inf bans it)
    post_sampling: bool = False  # logprobs of the distribution drawn from (after the transforms), not the raw logits

    def __post_init__(self):
        def check(ok: bool, param: str, what: str):
            if not ok:
                raise InvalidParam(f"{param} must be {what}, got {getattr(self, param)!r}", param)

        check(0.0 <= self.temperature <= 100.0, "temperature", "in [0, 100]")
        check(self.top_k >= 0, "top_k", ">= 0")
        check(0.0 < self.top_p <= 1.0, "top_p", "in (0, 1]")
        check(0.0 <= self.min_p <= 1.0, "min_p", "in [0, 1]")
        check(0.0 < self.repeat_penalty <= 100.0, "repeat_penalty", "in (0, 100]")
        check(self.repeat_last_n >= -1, "repeat_last_n", ">= -1")
        check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "in [-2, 2]")
        check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "in [-2, 2]")
        check(self.seed is None or -(2**63) <= self.seed < 2**64, "seed", "a 64-bit integer")
        check(self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, "logprobs", f"in [0, {MAX_LOGPROBS}]")
        check(
            all(t >= 0 and b == b and b != float("inf") for t, b in self.logit_bias),
            "logit_bias",
            "token ids >= 0 with finite biases (or -inf to ban)",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalised(self) -> bool:
        return self.repeat_last_n != 0 and (
            self.repeat_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
        )


class Sampler:
    """One request's sampling: its parameters and its seed (a random one when the request named none),
    fixed for the request's life. The math is the batched pipeline below."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.seed = (params.seed if params.seed is not None else secrets.randbits(63)) % (2**64)


@dataclass
class TokenLogprob:
    """One position: the token there, its logprob, and the top alternatives [(id, logprob)] best first."""

    token: int
    logprob: float | None
    top: list[tuple[int, float]]
