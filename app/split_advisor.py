"""The split advisor: from each stage's measured layer times, hop times and memory, the contiguous
split that decodes fastest, with predicted decode tok/s for it and for the split running now.

What "fastest" means here. Hydra runs a step's batch through the stages one after another (the
head's layers, then each peer's, then the output), with no micro-batches overlapping stages. A step
therefore costs the SUM of every stage's time plus every hop, and that holds for one stream and for
many alike: many streams share each step as one batch, they never keep two stages busy at once. So
the optimum puts each layer where it runs fastest, as far as memory allows, keeping stages
contiguous. Minimising the slowest stage (the max) is the optimum only for an engine that overlaps
stages across micro-batches (GPipe-style pipelining); `pipelined=True` computes that one, so the two
can be compared, but it is not what Hydra runs.

A worker times only the layers it holds; a layer it does not hold is costed at its bytes times the
device's measured ms per byte (decode streams each layer's weights once per token: time follows
bytes). Memory: a stage's layers (weights + KV for the configured slots and context, as that worker
holds them) must fit its free memory plus what its current layers free. Workers sharing one machine
each see all of its free memory, so that check is optimistic for them.

Plain functions over plain data (no I/O): the console feeds them a PROBE reply.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import accumulate
from typing import Callable

from ..contracts.split import ranges

MIN_GAIN = 0.05  # propose a change only when it predicts at least this much faster: probes are noisy


@dataclass(frozen=True)
class StageTiming:
    """One stage's PROBE answer (contracts.rpc.StageProbe + the head's name and hop_ms)."""

    name: str
    layers: tuple[int, int]
    device: str
    decode_ms: list[float]  # per layer of `layers`
    prefill_ms: list[float]
    hop_ms: float  # the wire's part of a FORWARD to this stage (0 for the head)
    layer_bytes: list[int]  # every layer of the model as this worker would hold it
    budget_bytes: int | None  # free memory + what its current layers take; None = unknown

    @classmethod
    def from_probe(cls, d: dict) -> "StageTiming":
        layers = tuple(d.get("layers") or (0, 0))
        free, held = d.get("free_bytes"), d.get("held_bytes")
        return cls(
            name=str(d.get("name", "?")),
            layers=(int(layers[0]), int(layers[1])),
            device=str(d.get("device", "?")),
            decode_ms=[float(x) for x in d.get("decode_ms") or []],
            prefill_ms=[float(x) for x in d.get("prefill_ms") or []],
            hop_ms=float(d.get("hop_ms") or 0.0),
            layer_bytes=[int(x) for x in d.get("layer_bytes") or []],
            budget_bytes=int(free) + int(held or 0) if free is not None else None,
        )

    def mean_ms(self, kind: str = "decode") -> float | None:
        ms = self.decode_ms if kind == "decode" else self.prefill_ms
        return sum(ms) / len(ms) if ms else None


@dataclass(frozen=True)
class Plan:
    counts: list[int]
    stage_ms: list[float]  # each stage's layers + its hop
    step_ms: float  # what one decode step costs under the objective (sum, or max when pipelined)

    @property
    def tok_s(self) -> float:
        """Decode tokens/s of one stream (a batch of B streams makes B tokens per step)."""
        return 1e3 / self.step_ms if self.step_ms > 0 else math.inf


@dataclass(frozen=True)
class Advice:
    stages: list[StageTiming]
    current: Plan
    best: Plan
    proposal: list[int] | None  # None: the current split is within MIN_GAIN of the best
    measured_step_ms: float | None  # the head's whole decode step, measured by the probe
    fixed_ms: float

    @property
    def measured_tok_s(self) -> float | None:
        return 1e3 / self.measured_step_ms if self.measured_step_ms else None


def layer_costs(stage: StageTiming, n_layers: int, kind: str = "decode") -> list[float]:
    """Each layer's ms on this stage's device: measured where it holds the layer, else the layer's
    bytes times the device's measured ms per byte (inf when it measured nothing: it gets no layers)."""
    measured = stage.decode_ms if kind == "decode" else stage.prefill_ms
    a, b = stage.layers
    if not measured or len(measured) != b - a:
        return [math.inf] * n_layers
    sizes = stage.layer_bytes if len(stage.layer_bytes) == n_layers else [1] * n_layers
    held = sum(sizes[a:b])
    per_byte = sum(measured) / held if held else 0.0
    out = [sizes[i] * per_byte for i in range(n_layers)]
    out[a:b] = measured
    return out


