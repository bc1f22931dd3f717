"""Turning logits into tokens on the logits' device: every sampled row of a step in one tensor pipeline.

`sample(logits, rows)` runs, for all rows at once: logit bias → (the caller's grammar mask) →
repeat / presence / frequency penalties over each row's last-n window (llama.cpp's semantics) →
temperature → top-k → top-p → min-p → the draw. A greedy row (temperature 0) takes the argmax after
bias, mask and penalties. Nothing is read back to the host on the way (no `.item()`, no host
branch on tensor values): what differs between rows is data, so a step launches its sampling right
behind its forward and the host reads the tokens later (the runtime's overlap).

Randomness is counter-based: a row's uniform is a hash of (its request's seed, the index of the
token it draws, a stream id) in integer ops on the host, and the draw is the inverse CDF of the filtered
distribution taken in vocabulary order. A seeded request therefore draws the same tokens whatever
else shares the batch, with no generator state to carry. Filter thresholds and the draw work on
unnormalised weights exp(x - max) (min-p and top-p as ratios to the best and to the running total):
the same row gives the same weights whether the batch took its top-k candidates or sorted the whole
vocabulary.

A request's parameters and what a position's logprobs are: sampling_params.py (no torch).

Logprobs are taken from the raw logits (log-softmax before any transform), as OpenAI and vLLM
report them, unless a request asks for the sampled distribution's (`post_sampling`, llama-server's
post_sampling_probs).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from enum import IntEnum
from typing import Callable, Sequence

import numpy as np
import torch

from ..device import to_device
from .sampling_params import Sampler, SamplingParams, TokenLogprob

PENDING = -1  # a history entry still on the device (sampled by a step the host has not read yet)
_M32 = 0xFFFFFFFF
BIASES_KEPT = 256  # batches of logit biases kept on the device (`_bias_on_device`)
PAIRWISE_MAX = (
    256  # penalty windows up to this long count repeats pairwise; longer ones through a vocabulary-wide count
)


_NEUTRAL = SamplingParams()  # the penalties' "off" values


class Stream(IntEnum):
    """Independent random streams of one request: the token drawn at an index, a draft's draw there,
    and speculative decoding's accept test."""

    SAMPLE = 0
    DRAFT = 1
    ACCEPT = 2


@dataclass
class Rows:
    """The sampled rows of a step as tensors on the logits' device, built once on the host (`build`).
    What the host knows about the rows (which stages apply at all) picks the code path; what differs
    between rows is data."""

    samplers: list[Sampler]
    # The draw's parameters: None when every row is greedy (the argmax needs none of them).
    greedy: torch.Tensor | None  # [B] bool
    temperature: torch.Tensor | None  # [B] (1 on greedy rows: unused there)
    top_k: torch.Tensor | None  # [B] long (2^62 where off)
    top_p: torch.Tensor | None  # [B] (2 where off: never reached by a running total)
    min_p: torch.Tensor | None  # [B]
    counters: list[int]  # the index of the token each row draws (with its seed: its randomness)
    window: torch.Tensor | None  # [B, L] long: last-n histories, left-padded with their first entry; None: no penalties
    valid: torch.Tensor | None  # [B, L] bool: the window's own entries (not padding)
    penalties: torch.Tensor | None  # [3, B]: repeat, presence, frequency (neutral on rows without penalties)
    bias: tuple[torch.Tensor, torch.Tensor] | None  # [B, n] ids and values (0 on padding)
    device: torch.device
    uniforms: dict[Stream, torch.Tensor]  # `uniform`'s results so far, on the device

    @classmethod
    def build(
        cls,
        samplers: list[Sampler],
        histories: Sequence[Sequence[int]],
        device: torch.device,
        ends: Sequence[int] | None = None,
        pending: torch.Tensor | None = None,
    ) -> Rows:
        """Row i samples the token at index `ends[i]` (default: `len(histories[i])`) after
        `histories[i][:ends[i]]`; indexes past the history, or entries equal to PENDING, are
        `pending[i]` (a device tensor: the row's token from a step the host has not read yet)."""
        device = torch.device(device)
        ends = [len(h) for h in histories] if ends is None else list(ends)
        ps = [s.params for s in samplers]
        penalised = [p.penalised for p in ps]
        window = valid = penalties = bias = draw = None
        uniforms: dict[Stream, torch.Tensor] = {}
        sampled, any_penalised = not all(p.greedy for p in ps), any(penalised)
        if sampled or any_penalised:  # a plain greedy step (most of a busy server's) builds none of this
            neutral = [p if pen else _NEUTRAL for p, pen in zip(ps, penalised)]
            repeat = [
                [p.repeat_penalty for p in neutral],
                [p.presence_penalty for p in neutral],
                [p.frequency_penalty for p in neutral],
            ]
        # An all-greedy step takes the argmax: none of the draw's parameters go to the device.
        if sampled:
            # The draw's uniforms (`uniform`) travel with the parameters: one row more, no copy of their own.
            floats = torch.tensor(
                [
                    [p.temperature or 1.0 for p in ps],
                    [p.top_p if p.top_p < 1.0 else 2.0 for p in ps],
                    [p.min_p for p in ps],
                    *repeat,
                    host_uniform(samplers, ends, Stream.SAMPLE).tolist(),
                ],
                dtype=torch.float32,
            )
            longs = torch.tensor([[p.top_k or (1 << 62) for p in ps], [p.greedy for p in ps]], dtype=torch.long)
            floats, longs = to_device(floats, device), to_device(longs, device)
            uniforms[Stream.SAMPLE] = floats[6]
            draw = (longs[1].bool(), floats[0], longs[0], floats[1], floats[2])
        if any_penalised:
            windows = [
                _window(h, e, p.repeat_last_n) if pen else [0] for h, e, p, pen in zip(histories, ends, ps, penalised)
            ]
            width = max(len(w) for w in windows)
            # Padding repeats the row's first entry: it writes that token's penalised logit again, unchanged.
            window = torch.tensor([w[:1] * (width - len(w)) + w for w in windows], dtype=torch.long)
            valid = torch.tensor([[False] * (width - len(w)) + [True] * len(w) for w in windows])
            window, valid = to_device(window, device), to_device(valid, device)
            if pending is not None:
                window = torch.where(window == PENDING, pending.to(device)[:, None], window)
            penalties = floats[3:6] if draw else to_device(torch.tensor(repeat, dtype=torch.float32), device)
        if any(p.logit_bias for p in ps):
            bias = _bias_on_device(tuple(p.logit_bias for p in ps), device)
        return cls(samplers, *(draw or (None,) * 5), ends, window, valid, penalties, bias, device, uniforms)

    @property
    def params(self) -> list[SamplingParams]:
        return [s.params for s in self.samplers]


