"""The batched device sampler against direct per-row references: greedy, each filter's distribution,
the draw's mapping from noise, seeds independent of the batch, penalties, logprobs, parameter checks."""

from __future__ import annotations

import math

import pytest
import torch

from hydra_console.engine.serving.sampling import (
    PAIRWISE_MAX,
    PENDING,
    Rows,
    Stream,
    distribution,
    sample,
    token_logprobs,
    uniform,
)
from hydra_console.engine.serving.sampling_params import InvalidParam, Sampler, SamplingParams

pytestmark = pytest.mark.unit

V = 50
CPU = torch.device("cpu")


@pytest.fixture
def logits():
    return torch.randn(V, generator=torch.Generator().manual_seed(1)) * 2


def rows_of(params: list[SamplingParams], histories=None, **kw) -> Rows:
    histories = histories if histories is not None else [[] for _ in params]
    return Rows.build([Sampler(p) for p in params], histories, CPU, **kw)


# ---- direct references: one row at a time, straight from the definitions ----------------------


def ref_penalise(row: torch.Tensor, history: list[int], p: SamplingParams) -> torch.Tensor:
    """llama.cpp's penalties over the last n tokens, as the engine applied them before the batched sampler."""
    recent = history if p.repeat_last_n == -1 else history[-p.repeat_last_n :] if p.repeat_last_n else []
    if not recent or not p.penalised:
        return row
    ids, counts = torch.tensor(recent).unique(return_counts=True)
    x = row[ids]
    x = torch.where(x > 0, x / p.repeat_penalty, x * p.repeat_penalty)
    x = x - counts.to(x.dtype) * p.frequency_penalty - p.presence_penalty
    out = row.clone()
    out[ids] = x
    return out


def ref_probs(row: torch.Tensor, p: SamplingParams, history=()) -> torch.Tensor:
    """temperature → top-k (the k best) → top-p (the shortest best-first prefix holding top_p) → min-p."""
    x = ref_penalise(row, list(history), p) / p.temperature
    order = torch.argsort(x, descending=True)
    keep = torch.ones(V, dtype=torch.bool)
    if p.top_k:
        keep[order[p.top_k :]] = False
    probs = torch.softmax(x.masked_fill(~keep, float("-inf")), -1)
    if p.top_p < 1.0:
        before = torch.cumsum(probs[order], 0) - probs[order]
        keep[order[1:][before[1:] >= p.top_p]] = False
        probs = torch.softmax(x.masked_fill(~keep, float("-inf")), -1)
    if p.min_p > 0:
        keep &= probs >= p.min_p * probs.max()
    return torch.softmax(x.masked_fill(~keep, float("-inf")), -1)


FILTERS = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=5),
    SamplingParams(temperature=1.0, top_p=0.6),
    SamplingParams(temperature=1.0, min_p=0.2),
    SamplingParams(temperature=0.8, top_k=12, top_p=0.9, min_p=0.05),
    SamplingParams(temperature=2.0, top_p=0.3, min_p=0.5),
]


@pytest.mark.parametrize("params", FILTERS, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}")
def test_each_filter_gives_the_reference_distribution(logits, params):
    want = ref_probs(logits, params)
    # alone, and beside rows that make the batch take the other candidate paths (top-k only, sorted, whole vocabulary)
    for neighbour in (None, SamplingParams(top_k=3), SamplingParams(top_p=0.5), SamplingParams()):
        batch = [params] + ([neighbour] if neighbour else [])
        got = distribution(torch.stack([logits] * len(batch)), rows_of(batch))[0]
        assert torch.equal(got > 0, want > 0), "the support must be exactly the reference's"
        assert torch.allclose(got, want, atol=1e-6)


def test_greedy_rows_are_the_argmax_bit_for_bit(logits):
    rows = torch.stack([logits, -logits, logits.flip(0), logits * 3])
    params = [SamplingParams(temperature=0.0)] * 3 + [SamplingParams(temperature=1.0, seed=3)]
    got = sample(rows, rows_of(params)).read()[0]
    assert got[:3] == rows[:3].argmax(-1).tolist()
    # top_k = 1 leaves only the argmax even at a high temperature
    hot = rows_of([SamplingParams(temperature=5.0, top_k=1, seed=s) for s in range(20)])
    assert set(sample(logits.expand(20, V), hot).read()[0]) == {int(logits.argmax())}


