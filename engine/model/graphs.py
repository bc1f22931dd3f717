"""CUDA graphs of the decode step: one captured (optionally torch.compile'd) layer stack per batch size."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .stage import Stage


class DecodeGraphs:
    """CUDA graphs of one decode step (one token per slot) per batch size, captured on first use.

    Inputs are copied into static buffers (slots and positions through pinned host memory, so the
    host never waits for the device), the graph replays the whole layer stack, and the output
    buffer is cloned out. Attention covers the whole per-slot cache (`n_ctx` rows) under a
    position mask, so one graph serves every position.
    """

    def __init__(self, stage: Stage, max_batch: int | None = None, compiled: bool = False):
        self.stage = stage
        # torch.compile fuses the many small element-wise kernels between the matrix products
        # (norms, casts, RoPE, residual adds); the graph then replays the fused kernels.
        self.forward = torch.compile(stage._forward, dynamic=False) if compiled else stage._forward
        self.max_batch = max_batch or stage.n_slots
        self.graphs: dict[int, tuple] = {}
        self.pool = None

    def reset(self) -> None:
        self.graphs.clear()

    def run(self, h: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        B = h.shape[0]
        if B > self.max_batch or len(set(slots.tolist())) != B:
            return None
        if B not in self.graphs:
            self.graphs[B] = self._capture(B)
        graph, h_in, index, host, copied, out = self.graphs[B]
        copied.synchronize()  # the previous step's copy out of `host` has finished
        host[0].copy_(slots)
        host[1].copy_(positions)
        index.copy_(host, non_blocking=True)
        copied.record()
        h_in.copy_(h)
        graph.replay()
        return out.clone()

    def _capture(self, B: int):
        st = self.stage
        dev = st.device
        h_in = torch.zeros(B, st.cfg.n_embd, device=dev)
        index = torch.stack([torch.arange(B), torch.zeros(B, dtype=torch.long)]).to(dev)  # slots, positions
        host = torch.zeros(2, B, dtype=torch.long).pin_memory()

        def step():
            return self.forward(h_in, index[0], index[1], None, batched=True, kv_len=st.n_ctx)

        # Warm up on a side stream (allocator and kernel selection), as torch's docs prescribe. The
        # warm-up really writes K/V at position 0 of slots 0..B-1: keep those rows and put them back.
        saved = [(layer.k_cache[:B, :, 0].clone(), layer.v_cache[:B, :, 0].clone()) for layer in st.layers.values()]
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):
                step()
        torch.cuda.current_stream(dev).wait_stream(side)
        for layer, (k, v) in zip(st.layers.values(), saved):
            layer.k_cache[:B, :, 0] = k
            layer.v_cache[:B, :, 0] = v
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = step()
        self.pool = graph.pool()
        copied = torch.cuda.Event()
        copied.record()
        return graph, h_in, index, host, copied, out
