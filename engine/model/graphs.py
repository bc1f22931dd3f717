"""CUDA graphs of a stage's layer stack: the decode step per batch bucket and run length (optionally
torch.compile'd), a prompt's prefill from position 0 per length bucket, a recurrent stage's short
mixed steps per token bucket, and the output head per row bucket.

Eager, a layer costs dozens of kernel launches and torch ops on the host; a prefill of a few hundred
tokens on a large GPU then waits on the host (7.2B Q4_K_M, 512 tokens on an H200: 61 ms wall for
~16 ms of kernels). Replayed from a graph, the host's part is one launch."""

from __future__ import annotations

import functools
import gc
import itertools
from typing import TYPE_CHECKING, Protocol

import torch

from ...contracts.footprint import PACKED_RUNS, PACKED_TOKENS
from .deltanet import ROLLBACK
from .forward_batch import ForwardBatch, Run, RunTensors
from .layer import block

if TYPE_CHECKING:
    from .config import ModelConfig
    from .deltanet import DeltaNet
    from .kv_blocks import KVBlocks


class Stage(Protocol):
    """What the graphs read of the stage whose layers and head they capture (`stage.Stage`)."""

    cfg: ModelConfig
    device: torch.device
    n_slots: int
    n_ctx: int
    kv_blocks: KVBlocks
    recurrent: list[DeltaNet]

    def forward(self, h: torch.Tensor, batch: ForwardBatch, layers=None, block=block) -> torch.Tensor: ...

    def final_norm(self, h: torch.Tensor) -> torch.Tensor: ...

    def project(self, x: torch.Tensor) -> torch.Tensor: ...


def batch_buckets(max_batch: int) -> list[int]:
    """Batch sizes that get a graph: powers of two below `max_batch`, and `max_batch` itself. A batch
    runs in the smallest bucket that holds it: at most ~2x padded rows, few compiles and captures."""
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return sizes + [max_batch]


def graph_run_lengths(max_run: int) -> tuple[int, ...]:
    """Tokens per slot whose decode steps get graphs when the longest step runs `max_run` (a verify of
    draft max + 1): a plain decode (1) and the longest verify only. A shorter draft's verify is padded
    up to that length (`Speculator.verify_lengths`): on a GPU a verify's few rows cost about what a
    longer one does (its products read each weight once), and every other run length would be
    another compile per batch bucket and layer kind and another capture (docs/PERF.md, session 22).
    Past ROLLBACK tokens a recurrent layer cannot checkpoint a run: such verifies run eagerly."""
    return (1,) if max_run <= 1 else (1, min(max_run, ROLLBACK))


class DecodeGraphs:
    """CUDA graphs of one decode step per batch bucket and run length (tokens per slot: 1 to decode,
    k + 1 to verify a k-token draft), captured by `warm_up` or on first use.

    Inputs are copied into static buffers (slots and positions through pinned host memory, so the
    host never waits for the device), the graph replays the whole layer stack, and the output
    buffer is cloned out. Rows beyond the batch write their K/V into the stage's padding slot
    (`KVBlocks.pad_slot`, which no sequence owns) at positions n_ctx.. of the run. The decode-attention
    kernel reads each row's length from its position on the device, so one graph serves every position.
    """

    def __init__(self, stage: Stage, compiled: bool = False):
        self.stage = stage
        # torch.compile fuses the many small element-wise kernels between the matrix products
        # (norms, casts, RoPE, residual adds); the graph then replays the fused kernels. One static
        # compile per bucket: dynamic batch rows (torch's automatic dynamic) started 35 % faster
        # cold but served 30-35 % slower, and a warm restart took as long (docs/PERF.md, session 9).
        # One layer is the compiled region, not the stack: every layer of a kind reuses its trace,
        # so a bucket costs one layer's dynamo trace even when inductor's cache has the kernels (a
        # restart traced the whole stack per bucket: 2.5 s each for the 1.1B's 16 layers).
        self.buckets = batch_buckets(stage.n_slots)
        self.forward = stage.forward
        if compiled:
            # Entries per region: a bucket x a run length x a layer kind (global, windowed, recurrent).
            limit = len(self.buckets) * ROLLBACK * 3
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)
            self.forward = functools.partial(stage.forward, block=torch.compile(block, dynamic=False))
        self.graphs: dict[int, tuple] = {}
        self.pool = None

    def reset(self) -> None:
        self.graphs.clear()

    def warm_up(self, per_slot=(1,)) -> None:
        """Compile and capture every bucket for each run length in `per_slot` now (a worker's start),
        not on the first requests."""
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
        graph, h_in, index, out = self.graphs[size, per_slot]
        index.set(slots, positions)
        h_in[:R].copy_(h)
        graph.replay()
        return out[:R].clone()

    def capture(self, step):
        """Capture `step()` in the memory pool every graph of this stage shares (prefill and head too)."""
        graph, out = capture(step, self.stage.device, self.pool)
        self.pool = graph.pool()
        return graph, out

    def _capture(self, size: int, per_slot: int):
        st = self.stage
        dev = st.device
        rows = size * per_slot
        h_in = torch.zeros(rows, st.cfg.n_embd, device=dev)
        n_ctx = st.n_ctx
        index = GraphIndex(
            torch.stack([torch.full((rows,), st.kv_blocks.pad_slot), n_ctx + torch.arange(per_slot).repeat(size)]), dev
        )
        batch = ForwardBatch.batched(index.device[0], index.device[1], per_slot, kv_len=n_ctx)

        def step():
            return self.forward(h_in, batch)

        # Every row of the warm-up runs writes K/V into the padding slot only.
        graph, out = self.capture(step)
        return graph, h_in, index, out


