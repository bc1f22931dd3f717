"""Sampling: greedy, seeded draws, the filters' support, penalties, logprobs, parameter checks."""

from __future__ import annotations

import pytest
import torch

from hydra_console.engine.sampling import (
    InvalidParam,
    Sampler,
    SamplingParams,
    sample_batch,
    token_logprobs,
)

pytestmark = pytest.mark.unit

V = 50


@pytest.fixture
def logits():
    return torch.randn(V, generator=torch.Generator().manual_seed(1)) * 2


def draws(params: SamplingParams, row: torch.Tensor, n: int = 300, history=()) -> list[int]:
    s = Sampler(params)
    return [s.sample(row, list(history)) for _ in range(n)]


def test_greedy_is_argmax_and_batched_rows_are_independent(logits):
    rows = torch.stack([logits, -logits, logits.flip(0)])
    samplers = [Sampler(SamplingParams(temperature=0.0)) for _ in range(3)]
    assert sample_batch(rows, samplers, [[], [], []]) == [int(r.argmax()) for r in rows]
    # top_k = 1 leaves only the argmax even at a high temperature
    assert set(draws(SamplingParams(temperature=5.0, top_k=1, seed=3), logits, 50)) == {int(logits.argmax())}


def test_same_seed_same_tokens_other_seed_other_tokens(logits):
    flat = logits / 10  # a broad distribution: two seeds agreeing on 40 draws would be a bug
    a = draws(SamplingParams(temperature=1.0, seed=42), flat, 40)
    b = draws(SamplingParams(temperature=1.0, seed=42), flat, 40)
    c = draws(SamplingParams(temperature=1.0, seed=43), flat, 40)
    assert a == b
    assert a != c
    # a batch neighbour does not shift a request's random stream
    s1, s2 = Sampler(SamplingParams(seed=42)), Sampler(SamplingParams(seed=7))
    both = [sample_batch(torch.stack([flat, flat]), [s1, s2], [[], []])[0] for _ in range(40)]
    assert both == a


def test_filters_restrict_the_support(logits):
    order = torch.argsort(logits, descending=True).tolist()
    assert set(draws(SamplingParams(temperature=3.0, top_k=5, seed=1), logits)) <= set(order[:5])

    probs = torch.softmax(logits, -1)
    cum = torch.cumsum(probs[order], 0)
    n_top_p = int((cum < 0.6).sum()) + 1  # smallest prefix holding 60% of the mass
    got = set(draws(SamplingParams(temperature=1.0, top_p=0.6, seed=1), logits, 600))
    assert got <= set(order[:n_top_p]) and len(got) > 1

    keep = {i for i in range(V) if probs[i] >= 0.2 * probs.max()}
    got = set(draws(SamplingParams(temperature=1.0, min_p=0.2, seed=2), logits, 600))
    assert got <= keep and len(got) > 1


def test_probs_match_the_sampler_support(logits):
    s = Sampler(SamplingParams(temperature=0.7, top_k=10, top_p=0.9, seed=0))
    p = s.probs(logits, [])
    assert p.shape == (V,)
    assert float(p.sum()) == pytest.approx(1.0, abs=1e-5)
    support = set(torch.nonzero(p).flatten().tolist())
    assert set(draws(s.params, logits, 300)) <= support
    greedy = Sampler(SamplingParams(temperature=0.0)).probs(logits, [])
    assert int(greedy.argmax()) == int(logits.argmax()) and float(greedy.sum()) == 1.0


def test_penalties_push_recent_tokens_down(logits):
    best = int(logits.argmax())
    assert draws(SamplingParams(temperature=0.0), logits, 1, history=[best]) == [best]
    # a strong repeat penalty on the argmax makes greedy pick something else
    pick = draws(SamplingParams(temperature=0.0, repeat_penalty=50.0), logits, 1, history=[best])[0]
    assert pick != best
    # tokens outside the last-n window are not penalised
    assert draws(SamplingParams(temperature=0.0, repeat_penalty=50.0, repeat_last_n=1), logits, 1,
                 history=[best, (best + 1) % V])[0] == best  # fmt: skip
    s = Sampler(SamplingParams(frequency_penalty=1.0, presence_penalty=0.5))
    out = s.penalise(logits, [3, 3, 4])
    assert float(out[3]) == pytest.approx(float(logits[3]) - 2.5)
    assert float(out[4]) == pytest.approx(float(logits[4]) - 1.5)
    assert torch.equal(out[5:], logits[5:])


def test_logprobs_are_log_softmax_of_raw_logits(logits):
    rows = torch.stack([logits, logits * 0.5])
    out = token_logprobs(rows, [7, 9], 3)
    ref = torch.log_softmax(rows, -1)
    assert out[0].token == 7 and out[0].logprob == pytest.approx(float(ref[0, 7]))
    assert out[1].logprob == pytest.approx(float(ref[1, 9]))
    top_ids = [i for i, _ in out[0].top]
    assert top_ids == torch.argsort(ref[0], descending=True)[:3].tolist()
    assert [v for _, v in out[0].top] == pytest.approx(sorted(ref[0].tolist(), reverse=True)[:3])
    assert token_logprobs(rows, [1, 2], 0)[0].top == []


@pytest.mark.parametrize(
    "bad,param",
    [({"temperature": -1}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_k": -2}, "top_k"),
     ({"min_p": 1.5}, "min_p"), ({"repeat_penalty": 0}, "repeat_penalty"), ({"logprobs": 21}, "logprobs"),
     ({"presence_penalty": 3}, "presence_penalty")],  # fmt: skip
)
def test_bad_parameters_name_themselves(bad, param):
    with pytest.raises(InvalidParam) as e:
        SamplingParams(**bad)
    assert e.value.param == param


@pytest.mark.parametrize(
    "extreme",
    [{"top_p": 5e-324}, {"temperature": 5e-324}, {"repeat_penalty": 5e-324}, {"repeat_penalty": 100.0},
     {"temperature": 100.0, "min_p": 1.0}],  # fmt: skip
)
def test_extreme_parameters_still_sample_a_valid_token(logits, extreme):
    s = Sampler(SamplingParams(seed=0, **extreme))
    t = s.sample(logits, [int(logits.argmax()), 3])
    assert 0 <= t < V
    p = s.probs(logits, [int(logits.argmax()), 3])
    assert torch.isfinite(p).all() and float(p.sum()) == pytest.approx(1.0, abs=1e-5)
