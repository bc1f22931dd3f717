"""CUDA graphs of the decode step: one captured (optionally torch.compile'd) layer stack per batch bucket and run length."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .deltanet import ROLLBACK

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
    """CUDA graphs of one decode step per batch bucket and run length (tokens per slot: 1 to decode,
    k + 1 to verify a k-token draft), captured by `warm_up` or on first use.

    Inputs are copied into static buffers (slots and positions through pinned host memory, so the
    host never waits for the device), the graph replays the whole layer stack, and the output
    buffer is cloned out. Rows beyond the batch write their K/V into the stage's padding slot
    (`pad_slot`, a cache row no sequence owns) at positions 0.. of the run. The decode-attention
    kernel reads each row's length from its position on the device, so one graph serves every position.
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

    def warm_up(self, per_slot: range = range(1, 2)) -> None:
        """Compile and capture every bucket now (a worker's start), not on the first requests."""
        for m in per_slot:
            for size in self.buckets:
                if m <= ROLLBACK and (size, m) not in self.graphs:
                    self.graphs[size, m] = self._capture(size, m)

    def run(self, h: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, per_slot: int) -> torch.Tensor | None:
        """Rows slot-major, `per_slot` consecutive positions for each slot (None: not a graph's batch)."""
        R = h.shape[0]
        B = R // per_slot
        # A recurrent layer checkpoints at most ROLLBACK tokens of a run; slots must be distinct runs.
        if per_slot > ROLLBACK or B > self.buckets[-1] or len(set(slots.tolist())) != B:
            return None
        size = next(s for s in self.buckets if s >= B)
        if (size, per_slot) not in self.graphs:
            self.graphs[size, per_slot] = self._capture(size, per_slot)
        graph, h_in, index, host, padding, copied, out = self.graphs[size, per_slot]
        copied.synchronize()  # the previous step's copy out of `host` has finished
        host[0, :R].copy_(slots)
        host[1, :R].copy_(positions)
        # Rows past this batch go back to the padding slot: left as an earlier, larger batch set them,
        # they would run that batch's slots again, writing their KV (and advancing recurrent state).
        host[:, R:].copy_(padding[:, R:])
        index.copy_(host, non_blocking=True)
        copied.record()
        h_in[:R].copy_(h)
        graph.replay()
        return out[:R].clone()

    def _capture(self, size: int, per_slot: int):
        st = self.stage
        dev = st.device
        rows = size * per_slot
        h_in = torch.zeros(rows, st.cfg.n_embd, device=dev)
        host = torch.zeros(2, rows, dtype=torch.long).pin_memory()
        padding = torch.stack([torch.full((rows,), self.pad_slot), torch.arange(per_slot).repeat(size)])
        host.copy_(padding)  # rows a batch does not fill: the padding slot, at positions 0..per_slot-1
        index = host.to(dev)  # slots, positions

        def step():
            return self.forward(h_in, index[0], index[1], None, batched=True, kv_len=st.n_ctx, per_slot=per_slot)

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
        return graph, h_in, index, host, padding, copied, out