class GraphIndex:
    """A graph's long inputs on the device (`device`, what the graph reads: its rows' slots and
    positions), set from the host through page-locked memory so the host never waits for the device's
    queue. `padding` [k, width]: what the columns a batch does not fill hold (the stage's padding
    slot, past the context). On CPU (tests: `PackedGraphs` over a stand-in capture) a plain copy."""

    def __init__(self, padding: torch.Tensor, device: torch.device):
        self.padding = padding
        cuda = device.type == "cuda"
        self.host = padding.clone().pin_memory() if cuda else padding.clone()
        self.device = self.host.to(device, copy=True)
        self.copied = torch.cuda.Event() if cuda else None
        if cuda:
            self.copied.record()

    def set(self, *rows) -> None:
        """Row i of `rows` into the first columns of row i; the columns past them back to `padding`."""
        R = len(rows[0])
        if self.copied is not None:
            self.copied.synchronize()  # the previous set's copy out of `host` has finished
        for i, values in enumerate(rows):
            self.host[i, :R].copy_(torch.as_tensor(values))
        # Rows past this batch go back to the padding slot: left as an earlier, larger batch set them,
        # they would run that batch's slots again, writing their KV (and advancing recurrent state).
        self.host[:, R:].copy_(self.padding[:, R:])
        self.device.copy_(self.host, non_blocking=True)
        if self.copied is not None:
            self.copied.record()


@functools.cache
def _capture_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per device for every capture and its warm-up: cuBLAS keeps a workspace
    (CUBLAS_WORKSPACE_BYTES) per stream it has run on, taken from the caching allocator for the
    process's life. A new stream per capture (dozens of buckets) held one each; a warm-up stream
    apart from torch's capture stream held two, the second in the graphs' pool."""
    return torch.cuda.Stream(device)


def capture(step, device: torch.device, pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Capture `step()` into a graph that allocates from `pool` (None: a new one). Warmed up on the
    same side stream first (allocator, kernel selection, compilation), as torch's docs prescribe."""
    side = _capture_stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # A collection inside the capture could destroy an earlier stage's graphs or events: CUDA calls
    # that invalidate a capture in progress (seen once as cudaErrorStreamCaptureInvalidated in tests).
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool, stream=side):
            out = step()
    finally:
        if collecting:
            gc.enable()
    torch.cuda.current_stream(device).wait_stream(side)
    return graph, out


def prefill_buckets(n_ctx: int, smallest: int = 8) -> list[int]:
    """Prompt lengths that get a prefill graph: powers of two from `smallest` up to the context. A
    prompt runs in the smallest bucket that holds it; the rows past it are padding."""
    sizes, b = [], smallest
    while b <= n_ctx:
        sizes.append(b)
        b *= 2
    return sizes


