"""The split advisor's arithmetic (app/split_advisor.py) on synthetic probe readings."""

from __future__ import annotations

import itertools
import math

import pytest

from hydra_console.app.split_advisor import MIN_GAIN, StageTiming, advise, best_split, evaluate, layer_costs
from hydra_console.contracts.split import ranges

pytestmark = pytest.mark.unit


def probe(counts, ms_per_layer, hops, *, layer_bytes=None, free=None, fixed=0.5, step=None):
    """A PROBE reply (contracts.rpc.PipelineProbe) for stages holding `counts` layers each."""
    n = sum(counts)
    stages = []
    for i, ((a, b), ms, hop) in enumerate(zip(ranges(counts), ms_per_layer, hops)):
        sizes = layer_bytes[i] if layer_bytes else [100] * n
        st = {
            "name": "head" if i == 0 else f"peer{i}",
            "layers": [a, b],
            "device": "cpu",
            "decode_ms": [ms] * (b - a),
            "prefill_ms": [4 * ms] * (b - a),
            "layer_bytes": sizes,
            "held_bytes": sum(sizes[a:b]),
            "free_bytes": free[i] if free else 10**12,
        }
        if i:
            st["hop_ms"] = hop
        stages.append(st)
    return {"tokens": 8, "stages": stages, "fixed_ms": fixed, "step_ms": step}


def brute_force(costs, hops, fixed, pipelined, fits=lambda counts: True):
    n_stages, n = len(costs), len(costs[0])
    best = None
    for cuts in itertools.combinations_with_replacement(range(n + 1), n_stages - 1):
        bounds = [0, *cuts, n]
        counts = [bounds[i + 1] - bounds[i] for i in range(n_stages)]
        if any(c < 1 for c in counts[1:]) or not fits(counts):
            continue
        if any(c and math.isinf(costs[k][0]) for k, c in enumerate(counts)):
            continue
        plan = evaluate(counts, costs, hops, fixed, pipelined)
        if best is None or plan.step_ms < best.step_ms - 1e-9:
            best = plan
    return best


def test_layers_move_away_from_a_slow_peer():
    advice = advise(probe([4, 4], [1.0, 20.0], [0.0, 0.3]))
    assert advice.proposal == [7, 1]  # a peer must keep one layer; the rest run where they are fastest
    assert advice.current.step_ms == pytest.approx(0.5 + 4 + 80 + 0.3)
    assert advice.best.step_ms == pytest.approx(0.5 + 7 + 20 + 0.3)
    assert advice.best.tok_s > 3 * advice.current.tok_s


def test_a_fast_peer_takes_the_layers_and_the_head_may_hold_none():
    advice = advise(probe([2, 6], [10.0, 1.0], [0.0, 2.0]))
    assert advice.proposal == [0, 8]


def test_memory_caps_the_fast_device():
    # The head's device fits 5 layers of 100 bytes (free 300 + its 2 held): the rest stay on the slow peer.
    advice = advise(probe([2, 6], [1.0, 20.0], [0.0, 0.3], free=[300, 10**9]))
    assert advice.proposal == [5, 3]
    assert advice.stages[0].budget_bytes == 500


def test_no_split_fits_then_the_current_one_is_kept():
    advice = advise(probe([4, 4], [1.0, 20.0], [0.0, 0.3], free=[0, 0]))
    assert advice.proposal is None and advice.best == advice.current


def test_a_gain_below_the_noise_proposes_nothing():
    advice = advise(probe([4, 4], [1.0, 1.0 + MIN_GAIN / 4], [0.0, 0.0]))
    assert advice.proposal is None


def test_unmeasured_layers_cost_their_bytes_at_the_device_rate():
    # The peer measured layers 2..3 (200 bytes each) at 4 ms: 0.02 ms per byte, so a 50-byte layer costs 1 ms there.
    st = StageTiming.from_probe({"layers": [2, 4], "decode_ms": [4.0, 4.0], "layer_bytes": [50, 100, 200, 200]})
    assert layer_costs(st, 4) == pytest.approx([1.0, 2.0, 4.0, 4.0])
    assert layer_costs(StageTiming.from_probe({"layers": [0, 0]}), 3) == [math.inf] * 3


def test_the_sum_objective_is_what_hydra_runs_and_max_is_for_pipelining():
    costs, hops = [[1.0] * 8, [1.0] * 8], [0.0, 0.0]
    # Equal devices: every split costs the same in sequence, but only an even one balances a pipeline.
    assert best_split(costs, hops).step_ms == pytest.approx(8.0)
    assert best_split(costs, hops, pipelined=True).counts == [4, 4]


@pytest.mark.parametrize("pipelined", [False, True])
def test_dynamic_programme_matches_brute_force(pipelined):
    costs = [[0.7, 1.1, 0.9, 1.3, 0.8, 1.0], [2.0, 0.4, 1.9, 0.6, 1.7, 0.5], [1.2, 1.2, 0.3, 0.3, 1.2, 1.2]]
    hops = [0.0, 0.4, 0.9]
    sizes = [[3, 1, 4, 1, 5, 9]] * 3
    budgets = [9, 12, 10]

    def fits(counts):
        return all(sum(sizes[k][a:b]) <= budgets[k] for k, (a, b) in enumerate(ranges(counts)))

    plan = best_split(costs, hops, fixed_ms=0.2, layer_bytes=sizes, budgets=budgets, pipelined=pipelined)
    expected = brute_force(costs, hops, 0.2, pipelined, fits)
    assert expected is not None
    assert plan.step_ms == pytest.approx(expected.step_ms)
    assert fits(plan.counts)


def test_a_tolerant_reading_of_odd_replies():
    with pytest.raises(ValueError):
        advise({"stages": "nonsense"})
    with pytest.raises(ValueError, match="malformed"):
        advise({"stages": [{"layers": ["a", None], "decode_ms": [1]}]})
    st = StageTiming.from_probe({"name": "p", "layers": [1, 2]})
    assert st.mean_ms() is None and st.budget_bytes is None and st.hop_ms == 0.0
