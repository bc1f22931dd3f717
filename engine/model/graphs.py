"""CUDA graphs of the decode step: one captured (optionally torch.compile'd) layer stack per batch bucket."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .stage import Stage


def batch_buckets(max_batch: int) -> list[int]:
    """Batch sizes that get a graph: powers of two below `max_batch`, and `max_batch` itself. A batch
    runs in the smallest bucket that holds it: at most ~2x padded rows, few compiles and captures."""
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return sizes + [max_batch]


class DecodeGraphs:
    """CUDA graphs of one decode step (one token per slot) per batch bucket, captured by `warm_up` or
    on first use.

    Inputs are copied into static buffers (slots and positions through pinned host memory, so the
    host never waits for the device), the graph replays the whole layer stack, and the output
    buffer is cloned out. Rows beyond the batch write their K/V into the stage's padding slot
    (`pad_slot`, a cache row no sequence owns). The decode-attention kernel reads each slot's length
    from its position on the device, so one graph serves every position.
    """

    def __init__(self, stage: Stage, pad_slot: int, compiled: bool = False):
        self.stage = stage
        self.pad_slot = pad_slot
        # torch.compile fuses the many small element-wise kernels between the matrix products
        # (norms, casts, RoPE, residual adds); the graph then replays the fused kernels.
        self.forward = torch.compile(stage._forward, dynamic=False) if compiled else stage._forward
        self.buckets = batch_buckets(stage.n_slots)
        self.graphs: dict[int, tuple] = {}
        self.pool = None

    def reset(self) -> None:
        self.graphs.clear()

    def warm_up(self) -> None:
        """Compile and capture every bucket now (a worker's start), not on the first requests."""
        for size in self.buckets:
            if size not in self.graphs:
                self.graphs[size] = self._capture(size)

    def run(self, h: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        B = h.shape[0]
        if B > self.buckets[-1] or len(set(slots.tolist())) != B:
            return None
        size = next(s for s in self.buckets if s >= B)
        if size not in self.graphs:
            self.graphs[size] = self._capture(size)
        graph, h_in, index, host, copied, out = self.graphs[size]
        copied.synchronize()  # the previous step's copy out of `host` has finished
        host[0, :B].copy_(slots)
        host[1, :B].copy_(positions)
        index.copy_(host, non_blocking=True)
        copied.record()
        h_in[:B].copy_(h)
        graph.replay()
        return out[:B].clone()

    def _capture(self, size: int):
        st = self.stage
        dev = st.device
        h_in = torch.zeros(size, st.cfg.n_embd, device=dev)
        host = torch.zeros(2, size, dtype=torch.long).pin_memory()
        host[0] = self.pad_slot  # rows a batch does not fill stay in the padding slot at position 0
        index = host.to(dev)  # slots, positions

        def step():
            return self.forward(h_in, index[0], index[1], None, batched=True, kv_len=st.n_ctx)

        # Warm up on a side stream (allocator, kernel selection, compilation), as torch's docs
        # prescribe; every row writes K/V into the padding slot only.
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):
                step()
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = step()
        self.pool = graph.pool()
        copied = torch.cuda.Event()
        copied.record()
        return graph, h_in, index, host, copied, out
