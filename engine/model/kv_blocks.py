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

The CUDA graphs' padding rows (a bucket's rows a batch does not fill) need somewhere to write that
no slot reads: `padding` > 0 adds one table row, the padding slot, whose positions n_ctx ..
n_ctx + padding - 1 all fall in block 0. Reserved blocks are then `padding` positions longer than a
context (block 0 is slot 0's, whose positions stop at n_ctx); in a pool block 0 is no slot's. A
whole extra slot would cost a full context of KV (0.7 GB on the 26B pair's head).
"""

from __future__ import annotations

import torch

from ...contracts.footprint import KV_BLOCK
from ..errors import KVPoolFull


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVBlocks:
    """The block table of `rows` slots whose contexts reach `n_ctx` positions each (+ the padding
    slot, row `rows`, with `padding` positions past n_ctx)."""

    def __init__(self, rows: int, n_ctx: int, block_size: int, n_blocks: int, device, pooled: bool, padding: int = 0):
        self.n_ctx, self.block_size, self.n_blocks, self.pooled = n_ctx, block_size, n_blocks, pooled
        self.padding = padding
        self.pad_slot = rows if padding else None  # the padding slot's table row
        table = torch.zeros(rows + (padding > 0), _cdiv(n_ctx + padding, block_size), dtype=torch.int32)
        if pooled:
            self.held: list[list[int]] = [[] for _ in range(rows)]
            self.free = list(range(n_blocks - 1, 0, -1))  # pop() hands out low ids first
        else:
            table[:rows, 0] = torch.arange(rows)
            self.held, self.free = [[r] for r in range(rows)], []
        self.table = table.to(device)

    @classmethod
    def reserved(cls, rows: int, n_ctx: int, device, padding: int = 0) -> KVBlocks:
        return cls(rows, n_ctx, n_ctx + padding, rows, device, pooled=False, padding=padding)

    @classmethod
    def pool(cls, rows: int, n_ctx: int, n_tokens: int, device, padding: int = 0) -> KVBlocks:
        """A pool of `n_tokens` positions (whole blocks, plus block 0)."""
        return cls(rows, n_ctx, KV_BLOCK, _cdiv(n_tokens, KV_BLOCK) + 1, device, pooled=True, padding=padding)

    @property
    def pool_tokens(self) -> int:
        """Positions slots can hold together."""
        return (self.n_blocks - 1) * self.block_size if self.pooled else self.n_blocks * self.n_ctx

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
                f"KV pool full, the context size has been exceeded: this step needs {short} more blocks of "
                f"{self.block_size} positions, {len(self.free)} of {self.n_blocks - 1} are free (-c/--ctx-size sets "
                "the pool with --kv-unified)"
            )
        for slot, n in want.items():
            held = self.held[slot]
            if n > len(held):
                new = [self.free.pop() for _ in range(n - len(held))]
                # From pageable memory: staged at once, no wait on the device.
                self.table[slot, len(held) : n].copy_(torch.tensor(new, dtype=torch.int32), non_blocking=True)
                held += new

    def release(self, slot: int) -> None:
        self.fit({slot: 0})
