"""Layer split arithmetic and the per-stage memory estimate the split editor shows before applying.

A split is a list of layer counts per stage in pipeline order (head first), the same numbers
`hydra-engine serve --split` takes; ranges are the half-open [a, b) intervals /status reports.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ..engine.errors import UserError

_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.")
# Tensors only the head holds: embedding (also the tied output) and the final norm + output.
_HEAD_TENSORS = ("token_embd.", "output_norm.", "output.")
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def even_split(n_layers: int, n_stages: int) -> list[int]:
    """Counts that differ by at most one, the larger ones first (18 over 2 -> [9, 9])."""
    if n_stages < 1 or n_layers < n_stages:
        raise UserError(f"cannot split {n_layers} layers over {n_stages} stages")
    base, extra = divmod(n_layers, n_stages)
    return [base + (1 if i < extra else 0) for i in range(n_stages)]


def ranges(counts: list[int]) -> list[tuple[int, int]]:
    out, a = [], 0
    for n in counts:
        out.append((a, a + n))
        a += n
    return out


def counts_from_ranges(layer_ranges: list[tuple[int, int]]) -> list[int]:
    return [b - a for a, b in layer_ranges]


def split_arg(counts: list[int]) -> str:
    return "/".join(str(n) for n in counts)


def parse_split(text: str, n_layers: int | None = None) -> list[int]:
    """`9/9`, `9,9` or proportions such as `1,2` (normalised to n_layers when given)."""
    parts = [p for p in re.split(r"[/,]", text.strip()) if p.strip()]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise UserError(f"bad split {text!r}: expected numbers separated by '/' or ','") from None
    if not values or any(v <= 0 for v in values):
        raise UserError(f"bad split {text!r}: every stage needs a positive share")
    if n_layers is None:
        if any(v != int(v) for v in values):
            raise UserError(f"bad split {text!r}: proportions need the model's layer count")
        return [int(v) for v in values]
    if sum(values) == n_layers and all(v == int(v) for v in values):
        return [int(v) for v in values]
    # Proportions: largest-remainder rounding, every stage keeps at least one layer.
    total = sum(values)
    exact = [v / total * n_layers for v in values]
    counts = [max(1, int(x)) for x in exact]
    order = sorted(range(len(values)), key=lambda i: exact[i] - int(exact[i]), reverse=True)
    i = 0
    while sum(counts) < n_layers:
        counts[order[i % len(order)]] += 1
        i += 1
    while sum(counts) > n_layers:
        j = max(range(len(counts)), key=lambda k: counts[k])
        counts[j] -= 1
    if any(c < 1 for c in counts):
        raise UserError(f"bad split {text!r}: {n_layers} layers cannot give every stage one")
    return counts


def move_boundary(counts: list[int], boundary: int, delta: int) -> list[int]:
    """Shift the boundary between stage `boundary` and `boundary+1` by delta layers.

    Positive delta gives layers to the earlier stage. A move that would leave a stage empty is
    clamped, so holding an arrow key never produces an invalid split.
    """
    if not 0 <= boundary < len(counts) - 1:
        raise ValueError(f"boundary {boundary} out of range for {len(counts)} stages")
    new = list(counts)
    if delta > 0:
        delta = min(delta, new[boundary + 1] - 1)
    else:
        delta = -min(-delta, new[boundary] - 1)
    new[boundary] += delta
    new[boundary + 1] -= delta
    return new


@dataclass(frozen=True)
class StageEstimate:
    layers: tuple[int, int]
    weight_bytes: int  # the stage's tensors dequantized to the compute dtype (what the engine keeps resident)
    kv_bytes: int  # KV cache of its layers for all slots at full context, at the compute dtype

    @property
    def total(self) -> int:
        return self.weight_bytes + self.kv_bytes


@dataclass(frozen=True)
class ModelShape:
    """Element counts per stage part, read once from the GGUF's tensor table (no tensor data is read)."""

    n_layers: int
    layer_elements: list[int]
    head_elements: int  # embedding (also the tied output) + final norm + output
    kv_elements_per_token_layer: int  # K + V, per token per layer

    @classmethod
    def from_gguf(cls, path: str | Path) -> "ModelShape":
        from ..engine.gguf_file import GGUFFile

        g = GGUFFile(path)
        arch = g.architecture
        n_layers = int(g.get(f"{arch}.block_count", 0))
        if n_layers < 1:
            raise UserError(f"{path}: no {arch}.block_count in the GGUF metadata")
        layer_elements = [0] * n_layers
        head_elements = 0
        for name, t in g.tensors.items():
            m = _LAYER_TENSOR.match(name)
            if m and int(m.group(1)) < n_layers:
                layer_elements[int(m.group(1))] += t.n_elements
            elif name.startswith(_HEAD_TENSORS):
                head_elements += t.n_elements
        n_head = int(g.get(f"{arch}.attention.head_count", 1))
        n_kv = g.get(f"{arch}.attention.head_count_kv", n_head)
        n_kv = int(max(n_kv) if isinstance(n_kv, (list, tuple)) else n_kv)
        n_embd = int(g.get(f"{arch}.embedding_length", 0))
        k_len = int(g.get(f"{arch}.attention.key_length", n_embd // max(n_head, 1)))
        v_len = int(g.get(f"{arch}.attention.value_length", k_len))
        return cls(n_layers, layer_elements, head_elements, n_kv * (k_len + v_len))

    def estimate(self, counts: list[int], n_ctx: int, n_slots: int, dtype: str = "bfloat16") -> list[StageEstimate]:
        """Per stage: weights and KV at `dtype` (the engine's "auto" is bfloat16; on CPU it keeps
        int8 weight rows, about half of this)."""
        if sum(counts) != self.n_layers:
            raise UserError(f"split {split_arg(counts)} covers {sum(counts)} layers, the model has {self.n_layers}")
        size = DTYPE_BYTES.get(dtype, 2)
        out = []
        for i, (a, b) in enumerate(ranges(counts)):
            w = (sum(self.layer_elements[a:b]) + (self.head_elements if i == 0 else 0)) * size
            kv = (b - a) * n_ctx * n_slots * self.kv_elements_per_token_layer * size
            out.append(StageEstimate((a, b), w, kv))
        return out
