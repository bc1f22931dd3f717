"""The per-stage memory estimate the split editor shows before applying a split.

The split arithmetic itself (counts, ranges, boundaries) is the shared contract in
`contracts.split`, so the editor previews exactly what the engine applies.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ..contracts.errors import UserError
from ..contracts.split import ranges, split_arg

_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.")
# Tensors only the head holds: embedding (also the tied output) and the final norm + output.
_HEAD_TENSORS = ("token_embd.", "output_norm.", "output.")
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


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
