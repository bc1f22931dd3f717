"""One attention layer's K and V for every slot, in a cache type (`--cache-type-k` / `--cache-type-v`).

Types as llama.cpp names them: `f32`, `f16`, `bf16` store values as they are; `q8_0` stores int8
codes with one float16 scale per 32 values of a head (d = max|x| / 127, code = round(x / d)), about
half the bytes of f16. `auto` follows the compute dtype (exact: the fp32 CPU path stays bit-equal).
Reads return the compute dtype; positions a slot has not written are never read (attention masks
them), so nothing needs clearing for correctness. Positions live in blocks (kv_blocks.py): one per
slot when reserved, blocks of a shared pool when pooled.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..config import KV_CACHE_TYPES as CACHE_TYPES
from ..errors import UserError
from .kv_blocks import KVBlocks

_DENSE = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
Q8_BLOCK = 32


def check_cache_type(name: str, flag: str, head_dim: int | None = None) -> None:
    if name not in CACHE_TYPES:
        raise UserError(f"{flag} must be one of {', '.join(CACHE_TYPES)}, got {name!r}")
    if name == "q8_0" and head_dim is not None and head_dim % Q8_BLOCK:
        raise UserError(f"{flag} q8_0 needs a head size that is a multiple of {Q8_BLOCK} (this model's is {head_dim})")


class _Store:
    """One of K or V: [n_blocks, n_kv, block_size, head_dim] in a cache type."""

    def __init__(self, kind: str, shape: tuple[int, ...], compute: torch.dtype, device):
        self.kind, self.compute = kind, compute
        if kind == "q8_0":
            self.codes = torch.zeros(shape, dtype=torch.int8, device=device)
            self.scale = torch.zeros(*shape[:-1], shape[-1] // Q8_BLOCK, dtype=torch.float16, device=device)
        else:
            self.codes = torch.zeros(shape, dtype=_DENSE.get(kind, compute), device=device)
            self.scale = None

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.scale is None:
            return x.to(self.codes.dtype), None
        blocks = x.float().unflatten(-1, (-1, Q8_BLOCK))
        d = blocks.abs().amax(-1) / 127
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        codes = torch.round(blocks * inv[..., None]).to(torch.int8).flatten(-2)
        return codes, d.to(torch.float16)

    def decode(self, codes: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        if scale is None:
            return codes.to(self.compute)
        x = codes.float().unflatten(-1, (-1, Q8_BLOCK)) * scale.float()[..., None]
        return x.flatten(-2).to(self.compute)

    def put(self, index: tuple, x: torch.Tensor) -> None:
        codes, scale = self.encode(x)
        self.codes[index] = codes
        if scale is not None:
            self.scale[index] = scale

    def get(self, index: tuple) -> torch.Tensor:
        return self.decode(self.codes[index], self.scale[index] if self.scale is not None else None)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.codes,) if self.scale is None else (self.codes, self.scale)


class KVCache:
    """K and V of one layer, in blocks of positions that `blocks` (the stage's block table) assigns
    to slots. `k_type` / `v_type`: CACHE_TYPES."""

    def __init__(
        self,
        blocks: KVBlocks,
        n_kv: int,
        head_dim: int,
        *,
        compute: torch.dtype,
        device,
        k_type: str = "auto",
        v_type: str = "auto",
    ):
        shape = (blocks.n_blocks, n_kv, blocks.block_size, head_dim)
        self.blocks = blocks
        self.k = _Store(k_type, shape, compute, device)
        self.v = _Store(v_type, shape, compute, device)

    def _run(self, slot: int, start: int, end: int) -> tuple[tuple, bool]:
        """The index of one slot's positions start..end-1, and whether it puts positions first
        ([n, n_kv, ...], several blocks) or heads first ([n_kv, n, ...], a slice of one block)."""
        bs = self.blocks.block_size
        if not self.blocks.pooled:  # the slot's one block: a view, no gather
            return (self.blocks.held[slot][0], slice(None), slice(start, end)), False
        pos = torch.arange(start, end, device=self.blocks.table.device)
        return (self.blocks.table[slot, pos // bs].long(), slice(None), pos % bs), True

    def read_run(self, slot: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [n_kv, end - start, head_dim] of one slot, in the compute dtype."""
        index, positions_first = self._run(slot, start, end)
        k, v = self.k.get(index), self.v.get(index)
        return (k.transpose(0, 1), v.transpose(0, 1)) if positions_first else (k, v)

    def _at(self, slots: torch.Tensor, positions: torch.Tensor) -> tuple:
        """The index of (slot, position) pairs: no host values, graph-capturable."""
        bs = self.blocks.block_size
        return self.blocks.table[slots, positions // bs].long(), slice(None), positions % bs

    def scatter(self, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [T, n_kv, head_dim] at (slot, position) pairs, any mix of slots and runs (blocks held: `KVBlocks.fit`)."""
        index = self._at(slots, positions)
        self.k.put(index, k)
        self.v.put(index, v)

    def rows(self, slots: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [T, n_kv, head_dim] at (slot, position) pairs, in the compute dtype."""
        index = self._at(slots, positions)
        return self.k.get(index), self.v.get(index)

    def move(self, slot: int, start: int, end: int, delta: int, turn_k: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Positions [start, end) of `slot` to [start + delta, end + delta), K through `turn_k`
        (float32 [n, n_kv, head_dim] -> same: its RoPE turned by `delta`). Read whole before the
        first write, so the ranges may overlap; the positions left behind are stale (never read)."""
        src = torch.arange(start, end, device=self.blocks.table.device)
        slots = torch.full_like(src, slot)
        k, v = self.rows(slots, src)
        self.scatter(slots, src + delta, turn_k(k.float()), v)

    def gather(self, slots: torch.Tensor, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [B, n_kv, kv_len, head_dim] of each slot's first kv_len positions, in the compute dtype."""
        n = -(-kv_len // self.blocks.block_size)
        blocks = self.blocks.table[slots, :n].long()  # [B, n]

        def whole(t: torch.Tensor) -> torch.Tensor:  # [B, n, n_kv, bs, d] -> [B, n_kv, kv_len, d]
            t = t[blocks]
            return t.permute(0, 2, 1, 3, 4).flatten(2, 3)[:, :, :kv_len]

        return tuple(s.decode(whole(s.codes), None if s.scale is None else whole(s.scale)) for s in (self.k, self.v))

    def views(self, slot: int, n: int) -> dict[str, torch.Tensor]:
        """The slot's first n positions as stored, [n_kv, n, ...] by name suffix (slot state;
        `write_views` puts them back). Views of the cache when reserved, copies when pooled."""
        index, positions_first = self._run(slot, 0, n)
        out = {}
        for name, store in (("k", self.k), ("v", self.v)):
            for suffix, t in (("", store.codes), (".scale", store.scale)):
                if t is not None:
                    out[name + suffix] = t[index].transpose(0, 1) if positions_first else t[index]
        return out

    def write_views(self, slot: int, n: int, tensors: dict[str, torch.Tensor]) -> None:
        """Put back what `views` gave, stored as it is (the slot holds n positions: `KVBlocks.fit`)."""
        index, positions_first = self._run(slot, 0, n)
        for name, store in (("k", self.k), ("v", self.v)):
            for suffix, t in (("", store.codes), (".scale", store.scale)):
                if t is not None:
                    src = tensors[name + suffix].to(t.device)
                    t[index] = src.transpose(0, 1) if positions_first else src

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (*self.k.tensors(), *self.v.tensors())

    def stored(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """K codes, K scales, V codes, V scales as stored (scales None unless q8_0): what the
        decode-attention kernel reads in place through the block table."""
        return self.k.codes, self.k.scale, self.v.codes, self.v.scale

    @staticmethod
    def bytes_per_value(kind: str, compute: torch.dtype) -> float:
        """Storage per cached value: the memory estimates' unit."""
        if kind == "q8_0":
            return 1 + 2 / Q8_BLOCK
        return torch.empty((), dtype=_DENSE.get(kind, compute)).element_size()
