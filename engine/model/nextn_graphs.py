"""CUDA graphs of the MTP block's greedy draft chain: k steps of (embedding, the block, its output
head, the pick) for a batch bucket, replayed in one launch.

Eagerly a draft step is a few dozen launches and the block's graph, each queued from Python: on the
27B shape the host took longer to queue a step than the GPU to run it (its output head, a 1 GB
read, is most of the step's bytes), so the drafts ran at the host's pace between two verifies. The
chain's graph runs the same operations on the same kernels, so its drafts are the eager chain's."""

from __future__ import annotations

import torch

from .deltanet import ROLLBACK
from .forward_batch import ForwardBatch
from .graphs import GraphIndex, batch_buckets


class DraftChainGraphs:
    """Per (batch bucket, k, top_k): a graph of `NextN.chain` over static inputs (the slots' last tokens,
    the hidden states before them, their slots and positions), captured by `warm_up` or on first
    use, in the block's graphs' memory pool. Rows past the batch run in the block's padding slot, at
    positions past the context (as `DecodeGraphs`)."""

    def __init__(self, nextn):
        self.nextn = nextn
        self.block = nextn.block
        self.buckets = batch_buckets(self.block.n_slots)
        self.graphs: dict[tuple[int, int, int], tuple] = {}

    def warm_up(self, k_max: int, top_k: int) -> None:
        for k in range(1, min(k_max, ROLLBACK) + 1):
            for size in self.buckets:
                if (size, k, top_k) not in self.graphs:
                    self.graphs[size, k, top_k] = self._capture(size, k, top_k)

    def run(self, tokens: torch.Tensor, h: torch.Tensor, slots: list[int], positions: list[int], k: int, top_k: int):
        """Picks [B, k] and their probabilities over the top `top_k` [B, k] of B distinct slots, each
        drafting from `positions[i]` (None: not a graph's batch; the caller runs the chain eagerly)."""
        B, blk = len(slots), self.block
        if k > ROLLBACK or B > self.buckets[-1] or len(set(slots)) != B or max(positions) + k > blk.n_ctx:
            return None
        blk.kv_blocks.fit({s: p + k for s, p in zip(slots, positions)})  # as the eager steps leave it
        size = next(s for s in self.buckets if s >= B)
        if (size, k, top_k) not in self.graphs:
            self.graphs[size, k, top_k] = self._capture(size, k, top_k)
        graph, tok_in, h_in, index, (picks, probs) = self.graphs[size, k, top_k]
        index.set(slots, positions)
        tok_in[:B].copy_(tokens)
        h_in[:B].copy_(h)
        graph.replay()
        return picks[:B].clone(), probs[:B].clone()

    def _capture(self, size: int, k: int, top_k: int):
        blk, dev = self.block, self.block.device
        tok_in = torch.zeros(size, dtype=torch.long, device=dev)
        h_in = torch.zeros(size, blk.cfg.n_embd, device=dev)
        index = GraphIndex(
            torch.stack([torch.full((size,), blk.kv_blocks.pad_slot), torch.full((size,), blk.n_ctx)]), dev
        )
        forward = blk.graphs.forward  # the block's own (compiled) decode forward

        def layer_at(step: int):
            batch = ForwardBatch.batched(index.device[0], index.device[1] + step, 1, kv_len=blk.n_ctx)
            return lambda x: forward(x, batch)

        graph, out = blk.graphs.capture(lambda: self.nextn.chain(tok_in, h_in, k, layer_at, top_k))
        return graph, tok_in, h_in, index, out