@functools.lru_cache(maxsize=BIASES_KEPT)
def _bias_on_device(
    biases: tuple[tuple[tuple[int, float], ...], ...], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's logit bias as ([B, n] ids, values; 0 on padding) on the device, read only, kept per
    batch of biases: a request's bias (`ignore_eos` bans the end-of-generation tokens) is the same
    every step, and copying it each step cost the host more than the step's sampling."""
    width = max(len(b) for b in biases)
    pairs = [list(b) + [(0, 0.0)] * (width - len(b)) for b in biases]
    ids = to_device(torch.tensor([[t for t, _ in row] for row in pairs], dtype=torch.long), device)
    return ids, to_device(torch.tensor([[b for _, b in row] for row in pairs], dtype=torch.float32), device)


def _window(history: Sequence[int], end: int, last_n: int) -> list[int]:
    """The last `last_n` (-1: all) entries of `history[:end]`, PENDING for those past its end."""
    start = 0 if last_n == -1 else max(0, end - last_n)
    known = list(history[start : min(end, len(history))])
    return known + [PENDING] * (end - start - len(known))


# ---- the pipeline ------------------------------------------------------------------------------


def _finite(x: torch.Tensor) -> torch.Tensor:
    """Extreme parameters (a temperature or penalty near 0) overflow float32: keep the order, drop NaN."""
    return torch.nan_to_num(x, nan=float("-inf"), posinf=torch.finfo(x.dtype).max, neginf=float("-inf"))


def _prepare(logits: torch.Tensor, rows: Rows, mask: Callable[[torch.Tensor], torch.Tensor] | None) -> torch.Tensor:
    """Logit bias, the grammar mask, the penalties: what greedy rows take the argmax of."""
    x = logits.float()
    if rows.bias is not None:
        x = x.scatter_add(1, *rows.bias)
    if mask is not None:
        x = mask(x)
    if rows.window is not None:  # only the window's tokens change: [B, L] work, not [B, V]
        w, valid = rows.window, rows.valid
        if w.shape[1] <= PAIRWISE_MAX:
            counts = ((w[:, :, None] == w[:, None, :]) & valid[:, None, :]).sum(-1)
        else:
            counts = torch.zeros_like(x).scatter_add_(1, w, valid.to(x.dtype)).gather(1, w)
        rep, presence, frequency = (t[:, None] for t in rows.penalties)
        xs = x.gather(1, w)
        pen = torch.where(xs > 0, xs / rep, xs * rep) - counts.to(x.dtype) * frequency - presence
        x = x.scatter(1, w, _finite(pen))  # a token's every entry writes the same value
    return x


def _weights(x: torch.Tensor, rows: Rows) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Temperature, top-k, top-p, min-p on prepared logits `x[B, V]`: (unnormalised weights of the
    candidates, 0 where filtered out; their token ids, or None when the candidates are the whole
    vocabulary in order). The candidates are each row's top k when every stochastic row has a top-k,
    the sorted vocabulary when some row needs an order (top-k or top-p), else the vocabulary as is."""
    V = x.shape[-1]
    ps = [p for p in rows.params if not p.greedy]
    ids = None
    ranked = any(0 < p.top_k < V for p in ps)
    if ps and all(0 < p.top_k < V for p in ps):
        # Temperature keeps the order: only the k candidates are scaled. Elsewhere in place on fresh
        # tensors: every [B, V] temporary costs (page faults for a 262k vocabulary on a CPU).
        x, ids = torch.topk(x, max(p.top_k for p in ps), dim=-1)  # sorted, best first
    x = torch.nan_to_num_(
        x / rows.temperature[:, None], nan=float("-inf"), posinf=torch.finfo(x.dtype).max, neginf=float("-inf")
    )
    if ids is None and (ranked or any(p.top_p < 1.0 for p in ps)):
        x, ids = torch.sort(x, dim=-1, descending=True)
    if ranked:
        rank = torch.arange(x.shape[-1], device=x.device)
        x = x.masked_fill(rank >= rows.top_k[:, None], float("-inf"))
    w = x.sub_(x.amax(-1, keepdim=True)).exp_()  # x is this function's own tensor by now
    w = torch.nan_to_num_(w, nan=0.0)  # an all -inf row (everything banned): no weight anywhere
    if ids is not None and any(p.top_p < 1.0 for p in ps):
        cum = torch.cumsum(w, -1)
        drop = cum - w >= rows.top_p[:, None] * cum[:, -1:]  # the better tokens already hold top_p
        drop[:, 0] = False  # the best token always stays (a top_p below float32's range rounds to 0)
        w.masked_fill_(drop, 0.0)
    if any(p.min_p > 0.0 for p in ps):
        w.masked_fill_(w < rows.min_p[:, None], 0.0)  # the best token's weight is 1
    return w, ids


def _in_vocab_order(w: torch.Tensor, ids: torch.Tensor | None, V: int) -> torch.Tensor:
    """Candidate weights scattered back to `[B, V]` (a no-op when they already are)."""
    return w if ids is None else torch.zeros(w.shape[0], V, dtype=w.dtype, device=w.device).scatter_(1, ids, w)


def _mix(x):
    """A 32-bit integer hash of a tensor or an int (Wellons' lowbias32 family; multipliers < 2^31
    keep products in int64)."""
    x = ((x ^ (x >> 16)) * 0x21F0AAAD) & _M32
    x = ((x ^ (x >> 15)) * 0x735A2D97) & _M32
    return x ^ (x >> 15)


def host_uniform(samplers: list[Sampler], counters: list[int], stream: Stream) -> np.ndarray:
    """`uniform`'s values, computed on the host: where they are read on the host, no round trip."""
    seeds = [s.seed for s in samplers]
    keys = _mix(
        _mix(np.array([x & _M32 for x in seeds], dtype=np.int64)) ^ np.array([x >> 32 for x in seeds], dtype=np.int64)
    )
    h = _mix(keys ^ (np.array(counters, dtype=np.int64) & _M32))
    h = _mix(h ^ int(stream) * 0x9E3779B9 & _M32)
    return ((h >> 8).astype(np.float32) + np.float32(0.5)) / np.float32(2**24)


def uniform(rows: Rows, stream: Stream) -> torch.Tensor:
    """`[B]` float32 uniforms in (0, 1) on the rows' device: a hash of (the row's seed, its counter,
    `stream`). Seeds and counters are the host's integers, so it is hashed there: on a GPU a dozen
    element-wise kernels a call were a tenth of a sampled step's host time."""
    if stream not in rows.uniforms:
        rows.uniforms[stream] = to_device(
            torch.from_numpy(host_uniform(rows.samplers, rows.counters, stream)), rows.device
        )
    return rows.uniforms[stream]


def draw(w: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: per row of nonnegative weights `w[B, N]` (any scale), the index whose
    cumulative weight first exceeds `u` of the total; never an index of weight 0."""
    cdf = torch.cumsum(w, -1)
    idx = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp_(max=w.shape[-1] - 1)
    return torch.where(w.gather(1, idx) > 0, idx, w.argmax(-1, keepdim=True)).squeeze(1)


def distribution(
    logits: torch.Tensor, rows: Rows, mask: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> torch.Tensor:
    """`[B, V]`: the probabilities each row draws from (a point mass on the argmax for greedy rows)."""
    x = _prepare(logits, rows, mask)
    greedy = torch.zeros_like(x).scatter_(1, x.argmax(-1, keepdim=True), 1.0)
    if all(p.greedy for p in rows.params):
        return greedy
    w = _in_vocab_order(*_weights(x, rows), x.shape[-1])
    return torch.where(rows.greedy[:, None], greedy, w / w.sum(-1, keepdim=True))


@dataclass
class Picks:
    """A step's sampled tokens on the device and, for rows that asked, their logprobs (`n_top`: each
    row's count, None = none). `copy()` starts their way to the host; `read()` waits for them."""

    tokens: torch.Tensor  # [B] long
    logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # chosen [B], top ids [B, n], top logprobs [B, n]
    n_top: list[int | None]
    _host: tuple | None = None
    _ready: object = None

    def copy(self) -> Picks:
        """Start copying to page-locked host memory behind the work already queued (CUDA); the CPU's are there."""
        parts = (self.tokens,) + (self.logprobs or ())
        if self.tokens.device.type != "cuda":
            self._host = parts
            return self
        self._host = tuple(
            torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True) for t in parts
        )
        self._ready = torch.cuda.Event()
        self._ready.record(torch.cuda.current_stream(self.tokens.device))
        return self

    def read(self) -> tuple[list[int], list[TokenLogprob | None]]:
        if self._host is None:
            self.copy()
        if self._ready is not None:
            self._ready.synchronize()
        tokens = self._host[0].tolist()
        if self.logprobs is None:
            return tokens, [None] * len(tokens)
        chosen, top_ids, top_lp = (t.tolist() for t in self._host[1:])
        out = []
        for i, n in enumerate(self.n_top):
            top = [(t, v) for t, v in zip(top_ids[i][:n], top_lp[i][:n]) if v > float("-inf")] if n else []
            out.append(None if n is None else TokenLogprob(tokens[i], chosen[i], top))
        return tokens, out


def _logprob_tensors(logits: torch.Tensor, rows: Rows, tokens: torch.Tensor, mask=None):
    """(chosen [B], top ids [B, n], top logprobs [B, n]) of `tokens`, raw or post-sampling per row; None when no row asks."""
    ps = rows.params
    if all(p.logprobs is None for p in ps):
        return None
    n = min(max(p.logprobs or 0 for p in ps), logits.shape[-1])
    lp = torch.log_softmax(logits.float(), -1)
    if any(p.post_sampling for p in ps):
        post = to_device(torch.tensor([p.post_sampling for p in ps]), logits.device)[:, None]
        lp = torch.where(post, torch.log(distribution(logits, rows, mask)), lp)
    top_lp, top_ids = torch.topk(lp, n, dim=-1)
    return lp.gather(1, tokens[:, None]).squeeze(1), top_ids, top_lp


def sample(
    logits: torch.Tensor,
    rows: Rows,
    mask: Callable[[torch.Tensor], torch.Tensor] | None = None,
    stream: Stream = Stream.SAMPLE,
) -> Picks:
    """One token per row of `logits[B, V]` (float32, on any device), its logprobs when asked; `mask`
    (a grammar's) applies after the logit bias. Nothing waits for the device."""
    x = _prepare(logits, rows, mask)
    greedy = [p.greedy for p in rows.params]
    if all(greedy):
        tokens = x.argmax(-1)
    else:
        tokens = _draw_tokens(x, rows, stream)
        if any(greedy):
            tokens = torch.where(rows.greedy, x.argmax(-1), tokens)
    return Picks(tokens, _logprob_tensors(logits, rows, tokens, mask), [p.logprobs for p in rows.params])


def _draw_tokens(x: torch.Tensor, rows: Rows, stream: Stream) -> torch.Tensor:
    """`[B]` tokens drawn from prepared logits: the draw runs in vocabulary order, so a row gets the
    same token whichever candidate set its batch used."""
    V = x.shape[-1]
    w, ids = _weights(x, rows)
    if ids is not None and ids.shape[-1] < V:  # top-k candidates: in token order
        ids, order = ids.sort(-1)
        w = w.gather(1, order)
    elif ids is not None:  # the sorted vocabulary: back in place
        w, ids = _in_vocab_order(w, ids, V), None
    picked = draw(w, uniform(rows, stream))
    return picked if ids is None else ids.gather(1, picked[:, None]).squeeze(1)


def logprobs(logits: torch.Tensor, rows: Rows, tokens: list[int]) -> list[TokenLogprob | None]:
    """Row i's logprob of `tokens[i]` and its top alternatives (raw or post-sampling as each row's
    request asks; None where it asks for none), read back now."""
    ids = torch.tensor(tokens, dtype=torch.long, device=logits.device)
    return Picks(ids, _logprob_tensors(logits, rows, ids), [p.logprobs for p in rows.params]).read()[1]


def token_logprobs(logits: torch.Tensor, tokens: list[int], n_top: int) -> list[TokenLogprob]:
    """Logprob of `tokens[i]` under raw `logits[i]` and the `n_top` most likely alternatives (prompt scoring)."""
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
