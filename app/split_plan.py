"""The per-stage memory estimate the split editor shows before applying a split.

Weights are counted as each worker will hold them: on a GPU, GGUF-quantized tensors stay in their
file bytes (from the tensor table; the K-quants' unpacked scales add ~3 %, as the engine's
`device_bytes`), and on a CPU every tensor is expanded to the compute dtype. KV is K and V in the
compute dtype (the engine has no separate KV type) for every slot at full context. The split
advisor's PROBE answers with each worker's own per-layer footprint, which is exact.

The split arithmetic itself (counts, ranges, boundaries) is the shared contract in
`contracts.split`, so the editor previews exactly what the engine applies.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from ..contracts.errors import UserError
from ..contracts.split import ranges, split_arg

_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.")
# Tensors only the head holds: embedding (also the tied output) and the final norm + output.
_HEAD_TENSORS = ("token_embd.", "output_norm.", "output.")
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
_FLOAT_TYPES = {"F32", "F16", "BF16", "F64"}  # never held quantized: expanded to the compute dtype
QUANT_OVERHEAD = 1.03  # a quantized tensor on a GPU: file bytes + unpacked K-quant scales


@dataclass(frozen=True)
class StageEstimate:
    layers: tuple[int, int]
    weight_bytes: int  # the stage's tensors as its worker holds them
    kv_bytes: int  # KV cache of its layers for all slots at full context, at the compute dtype

    @property
    def total(self) -> int:
        return self.weight_bytes + self.kv_bytes


@dataclass(frozen=True)
class ModelShape:
    """Sizes per stage part, read once from the GGUF's tensor table (no tensor data is read).
    `*_elements` count every tensor's values; `*_quant_bytes` / `*_quant_elements` the file bytes
    and values of the quantized tensors among them."""

    n_layers: int
    layer_elements: list[int]
    head_elements: int  # embedding (also the tied output) + final norm + output
    kv_elements_per_token_layer: int  # K + V, per token per layer
    layer_quant_bytes: list[int] = field(default_factory=list)
    layer_quant_elements: list[int] = field(default_factory=list)
    head_quant_bytes: int = 0
    head_quant_elements: int = 0

    @classmethod
    def from_gguf(cls, path: str | Path) -> "ModelShape":
        from ..engine.gguf_file import GGUFFile

        g = GGUFFile(path)
        arch = g.architecture
        n_layers = int(g.get(f"{arch}.block_count", 0))
        if n_layers < 1:
            raise UserError(f"{path}: no {arch}.block_count in the GGUF metadata")
        elements, qbytes, qelements = [0] * (n_layers + 1), [0] * (n_layers + 1), [0] * (n_layers + 1)
        for name, t in g.tensors.items():
            m = _LAYER_TENSOR.match(name)
            if m and int(m.group(1)) < n_layers:
                i = int(m.group(1))
            elif name.startswith(_HEAD_TENSORS):
                i = n_layers  # the head's own slot
            else:
                continue
            elements[i] += t.n_elements
            if t.ggml_type.name not in _FLOAT_TYPES:
                qbytes[i] += t.nbytes
                qelements[i] += t.n_elements
        n_head = int(g.get(f"{arch}.attention.head_count", 1))
        n_kv = g.get(f"{arch}.attention.head_count_kv", n_head)
        n_kv = int(max(n_kv) if isinstance(n_kv, (list, tuple)) else n_kv)
        n_embd = int(g.get(f"{arch}.embedding_length", 0))
        k_len = int(g.get(f"{arch}.attention.key_length", n_embd // max(n_head, 1)))
        v_len = int(g.get(f"{arch}.attention.value_length", k_len))
        return cls(n_layers, elements[:-1], elements[-1], n_kv * (k_len + v_len),
                   qbytes[:-1], qelements[:-1], qbytes[-1], qelements[-1])  # fmt: skip

    def _weights(self, a: int, b: int, head: bool, size: int, quantized: bool) -> int:
        elements = sum(self.layer_elements[a:b]) + (self.head_elements if head else 0)
        if not quantized or not self.layer_quant_bytes:
            return elements * size
        qbytes = sum(self.layer_quant_bytes[a:b]) + (self.head_quant_bytes if head else 0)
        qelements = sum(self.layer_quant_elements[a:b]) + (self.head_quant_elements if head else 0)
        return int(qbytes * QUANT_OVERHEAD) + (elements - qelements) * size

    def estimate(self, counts: list[int], n_ctx: int, n_slots: int, dtype: str = "bfloat16",
                 quantized: list[bool] | None = None) -> list[StageEstimate]:  # fmt: skip
        """Per stage: weights (quantized where `quantized[i]`, i.e. the stage's worker computes on
        a GPU that keeps them so; else at `dtype`) and KV at `dtype`."""
        if sum(counts) != self.n_layers:
            raise UserError(f"split {split_arg(counts)} covers {sum(counts)} layers, the model has {self.n_layers}")
        size = DTYPE_BYTES.get(dtype, 2)
        quantized = quantized or [False] * len(counts)
        out = []
        for i, (a, b) in enumerate(ranges(counts)):
            w = self._weights(a, b, i == 0, size, quantized[i])
            kv = (b - a) * n_ctx * n_slots * self.kv_elements_per_token_layer * size
            out.append(StageEstimate((a, b), w, kv))
        return out