class PrefillGraphs:
    """CUDA graphs of one slot's prompt run from position 0 (a new prompt, or a prompt's first chunk),
    per length bucket, captured by `warm_up` (at a worker's start: it writes slot 0) or on first use
    (in the slot the prompt is for), in the decode graphs' memory pool.

    Positions are always 0..P-1, so RoPE, the causal mask and the KV rows a graph writes are fixed;
    only the hidden states and the slot change. The rows past the prompt are padding: causal
    attention keeps them out of the prompt's rows, and the K/V they write lands past the slot's
    length, where the next run overwrites it. Only a stage whose slots reserve their whole context
    (padding rows must have somewhere to write) and that holds no recurrent layer takes this path.
    """

    def __init__(self, stage: Stage, decode: DecodeGraphs):
        self.stage, self.decode = stage, decode
        self.buckets = prefill_buckets(stage.n_ctx, smallest=ROLLBACK * 2)
        self.graphs: dict[int, tuple] = {}

    def reset(self) -> None:
        self.graphs.clear()

    def usable(self) -> bool:
        st = self.stage
        return bool(self.buckets) and not st.kv_blocks.pooled and not st.recurrent

    def warm_up(self, max_tokens: int) -> None:
        """Capture every bucket a prompt chunk of up to `max_tokens` runs in."""
        if not self.usable():
            return
        for size in self.buckets:
            if size not in self.graphs:
                self.graphs[size] = self._capture(size, slot=0)
            if size >= max_tokens:
                break

    def run(self, h: torch.Tensor, runs: list[Run]) -> torch.Tensor | None:
        """Rows 0..T-1 of one run's slot (None: not one run from position 0, or no bucket holds T)."""
        T = h.shape[0]
        size = next((s for s in self.buckets if s >= T), None)
        if size is None or len(runs) != 1 or runs[0][1] != 0 or not self.usable():
            return None
        slot = runs[0][0]
        if size not in self.graphs:
            self.graphs[size] = self._capture(size, slot)
        graph, h_in, slots, _, out = self.graphs[size]
        slots.fill_(slot)
        h_in[:T].copy_(h)
        graph.replay()
        return out[:T].clone()

    def _capture(self, size: int, slot: int):
        """Capturing writes positions 0..size-1 of `slot`: a slot whose content is about to be
        replaced (the padding slot has only ROLLBACK positions)."""
        st = self.stage
        dev = st.device
        h_in = torch.zeros(size, st.cfg.n_embd, device=dev)
        slots = torch.full((size,), slot, device=dev)
        positions = torch.arange(size, device=dev)
        batch = ForwardBatch.fresh(slots, positions)
        graph, out = self.decode.capture(lambda: st.forward(h_in, batch))
        return graph, h_in, slots, positions, out  # the graph reads its inputs where they are: keep them


# A recurrent stage's steps a packed graph takes: up to PACKED_RUNS runs of PACKED_TOKENS tokens in all
# (contracts/footprint.py: their buffers are what the graphs' pool holds; longer steps run eagerly,
# where the kernels are most of a step's time anyway), whose rows see at most PACKED_ATTENTION
# positions in all (the decode-attention kernel reads each row's context on its own: 128 tokens
# after 384 positions, or 32 after 2,000).
PACKED_ATTENTION = 1 << 16


def packed_input(runs: list[Run], size: int, n_runs: int, pad_slot: int, n_ctx: int) -> list[int]:
    """What a packed graph of `size` rows and `n_runs` runs reads for `runs` (their tokens its first
    rows): each row's slot and position, then each run's slot, length and first row. The rows past the
    runs are on the padding slot at positions past the context (ROLLBACK of them, in turn) and in no
    run (a recurrent layer's output there is zeros); the runs past `runs` are empty, on the padding
    slot too."""
    T = sum(n for _, _, n in runs)
    slots = [slot for slot, _, n in runs for _ in range(n)] + [pad_slot] * (size - T)
    positions = [p for _, p0, n in runs for p in range(p0, p0 + n)] + [n_ctx + i % ROLLBACK for i in range(size - T)]
    empty = n_runs - len(runs)
    run_slots = [slot for slot, _, _ in runs] + [pad_slot] * empty
    lengths = [n for _, _, n in runs] + [0] * empty
    starts = list(itertools.accumulate(lengths, initial=0))[: len(runs)] + [T] * empty
    return slots + positions + run_slots + lengths + starts


def packed_batch(index: torch.Tensor, size: int, n_runs: int, n_ctx: int) -> ForwardBatch:
    """The PACKED batch over a graph's input on the device (`packed_input`'s layout)."""
    rows, runs = index[: 2 * size].view(2, size), index[2 * size :].view(3, n_runs)
    return ForwardBatch.packed(rows[0], rows[1], RunTensors(*runs), max_run=size, kv_len=n_ctx)


