"""Speculative decoding without a model: drafters, the accept step, configs, statistics."""

from __future__ import annotations

import itertools

import pytest
import torch

from hydra_console.engine.errors import UserError
from hydra_console.engine.http.bodies import spec_override
from hydra_console.engine.spec import (
    NgramDrafter,
    SpecConfig,
    SpecStats,
    accept_greedy,
    accept_sampled,
    check_mtp,
)

pytestmark = pytest.mark.unit

# ---------------------------------------------------------------- n-gram drafter


def test_ngram_proposes_what_followed_the_latest_match():
    d = NgramDrafter(n_max=3)
    hist = [1, 2, 3, 4, 5, 6, 9, 1, 2, 3]
    assert d.draft(0, hist, 3) == [4, 5, 6]
    assert d.draft(0, hist, 1) == [4]
    # Latest occurrence wins: [7, 8] follows the second "1 2 3".
    assert d.draft(0, [1, 2, 3, 4, 1, 2, 3, 7, 8, 0, 1, 2, 3], 2) == [7, 8]


def test_ngram_falls_back_to_shorter_grams_and_stops_at_history_end():
    d = NgramDrafter(n_max=3)
    # No earlier "8 9 5" or "9 5", but "5" occurred before, followed by 6.
    assert d.draft(0, [5, 6, 7, 8, 9, 5], 4) == [6, 7, 8, 9]
    # The match's follower runs up to the end of the history, not beyond.
    assert d.draft(0, [3, 3], 5) == [3]
    assert d.draft(0, [1, 2, 3, 4], 3) == []
    assert d.draft(0, [7], 3) == []
    assert d.draft(0, [1, 2, 1], 0) == []


def test_ngram_minimum_gram_size():
    assert NgramDrafter(n_max=3, n_min=2).draft(0, [5, 6, 7, 8, 9, 5], 4) == []
    with pytest.raises(ValueError):
        NgramDrafter(n_max=1, n_min=2)


# ---------------------------------------------------------------- config


def test_spec_config_validation():
    c = SpecConfig(type="ngram", n_max=5, n_min=1, p_min=0.5)
    assert (c.type, c.n_max, c.n_min, c.p_min, c.active) == ("ngram", 5, 1, 0.5, True)
    assert not SpecConfig().active
    for bad in ({"type": "medusa"}, {"n_max": -1}, {"n_max": 1000}, {"n_max": 2, "n_min": 3}, {"p_min": 1.5}):
        with pytest.raises(UserError):
            SpecConfig(**bad)


def test_spec_config_request_overrides():
    base = SpecConfig(type="ngram", n_max=3, n_min=1)
    assert spec_override(base, {}) is base
    assert spec_override(base, {"speculative": {"n_max": 6}}).n_max == 6
    assert spec_override(base, {"speculative": {"type": "off"}}).active is False
    assert spec_override(base, {"speculative": {"n_max": 0}}).n_min == 0
    flat = spec_override(base, {"speculative.n_max": 8, "speculative.n_min": 2, "speculative.p_min": 0.3})
    assert (flat.n_max, flat.n_min, flat.p_min) == (8, 2, 0.3)
    assert spec_override(SpecConfig(), {"speculative": True}).type == "ngram"
    for bad in (
        {"speculative": "fast"},
        {"speculative": {"depth": 3}},
        {"speculative": {"n_max": "3"}},
        {"speculative": {"n_max": 2.5}},
        {"speculative.p_min": 2},
        {"speculative": {"type": "eagle"}},
    ):
        with pytest.raises(UserError):
            spec_override(base, bad)


class _FakeGGUF:
    def __init__(self, arch, metadata=None, tensors=()):
        self.architecture = arch
        self.metadata = dict(metadata or {})
        self.tensors = {t: None for t in tensors}


def test_mtp_is_a_clear_error_naming_the_archs():
    with pytest.raises(UserError, match=r"gemma3\).*no multi-token-prediction head.*glm4moe"):
        check_mtp(_FakeGGUF("gemma3", tensors=["blk.0.attn_q.weight"]))
    with pytest.raises(UserError, match=r"carries a multi-token-prediction head \(1 layer"):
        check_mtp(_FakeGGUF("glm4moe", {"glm4moe.nextn_predict_layers": 1}, ["blk.46.nextn.eh_proj.weight"]))


# ---------------------------------------------------------------- greedy acceptance