def test_the_draw_is_the_inverse_cdf_of_the_distribution_at_the_rows_uniform(logits):
    """Token = the first in vocabulary order whose cumulative probability exceeds the row's uniform."""
    params = [
        SamplingParams(temperature=1.0, seed=s, **f)
        for s in range(40)
        for f in ({}, {"top_k": 7}, {"top_p": 0.8}, {"min_p": 0.1})
    ]
    rows = rows_of(params, ends=[s % 9 for s in range(len(params))])
    x = logits.expand(len(params), V)
    got = sample(x, rows).read()[0]
    u = uniform(rows, Stream.SAMPLE)
    for i, p in enumerate(params):
        cdf = torch.cumsum(ref_probs(logits, p).double(), 0)
        assert got[i] == int(torch.searchsorted(cdf, float(u[i]) * float(cdf[-1]), right=True))


def test_uniforms_are_spread_and_streams_differ():
    rows = rows_of([SamplingParams(seed=7)] * 4000, ends=list(range(4000)))
    u = uniform(rows, Stream.SAMPLE)
    assert bool(((u > 0) & (u < 1)).all())
    hist = torch.histc(u, bins=10, min=0, max=1)
    assert int(hist.min()) > 330 and int(hist.max()) < 470  # 400 per tenth: the hash spreads (fixed, deterministic)
    assert not torch.equal(u, uniform(rows, Stream.DRAFT))
    assert not torch.equal(u, uniform(rows_of([SamplingParams(seed=8)] * 4000, ends=list(range(4000))), Stream.SAMPLE))


def test_seeded_draws_repeat_and_ignore_the_rest_of_the_batch(logits):
    flat = logits / 10  # a broad distribution: two seeds agreeing on 40 draws would be a bug
    p = SamplingParams(temperature=1.0, seed=42)

    def draws(params, neighbours=()):
        """The first row's tokens at indexes 0..39, its batch neighbours changing along."""
        out = []
        for i in range(40):
            batch = [params, *neighbours]
            rows = rows_of(batch, ends=[i] * len(batch))
            x = torch.stack([flat] + [torch.randn(V, generator=torch.Generator().manual_seed(i)) for _ in neighbours])
            out.append(sample(x, rows).read()[0][0])
        return out

    alone = draws(p)
    assert alone == draws(p)
    assert alone != draws(SamplingParams(temperature=1.0, seed=43))
    for neighbours in (
        [SamplingParams(top_k=3, seed=1)],
        [SamplingParams(top_p=0.5, seed=2), SamplingParams(temperature=0.0)],
    ):
        assert draws(p, neighbours) == alone
    # the same for a top-k row, whose batch takes the top-k path alone and the sorted path beside a top-p row
    k = SamplingParams(temperature=1.0, top_k=9, seed=5)
    assert draws(k) == draws(k, [SamplingParams(top_p=0.7, seed=2)])
    # a 64-bit seed above 2^63 is its own stream too
    assert draws(SamplingParams(seed=2**64 - 1)) != draws(SamplingParams(seed=2**63 - 1))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, repeat_penalty=1.7),
        SamplingParams(temperature=0.0, repeat_penalty=0.6, repeat_last_n=2),
        SamplingParams(temperature=0.0, frequency_penalty=1.0, presence_penalty=0.5, repeat_last_n=-1),
        SamplingParams(temperature=1.0, repeat_penalty=1.3, frequency_penalty=-0.5),
        SamplingParams(temperature=0.0, repeat_penalty=50.0, repeat_last_n=0),
    ],
)
def test_penalties_equal_the_reference(logits, params):
    history = [int(logits.argmax()), 3, 3, 4, int(logits.argmin()), 3, 9]
    want = ref_probs(
        logits, params if not params.greedy else SamplingParams(**{**params.__dict__, "temperature": 1.0}), history
    )
    rows = rows_of([params], [history])
    if params.greedy:
        assert sample(logits[None], rows).read()[0] == [int(ref_penalise(logits, history, params).argmax())]
    else:
        assert torch.allclose(distribution(logits[None], rows)[0], want, atol=1e-6)
    # a window that ends on a token still on the device reads it there
    pending = rows_of([params], [history[:-1]], ends=[len(history)], pending=torch.tensor([history[-1]]))
    assert torch.equal(distribution(logits[None], pending), distribution(logits[None], rows))