class PackedGraphs:
    """CUDA graphs of a recurrent stage's short steps that no decode graph takes: prompts (several
    slots' together, from any position), a prompt beside decoding slots, verifies of uneven lengths;
    per token bucket, captured by `warm_up` or on first use, in the decode graphs' memory pool.

    Eagerly such a step launches ~50 kernels a layer and waits on the host (the 27B's 32-token prompt
    on an H100: 88 ms for 35 ms of kernels; replayed, 51 ms: docs/PERF.md, session 28). Its batch here is PACKED, the runs on the
    device only: every recurrent layer takes the chunked kernels for each run (`DeltaNet._prefill`)
    and every attention row the decode-attention kernel, so one graph serves any runs within its
    bucket. The rows past the runs are on the padding slot (K/V past the context, where a row attends
    to itself only) and in no run; the runs past the step's are empty ones on the padding slot (its
    own recurrent state row), which the kernels skip."""

    def __init__(self, stage: Stage, decode: DecodeGraphs):
        self.stage, self.decode = stage, decode
        self.buckets = prefill_buckets(min(stage.n_ctx, PACKED_TOKENS), smallest=ROLLBACK * 4)
        self.n_runs = min(stage.n_slots, PACKED_RUNS)
        self.graphs: dict[int, tuple] = {}

    def reset(self) -> None:
        self.graphs.clear()

    def usable(self) -> bool:
        return bool(self.buckets) and bool(self.stage.recurrent)

    def warm_up(self, max_tokens: int) -> None:
        """Capture every bucket a step of up to `max_tokens` runs in."""
        if not self.usable():
            return
        for size in self.buckets:
            if size not in self.graphs:
                self.graphs[size] = self._capture(size)
            if size >= max_tokens:
                break

    def run(self, h: torch.Tensor, runs: list[Run]) -> torch.Tensor | None:
        """The rows h [T, n_embd] of `runs` (None: not a packed graph's step)."""
        T = h.shape[0]
        size = next((s for s in self.buckets if s >= T), None)
        seen = sum(n * (p0 + n) for _, p0, n in runs)  # at least the (row, visible position) pairs
        if size is None or len(runs) > self.n_runs or seen > PACKED_ATTENTION or not self.usable():
            return None
        if size not in self.graphs:
            self.graphs[size] = self._capture(size)
        graph, h_in, index, out = self.graphs[size]
        st = self.stage
        index.set(packed_input(runs, size, self.n_runs, st.kv_blocks.pad_slot, st.n_ctx))
        h_in[:T].copy_(h)
        h_in[T:].zero_()
        graph.replay()
        return out[:T].clone()

    def _capture(self, size: int):
        """Captured with every row and run on the padding slot: nothing a slot holds is written."""
        st = self.stage
        h_in = torch.zeros(size, st.cfg.n_embd, device=st.device)
        idle = packed_input([], size, self.n_runs, st.kv_blocks.pad_slot, st.n_ctx)
        index = GraphIndex(torch.tensor([idle]), st.device)
        # The batch is made in the step: its runs' conv windows (`RunTensors.window_steps`) are then
        # computed inside the capture, from what the graph reads, not kept from the warm-up's pass.
        graph, out = self.decode.capture(
            lambda: st.forward(h_in, packed_batch(index.device[0], size, self.n_runs, st.n_ctx))
        )
        return graph, h_in, index, out


class HeadGraphs:
    """CUDA graphs of the output head (final norm, projection, soft-cap) per row bucket, in the decode
    graphs' memory pool: a decode step's logits in one launch where eagerly they take a handful
    (with the layers in their graph, about a tenth of a single stream's host time per token). Each
    bucket keeps its float32 logits: ~2 x slots x vocab x 4 bytes in all (Gemma 3's 262k
    vocabulary at 64 slots: 133 MB; at one slot, 1 MB)."""

    def __init__(self, stage: Stage, decode: DecodeGraphs):
        self.stage, self.decode = stage, decode
        self.buckets = batch_buckets(stage.n_slots)
        self.graphs: dict[int, tuple] = {}

    def warm_up(self) -> None:
        for size in self.buckets:
            if size not in self.graphs:
                self.graphs[size] = self._capture(size)

    def run(self, h: torch.Tensor) -> torch.Tensor | None:
        """Logits of rows h [R, n_embd] (None: more rows than a bucket holds)."""
        R = h.shape[0]
        size = next((s for s in self.buckets if s >= R), None)
        if size is None:
            return None
        if size not in self.graphs:
            self.graphs[size] = self._capture(size)
        graph, h_in, out = self.graphs[size]
        h_in[:R].copy_(h)
        graph.replay()
        return out[:R].clone()

    def _capture(self, size: int):
        st = self.stage
        h_in = torch.zeros(size, st.cfg.n_embd, device=st.device)
        graph, out = self.decode.capture(lambda: st.project(st.final_norm(h_in)))
        return graph, h_in, out
