"""Turning logits into tokens: per-request sampling parameters, a per-request sampler, logprobs.

Order of the transforms (stochastic sampling): penalties → temperature → top-k → top-p → min-p →
multinomial draw with the request's own `torch.Generator`, so a request's seed alone fixes its
output whatever else shares the batch. temperature == 0 is greedy (argmax after the penalties).
Logprobs are taken from the raw logits (log-softmax before any transform), as OpenAI and vLLM
report them, unless a request asks for the sampled distribution's (`post_sampling`, llama-server's
post_sampling_probs).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch

from .errors import UserError

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
        check(all(t >= 0 and b == b and b != float("inf") for t, b in self.logit_bias), "logit_bias",
              "token ids >= 0 with finite biases (or -inf to ban)")  # fmt: skip

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalised(self) -> bool:
        return self.repeat_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclass
class TokenLogprob:
    """One position: the token there, its logprob, and the top alternatives [(id, logprob)] best first."""

    token: int
    logprob: float | None
    top: list[tuple[int, float]]


def _finite(x: torch.Tensor) -> torch.Tensor:
    """Extreme parameters (a temperature or penalty near 0) overflow float32: keep the order, drop NaN."""
    return torch.nan_to_num(x, nan=float("-inf"), posinf=torch.finfo(x.dtype).max)


class Sampler:
    """One request's sampler: its parameters and its random stream."""

    def __init__(self, params: SamplingParams):
        self.params = params
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        self.seed = seed % (2**64)
        self._generators: dict[torch.device, torch.Generator] = {}

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        """The request's generator on `device` (each device has its own stream, seeded alike)."""
        device = torch.device(device)
        gen = self._generators.get(device)
        if gen is None:
            gen = self._generators[device] = torch.Generator(device=device)
            gen.manual_seed(self.seed)
        return gen

    def penalise(self, logits: torch.Tensor, history: list[int]) -> torch.Tensor:
        """`logits[V]` with the repeat / presence / frequency penalties applied (a new tensor)."""
        p = self.params
        if not p.penalised or not history:
            return logits
        recent = history if p.repeat_last_n == -1 else history[-p.repeat_last_n :] if p.repeat_last_n else []
        if not recent:
            return logits
        ids, counts = torch.tensor(recent, device=logits.device).unique(return_counts=True)
        x = logits[ids]
        if p.repeat_penalty != 1.0:
            x = torch.where(x > 0, x / p.repeat_penalty, x * p.repeat_penalty)
        x = x - counts.to(x.dtype) * p.frequency_penalty - p.presence_penalty
        out = logits.clone()
        out[ids] = _finite(x)
        return out

    def _candidates(self, logits: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Temperature, top-k, top-p, min-p on penalised `logits[V]`: (candidate ids or None = all, their
        scaled logits, with -inf where filtered out)."""
        p = self.params
        x = _finite(logits / p.temperature)
        ids = None
        if p.top_k and p.top_k < x.numel():
            x, ids = torch.topk(x, p.top_k)  # sorted, best first
        if p.top_p < 1.0:
            if ids is None:
                x, ids = torch.sort(x, descending=True)
            probs = torch.softmax(x, -1)
            drop = torch.cumsum(probs, -1) - probs >= p.top_p  # the better tokens already hold top_p
            drop[0] = False  # the best token always stays (a top_p below float32's range rounds to 0)
            x = x.masked_fill(drop, float("-inf"))
        if p.min_p > 0.0:
            probs = torch.softmax(x, -1)
            x = x.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
        return ids, x

    def probs(self, logits: torch.Tensor, history: list[int]) -> torch.Tensor:
        """The distribution this sampler draws from, over the whole vocabulary (`logits[V]` → `[V]`)."""
        x = self.penalise(logits, history)
        if self.params.greedy:
            out = torch.zeros_like(x)
            out[x.argmax()] = 1.0
            return out
        ids, x = self._candidates(x)
        probs = torch.softmax(x, -1)
        if ids is None:
            return probs
        return torch.zeros_like(logits).scatter_(0, ids, probs)

    def sample(self, logits: torch.Tensor, history: list[int]) -> int:
        """One token from `logits[V]` (float32) given the request's tokens so far."""
        x = self.penalise(logits, history)
        if self.params.greedy:
            return int(x.argmax())
        ids, x = self._candidates(x)
        pick = torch.multinomial(torch.softmax(x, -1), 1, generator=self.generator(x.device))
        return int(pick if ids is None else ids[pick])


def apply_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """`logits[B, V]` with row i's `params[i].logit_bias` added (a new tensor when any row has one)."""
    biased = [i for i, p in enumerate(params) if p.logit_bias]
    if not biased:
        return logits
    out = logits.clone()
    for i in biased:
        ids, bias = zip(*params[i].logit_bias)
        out[i].index_add_(0, torch.tensor(ids, device=out.device), torch.tensor(bias, dtype=out.dtype, device=out.device))
    return out


def sample_batch(logits: torch.Tensor, samplers: list[Sampler], histories: list[list[int]]) -> list[int]:
    """One token per row of `logits[B, V]`; plain greedy rows share one argmax."""
    plain = [i for i, s in enumerate(samplers) if s.params.greedy and not s.params.penalised]
    out = [0] * len(samplers)
    if plain:
        # one device→host transfer for the whole batch; no row copy when every row is plain
        picks = (logits if len(plain) == len(samplers) else logits[plain]).argmax(-1).tolist()
        for i, t in zip(plain, picks):
            out[i] = t
    done = set(plain)
    for i, s in enumerate(samplers):
        if i not in done:
            out[i] = s.sample(logits[i], histories[i])
    return out


def sampled_logprob(sampler: Sampler, logits: torch.Tensor, history: list[int], token: int, n_top: int) -> TokenLogprob:
    """llama-server's post_sampling_probs: `token`'s logprob under the distribution `sampler` draws
    from (`logits[V]`), and the top `n_top` tokens that keep a nonzero probability there."""
    probs = sampler.probs(logits, history)
    vals, ids = torch.topk(probs, min(n_top, probs.numel()))
    top = [(i, float(torch.log(v))) for i, v in zip(ids.tolist(), vals) if v > 0]
    return TokenLogprob(token, float(torch.log(probs[token])), top)


def token_logprobs(logits: torch.Tensor, tokens: list[int], n_top: int) -> list[TokenLogprob]:
    """Logprob of `tokens[i]` under raw `logits[i]` and the `n_top` most likely alternatives."""
    if not tokens:
        return []
    lp = torch.log_softmax(logits.float(), -1)
    chosen = lp.gather(1, torch.tensor(tokens, device=lp.device).unsqueeze(1)).squeeze(1).tolist()
    if n_top > 0:
        vals, ids = torch.topk(lp, n_top, dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
    else:
        tops = [[] for _ in tokens]
    return [TokenLogprob(t, c, top) for t, c, top in zip(tokens, chosen, tops)]