def test_long_penalty_windows_count_like_short_ones(logits):
    """Past PAIRWISE_MAX entries the repeats are counted over the vocabulary: the same penalties."""
    history = torch.randint(0, V, (PAIRWISE_MAX + 40,), generator=torch.Generator().manual_seed(3)).tolist()
    params = [
        SamplingParams(
            temperature=1.0, repeat_penalty=1.4, frequency_penalty=0.2, presence_penalty=0.1, repeat_last_n=n
        )
        for n in (-1, PAIRWISE_MAX + 10, 5)
    ]
    got = distribution(logits.expand(3, V), rows_of(params, [history] * 3))
    for row, p in zip(got, params):
        assert torch.allclose(row, ref_probs(logits, p, history), atol=1e-6)


def test_logprobs_raw_and_post_sampling(logits):
    rows = torch.stack([logits, logits * 0.5])
    params = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=1.0, top_k=2, seed=1, logprobs=4, post_sampling=True),
    ]
    tokens, lps = sample(rows, rows_of(params)).read()
    ref = torch.log_softmax(rows[0], -1)
    assert lps[0].token == tokens[0] and lps[0].logprob == pytest.approx(float(ref[tokens[0]]))
    assert [i for i, _ in lps[0].top] == torch.argsort(ref, descending=True)[:3].tolist()
    post = ref_probs(rows[1], params[1])
    assert lps[1].logprob == pytest.approx(math.log(float(post[tokens[1]])), abs=1e-5)
    assert len(lps[1].top) == 2 and {i for i, _ in lps[1].top} == set(torch.topk(rows[1], 2).indices.tolist())
    out = token_logprobs(rows, [7, 9], 3)
    assert out[0].logprob == pytest.approx(float(ref[7])) and token_logprobs(rows, [1, 2], 0)[0].top == []
    assert sample(rows, rows_of([SamplingParams(temperature=0.0)] * 2)).read()[1] == [None, None]


def test_pending_entries_come_from_the_device(logits):
    rows = rows_of(
        [SamplingParams(temperature=0.0, repeat_penalty=80.0)],
        [[]],
        ends=[1],
        pending=torch.tensor([int(logits.argmax())]),
    )
    assert sample(logits[None], rows).read()[0] != [int(logits.argmax())]
    assert PENDING < 0


@pytest.mark.parametrize(
    "bad,param",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"repeat_penalty": 0}, "repeat_penalty"),
        ({"logprobs": 21}, "logprobs"),
        ({"presence_penalty": 3}, "presence_penalty"),
    ],
)
def test_bad_parameters_name_themselves(bad, param):
    with pytest.raises(InvalidParam) as e:
        SamplingParams(**bad)
    assert e.value.param == param


@pytest.mark.parametrize(
    "extreme",
    [
        {"top_p": 5e-324},
        {"temperature": 5e-324},
        {"repeat_penalty": 5e-324},
        {"repeat_penalty": 100.0},
        {"temperature": 100.0, "min_p": 1.0},
        {"logit_bias": tuple((i, float("-inf")) for i in range(V))},
    ],
)
def test_extreme_parameters_still_sample_a_valid_token(logits, extreme):
    rows = rows_of([SamplingParams(seed=0, **extreme)], [[int(logits.argmax()), 3]])
    assert 0 <= sample(logits[None], rows).read()[0][0] < V
    if "logit_bias" not in extreme:
        p = distribution(logits[None], rows)[0]
        assert torch.isfinite(p).all() and float(p.sum()) == pytest.approx(1.0, abs=1e-5)
