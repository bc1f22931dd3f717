"""The layer-split grammar, shared by `hydra-engine serve --split`, CONFIGURE and the console.

A split names how many layers each stage holds, in pipeline order: the head first, then the
peers in `--peer` order. Text forms: counts `9/9` or `9,9` (summing to the layer count) or
proportions `1,2` / `0.25/0.75` (normalised: stage boundaries at the rounded cumulative share).
No text: an even split, the larger shares first. The head may hold no layer (it still embeds
and samples); every peer holds at least one. Ranges are the half-open [a, b) per stage that
/status reports.
"""

from __future__ import annotations

import math
import re

from .errors import UserError

Ranges = list[tuple[int, int]]


class SplitError(UserError):
    """A split that cannot describe this pipeline."""


def even_split(n_layers: int, n_stages: int) -> list[int]:
    """Counts that differ by at most one, the larger ones first (18 over 4 -> [5, 5, 4, 4])."""
    if n_stages < 1:
        raise SplitError("a pipeline needs at least the head stage")
    if n_layers < n_stages:
        raise SplitError(f"cannot split {n_layers} layers evenly over {n_stages} stages")
    base, extra = divmod(n_layers, n_stages)
    return [base + (1 if i < extra else 0) for i in range(n_stages)]


def parse_counts(text: str | None, n_layers: int, n_stages: int) -> list[int]:
    """`--split` text -> layer count per stage (validated)."""
    if text is None or not text.strip():
        counts = even_split(n_layers, n_stages)
    else:
        weights = _weights(text, n_stages)
        if all(w == int(w) for w in weights) and sum(weights) == n_layers:
            counts = [int(w) for w in weights]
        else:
            total, acc, bounds = sum(weights), 0.0, [0]
            for w in weights:
                acc += w
                bounds.append(round(acc / total * n_layers))
            counts = [b - a for a, b in zip(bounds, bounds[1:])]
    check_ranges(ranges(counts), n_layers, n_stages)
    return counts


def parse_split(text: str | None, n_layers: int, n_stages: int) -> Ranges:
    """`--split` text -> one [a, b) per stage, head first."""
    return ranges(parse_counts(text, n_layers, n_stages))


def _weights(text: str, n_stages: int) -> list[float]:
    parts = [p.strip() for p in re.split(r"[/,]", text)]
    try:
        weights = [float(p) for p in parts]
    except ValueError:
        raise SplitError(f"split {text!r}: expected numbers separated by / or , (e.g. 9/9 or 0.5,0.5)") from None
    if len(weights) != n_stages:
        raise SplitError(
            f"split {text!r} has {len(weights)} stages but the pipeline has {n_stages}: "
            f"the head and {n_stages - 1} peer(s), in --peer order"
        )
    if any(not (w >= 0 and math.isfinite(w)) for w in weights) or sum(weights) <= 0:
        raise SplitError(f"split {text!r}: stage sizes must be finite, >= 0 and not all 0")
    return weights


def ranges(counts: list[int]) -> Ranges:
    out, a = [], 0
    for n in counts:
        out.append((a, a + n))
        a += n
    return out


def counts_of(layer_ranges: Ranges) -> list[int]:
    return [b - a for a, b in layer_ranges]


def split_arg(counts: list[int]) -> str:
    """Counts as `--split` text (`9/9`)."""
    return "/".join(str(n) for n in counts)


def check_ranges(layer_ranges: Ranges, n_layers: int, n_stages: int) -> None:
    """Contiguous cover of [0, n_layers), head first; every peer holds at least one layer."""
    if len(layer_ranges) != n_stages:
        raise SplitError(f"{len(layer_ranges)} layer ranges for {n_stages} stages (the head and {n_stages - 1} peers)")
    expect = 0
    for i, (a, b) in enumerate(layer_ranges):
        if a != expect or b < a:
            raise SplitError(
                f"layer ranges {layer_ranges} must be contiguous from 0 (stage {i} starts at {a}, expected {expect})"
            )
        if i > 0 and b == a:
            raise SplitError(f"layer ranges {layer_ranges}: peer {i} would hold no layer")
        expect = b
    if expect != n_layers:
        raise SplitError(f"layer ranges {layer_ranges} cover {expect} layers, the model has {n_layers}")


def move_boundary(counts: list[int], boundary: int, delta: int) -> list[int]:
    """Shift the boundary between stage `boundary` and `boundary+1` by `delta` layers (positive
    gives layers to the earlier stage), clamped so the result stays valid: holding an arrow key
    never produces a split the engine would refuse."""
    if not 0 <= boundary < len(counts) - 1:
        raise ValueError(f"boundary {boundary} out of range for {len(counts)} stages")
    floor = [0] + [1] * (len(counts) - 1)  # the head may hold no layer, a peer at least one
    new = list(counts)
    if delta > 0:
        delta = min(delta, new[boundary + 1] - floor[boundary + 1])
    else:
        delta = -min(-delta, new[boundary] - floor[boundary])
    new[boundary] += delta
    new[boundary + 1] -= delta
    return new