def test_accept_greedy():
    assert accept_greedy([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]  # all accepted + bonus
    assert accept_greedy([5, 9, 7, 8], [5, 6, 7]) == [5, 9]  # stops at first mismatch
    assert accept_greedy([4, 6, 7, 8], [5, 6, 7]) == [4]  # nothing accepted: still one token
    assert accept_greedy([3], []) == [3]
    with pytest.raises(ValueError):
        accept_greedy([1, 2], [1, 2])


def test_greedy_speculation_reproduces_greedy_decoding_on_a_toy_model():
    """A deterministic toy 'model' (next token = f(last two tokens)); decoding with any drafter
    and the accept step yields exactly the greedy sequence, only in fewer verify steps."""

    def target(prefix):
        return (prefix[-1] * 7 + prefix[-2] * 3) % 11 if len(prefix) > 1 else 1

    prompt = [1, 4, 2, 8]
    want = list(prompt)
    for _ in range(60):
        want.append(target(want))
    drafter = NgramDrafter(3)
    got, steps = list(prompt), 0
    while len(got) < len(want):
        draft = drafter.draft(0, got, 4)
        picks = [target(got + draft[:i]) for i in range(len(draft) + 1)]
        got += accept_greedy(picks, draft)
        steps += 1
    assert got[: len(want)] == want
    assert steps < 60  # the sequence cycles, so lookup drafts get accepted


# ---------------------------------------------------------------- rejection sampling


V = 4


def _dist(seed: int, prefix: tuple, sharp: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(hash((seed,) + prefix) & 0x7FFFFFFF)
    return torch.softmax(torch.randn(V, generator=g) * sharp, dim=0)


def _target(prefix):
    return _dist(1, prefix, 1.5)


def _drafter_q(prefix):
    return _dist(2, prefix, 2.5)  # a different, sharper distribution than the target


def _speculative_pairs(n: int, k: int, mode: str, seed: int = 0) -> torch.Tensor:
    """Counts of the first two emitted tokens over n runs of one speculative step (+ one more
    step when the first emitted only one token)."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V, V)
    for _ in range(n):
        out: list[int] = []
        while len(out) < 2:
            draft, qs = [], []
            for _ in range(k):
                q = _drafter_q(tuple(out + draft))
                if mode == "point":
                    draft.append((len(out) + len(draft)) % V)  # deterministic guesses
                else:
                    draft.append(int(torch.multinomial(q, 1, generator=g)))
                    qs.append(q)
            p = torch.stack([_target(tuple(out + draft[:i])) for i in range(k + 1)])
            if mode == "point":  # the verifier's sample-and-match: the target's draw per row
                out += accept_greedy([int(torch.multinomial(row, 1, generator=g)) for row in p], draft)
                continue
            q = torch.stack(qs)
            if mode == "broken":  # the drafter reports a q other than the one it sampled from
                q = torch.full((k, V), 1.0 / V)
            out += accept_sampled(p, draft, q, torch.rand(k + 1, 2, generator=g))
        counts[out[0], out[1]] += 1
    return counts


def _max_z(counts: torch.Tensor) -> float:
    n = counts.sum()
    exact = torch.tensor([[float(_target(())[a] * _target((a,))[b]) for b in range(V)] for a in range(V)])
    sd = (exact * (1 - exact) / n).sqrt()
    return float(((counts / n - exact).abs() / sd).max())


@pytest.mark.parametrize("mode", ["sampled", "point"])
def test_rejection_sampling_preserves_the_target_distribution(mode):
    # 16 cells, 4000 runs, fixed seed: every cell within 4.5 standard errors of the exact
    # two-token probability p(a) p(b|a).
    assert _max_z(_speculative_pairs(4000, 3, mode)) < 4.5


def test_the_distribution_check_catches_a_biased_sampler():
    assert _max_z(_speculative_pairs(4000, 3, "broken")) > 4.5


def test_accept_sampled_edge_cases():
    u = torch.rand(2, 2, generator=torch.Generator().manual_seed(0))
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    q = torch.tensor([[0.0, 1.0, 0.0]])
    assert accept_sampled(p, [1], q, u) == [1, 2]  # p == q: residual empty, accepted anyway
    assert accept_sampled(p, [0], torch.tensor([[1.0, 0.0, 0.0]]), u) == [1]  # p(x)=0: rejected, drawn from p - q
    with pytest.raises(ValueError):
        accept_sampled(p, [1, 1], q.repeat(2, 1), u)


# ---------------------------------------------------------------- statistics


def test_spec_stats_snapshot():
    s = SpecStats()
    assert s.snapshot().acceptance is None
    for drafted, accepted in itertools.chain([(3, 3)] * 3, [(3, 1), (2, 0), (0, 0)]):
        s.record(drafted, accepted)
    snap = s.snapshot(SpecConfig(type="ngram", n_max=3))
    assert (snap.drafts, snap.draft_tokens, snap.accepted) == (5, 14, 10)
    assert snap.acceptance == pytest.approx(10 / 14)
    assert snap.mean_accepted_len == pytest.approx(1 + 10 / 5)
    assert snap.recent_acceptance == pytest.approx(10 / 14)
    assert snap.accepted_per_pos == [4, 3, 3]
    assert (snap.type, snap.draft_max) == ("ngram", 3)
