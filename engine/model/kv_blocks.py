"""Which cache blocks hold each slot's positions: the block table the KV caches of one Stage share.

Every attention layer stores K and V as blocks of `block_size` positions ([n_blocks, n_kv,
block_size, head_dim], kv_cache.py); position p of a slot lives in block table[slot, p // block_size]
at offset p % block_size. The layers of a stage see the same positions, so one table serves them all.
Two ways to hand blocks out, as llama-server's `--kv-unified` chooses:

- reserved (`KVBlocks.reserved`): each slot owns one block as long as its context, from the start:
  memory for every slot at full context, nothing to allocate.
- pooled (`KVBlocks.pool`): a pool of positions in blocks of KV_BLOCK that all slots share. A slot
  takes blocks as it grows and gives back those past its length when it is cut back or cleared, so
  slots of mixed length fit where every slot at full context would not. Block 0 belongs to no slot:
  table entries not handed out point at it (reads there are masked; the CUDA graphs' padding rows
  write there).
"""

from __future__ import annotations

import torch

from ...contracts.footprint import KV_BLOCK
from ..errors import KVPoolFull



def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVBlocks:
    """The block table of `rows` slots whose contexts reach `n_ctx` positions each."""

    def __init__(self, rows: int, n_ctx: int, block_size: int, n_blocks: int, device, pooled: bool):
        self.n_ctx, self.block_size, self.n_blocks, self.pooled = n_ctx, block_size, n_blocks, pooled
        table = torch.zeros(rows, _cdiv(n_ctx, block_size), dtype=torch.int32)
        if pooled:
            self.held: list[list[int]] = [[] for _ in range(rows)]
            self.free = list(range(n_blocks - 1, 0, -1))  # pop() hands out low ids first
        else:
            table[:, 0] = torch.arange(rows)
            self.held, self.free = [[r] for r in range(rows)], []
        self.table = table.to(device)

    @classmethod
    def reserved(cls, rows: int, n_ctx: int, device) -> KVBlocks:
        return cls(rows, n_ctx, n_ctx, rows, device, pooled=False)

    @classmethod
    def pool(cls, rows: int, n_ctx: int, n_tokens: int, device) -> KVBlocks:
        """A pool of `n_tokens` positions (whole blocks, plus block 0)."""
        return cls(rows, n_ctx, KV_BLOCK, _cdiv(n_tokens, KV_BLOCK) + 1, device, pooled=True)

    @property
    def pool_tokens(self) -> int:
        """Positions slots can hold together."""
        return (self.n_blocks - 1 if self.pooled else self.n_blocks) * self.block_size

    @property
    def free_tokens(self) -> int:
        return len(self.free) * self.block_size if self.pooled else 0

    def shortfall(self, lengths: dict[int, int]) -> int:
        """Blocks `fit(lengths)` would lack."""
        if not self.pooled:
            return 0
        trimmed = sum(max(0, len(self.held[slot]) - _cdiv(n, self.block_size)) for slot, n in lengths.items())
        grown = sum(max(0, _cdiv(n, self.block_size) - len(self.held[slot])) for slot, n in lengths.items())
        return max(0, grown - trimmed - len(self.free))

    def fit(self, lengths: dict[int, int]) -> None:
        """From now on each slot holds positions 0..length-1: blocks past a length go back to the pool,
        then missing ones are taken, all or none (KVPoolFull names what was short)."""
        if not self.pooled:
            return
        want = {slot: _cdiv(n, self.block_size) for slot, n in lengths.items()}
        for slot, n in want.items():
            held = self.held[slot]
            if n < len(held):  # positions past the length are stale: their blocks are free again
                self.free += reversed(held[n:])
                del held[n:]
        short = sum(max(0, n - len(self.held[slot])) for slot, n in want.items())
        if short > len(self.free):
            raise KVPoolFull(
                f"KV pool full: this step needs {short} more blocks of {self.block_size} positions, {len(self.free)} of "
                f"{self.n_blocks - 1} are free (-c/--ctx-size sets the pool with --kv-unified)")
        for slot, n in want.items():
            held = self.held[slot]
            if n > len(held):
                new = [self.free.pop() for _ in range(n - len(held))]
                # From pageable memory: staged at once, no wait on the device.
                self.table[slot, len(held) : n].copy_(torch.tensor(new, dtype=torch.int32), non_blocking=True)
                held += new

    def release(self, slot: int) -> None:
        self.fit({slot: 0})