def evaluate(
    counts: list[int], costs: list[list[float]], hops: list[float], fixed_ms: float = 0.0, pipelined: bool = False
) -> Plan:
    """What a split costs per decode step: the stages' sum (Hydra) or their max (pipelined)."""
    stage_ms = [sum(c[a:b]) + hop for c, (a, b), hop in zip(costs, ranges(counts), hops)]
    step = max(stage_ms) + fixed_ms if pipelined else sum(stage_ms) + fixed_ms
    return Plan(list(counts), stage_ms, step)


def best_split(
    costs: list[list[float]],
    hops: list[float],
    *,
    fixed_ms: float = 0.0,
    layer_bytes: list[list[int]] | None = None,
    budgets: list[int | None] | None = None,
    min_layers: list[int] | None = None,
    pipelined: bool = False,
    fits: Callable[[int, int, int], bool] | None = None,
) -> Plan | None:
    """The contiguous split minimising the step (dynamic programming over stage boundaries,
    O(stages x layers^2)); None when no split fits the memory budgets. `min_layers` per stage:
    by default the head may hold none and every peer at least one (contracts.split). `fits(k, a, b)`:
    whether stage k may hold layers [a, b) (its card: split_fit.py)."""
    n_stages, n_layers = len(costs), len(costs[0])
    mins = min_layers or [0] + [1] * (n_stages - 1)
    cost_sum = [[0.0, *accumulate(c)] for c in costs]
    byte_sum = [[0, *accumulate(b)] for b in layer_bytes] if layer_bytes else None
    inf = math.inf
    # best[k][e]: the objective of stages 0..k covering layers [0, e); cut[k][e]: where stage k starts.
    best = [[inf] * (n_layers + 1) for _ in range(n_stages)]
    cut = [[0] * (n_layers + 1) for _ in range(n_stages)]
    for k in range(n_stages):
        for e in [n_layers] if k == n_stages - 1 else range(n_layers + 1):  # the last stage ends the model
            for a in range(e - mins[k] + 1) if k else [0]:
                if e - a < mins[k]:
                    continue
                prev = best[k - 1][a] if k else 0.0
                if prev == inf:
                    continue
                if byte_sum and budgets and budgets[k] is not None and byte_sum[k][e] - byte_sum[k][a] > budgets[k]:
                    continue
                ms = cost_sum[k][e] - cost_sum[k][a] if e > a else 0.0
                if ms == inf or (math.isnan(ms)):
                    continue
                if fits is not None and not fits(k, a, e):
                    continue
                stage = ms + hops[k]
                value = max(prev, stage) if pipelined else prev + stage
                if value < best[k][e]:
                    best[k][e], cut[k][e] = value, a
    if best[-1][n_layers] == inf:
        return None
    counts, e = [], n_layers
    for k in range(n_stages - 1, -1, -1):
        a = cut[k][e]
        counts.append(e - a)
        e = a
    return evaluate(counts[::-1], costs, hops, fixed_ms, pipelined)


def advise(
    probe: dict,
    min_gain: float = MIN_GAIN,
    pipelined: bool = False,
    fits: Callable[[int, int, int], bool] | None = None,
) -> Advice:
    """From a PROBE reply (contracts.rpc.PipelineProbe): the running split's predicted step, the
    best split's, and a proposal when it is at least `min_gain` faster. `fits(k, a, b)`: whether
    stage k's card holds layers [a, b) with the headroom (split_fit.Planner.stage_fits): a proposal
    always fits; a running split that does not is left whatever it predicts."""
    try:
        stages = [StageTiming.from_probe(s) for s in probe.get("stages") or [] if isinstance(s, dict)]
    except (TypeError, ValueError, IndexError) as e:
        raise ValueError(f"malformed probe reply: {e}") from None
    if not stages:
        raise ValueError("the probe reply holds no stages")
    n_layers = stages[-1].layers[1]
    costs = [layer_costs(s, n_layers) for s in stages]
    hops = [s.hop_ms for s in stages]
    fixed = float(probe.get("fixed_ms") or 0.0)
    counts = [s.layers[1] - s.layers[0] for s in stages]
    current = evaluate(counts, costs, hops, fixed, pipelined)
    sizes = [s.layer_bytes for s in stages] if all(len(s.layer_bytes) == n_layers for s in stages) else None
    best = (
        best_split(
            costs,
            hops,
            fixed_ms=fixed,
            layer_bytes=sizes,
            budgets=[s.budget_bytes for s in stages],
            pipelined=pipelined,
            fits=fits,
        )
        or current
    )
    misfit = fits is not None and not all(fits(k, a, b) for k, (a, b) in enumerate(ranges(counts)))
    worth = best.counts != counts and (misfit or best.step_ms < current.step_ms * (1 - min_gain))
    measured = probe.get("step_ms")
    return Advice(stages, current, best, best.counts if worth else None, float(measured) if measured else None, fixed)
