"""What a model does with a quantized weight, each by device: y = x @ w.T (`qlinear`, also by row
count), the dense weight (`dense`), the embedding lookup (`embed_rows`). On a GPU the Triton kernels
(triton_qmatmul.py, triton_qdequant.py, imported there only: a CPU install may lack Triton), elsewhere QuantWeight's torch
reference."""

from __future__ import annotations

import torch

from ...contracts.footprint import SCRATCH_ELEMENTS, block_rows  # the memory estimate counts the same blocks
from .qweight import QuantWeight


class DequantScratch:
    """One stage's dense buffer for the prefill's dequantized weights, shared by all its layers and
    held for the stage's life (CUDA graphs keep its address). Left to the caching allocator, each
    weight's dense copy was a block of its own size, and the eager passes and the graphs' pool each
    kept their own. Sized by `fit` to the largest block registered (`block_rows`): a weight up to
    SCRATCH_ELEMENTS whole, a larger one a block of rows at a time."""

    def __init__(self):
        self.need = 0
        self.buf: torch.Tensor | None = None

    def register(self, w: QuantWeight) -> None:
        n, k = w.shape
        self.need = max(self.need, block_rows(n, k, SCRATCH_ELEMENTS) * k)

    def fit(self, dtype: torch.dtype, device: torch.device) -> None:
        """(Re)allocate for the weights registered so far (on CUDA): before any graph is captured,
        or after they are all dropped (a re-split), since a graph keeps writing to the old address."""
        size = self.need
        if device.type == "cuda" and size and (self.buf is None or self.buf.numel() < size or self.buf.dtype != dtype):
            self.buf = None  # the old buffer goes back before the new one is taken
            # The load's temporaries (repack slices, joined parts) left cached segments; carved out of
            # one, the scratch kept the rest of it reserved (0.26 GB of a 390 MB segment, 26B-wide head).
            torch.cuda.empty_cache()
            self.buf = torch.empty(size, dtype=dtype, device=device)


# Up to this many rows the quantized kernels run (the GEMV GEMV_MAX_ROWS rows a pass, or the
# tensor-core GEMM from QMMA_MIN_ROWS): each pass reads the quantized weight (~5.5 bits a weight for
# Q5_K), where the scratch path reads it, writes and reads it again as bf16 (~37 bits). A 4-stream
# MTP verify (16 rows) through the scratch ran slower than plain decode (H200, session 20: 212 against
# 296 tok/s).
GEMV_CHUNKED_ROWS = 32
# From this many rows up to GEMV_CHUNKED_ROWS the tensor-core GEMM (triton_qmma.py) runs instead of
# the GEMV, reading the weight once for all rows: `benchmarks/bench_qkernels.py --qmma` on an H100
# (session 23), the 27B's matrices: 16 rows 2.82x a one-row step against the two GEMV passes' 4.01x,
# 32 rows 3.00x against 7.86x; at 4 and 8 rows the GEMV wins (1.35x, 2.04x against 2.65x, 2.72x).
# 9-15 rows take qmma's 16-row tile (the same work: 2.82x) where the GEMV's passes cost 3.05x (8 + 1
# rows) and more: from 9, an inference from those rows, not a row count the sweep timed.
QMMA_MIN_ROWS = 9


def qlinear(x: torch.Tensor, w: QuantWeight, scratch: DequantScratch | None = None) -> torch.Tensor:
    """x [..., k] -> [..., n] in x's dtype. On CPU the reference (dequantize, then matmul) for tests.
    On CUDA `kernel_matmul`."""
    x2 = x.reshape(-1, x.shape[-1])
    y = x2 @ w.dequantize_reference().to(x.dtype).T if x.device.type != "cuda" else kernel_matmul(x2, w, scratch)
    return y.view(*x.shape[:-1], w.shape[0])


def kernel_matmul(x2: torch.Tensor, w: QuantWeight, scratch: DequantScratch | None = None) -> torch.Tensor:
    """x2 [M, k] @ w.T by the Triton kernels (CUDA, or CPU tensors under Triton's interpreter): up to
    GEMV_MAX_ROWS rows (decode, speculative verify) the fused GEMV reads the weight once; from
    QMMA_MIN_ROWS the tensor-core GEMM, and else up to GEMV_CHUNKED_ROWS (verifies of several slots)
    the GEMV over GEMV_MAX_ROWS rows at a time; beyond (prompts), one dequantization into a scratch
    dense weight amortized over cuBLAS's tensor-core GEMM."""
    from .triton_qmatmul import fused_matmul
    from .triton_qmma import tensor_core_matmul

    rows = x2.shape[0]
    if rows > GEMV_CHUNKED_ROWS:
        return _dequant_matmul(x2, w, scratch)
    # e.g. a 4-slot verify of 3 drafts: 16 rows, one tensor-core pass
    return tensor_core_matmul(x2, w) if rows >= QMMA_MIN_ROWS else fused_matmul(x2, w)


def dense(w: QuantWeight, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """Dense [n, k], written into `out` (a scratch of that shape) when given."""
    if w.device.type != "cuda":
        return w.dequantize(dtype, out)
    from .triton_qdequant import kernel_dequantize

    return kernel_dequantize(w, dtype, out)


def embed_rows(w: QuantWeight, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dequantized rows [*ids.shape, k], touching only those rows. Ids on a GPU read the planes where
    they are, on that GPU or pinned on the host (`QuantWeight.from_gguf(pinned=)`)."""
    if ids.device.type != "cuda":
        return w.rows(ids, dtype)
    from .triton_qdequant import kernel_rows

    return kernel_rows(w, ids, dtype).view(*ids.shape, w.shape[1])


def _dequant_matmul(x2: torch.Tensor, w: QuantWeight, scratch: DequantScratch | None) -> torch.Tensor:
    n, k = w.shape
    buf = scratch.buf if scratch is not None else None
    if buf is None or buf.dtype != x2.dtype or buf.numel() < k:
        return x2 @ dense(w, x2.dtype).T
    step = block_rows(n, k, buf.numel())
    if step == n:
        return x2 @ dense(w, x2.dtype, buf[: n * k].view(n, k)).T
    y = x2.new_empty(x2.shape[0], n)
    for a in range(0, n, step):
        b = min(n, a + step)
        # Straight into y's columns (cuBLAS takes the row stride): no block-sized temporary.
        torch.mm(x2, dense(w.row_block(a, b), x2.dtype, buf[: (b - a) * k].view(b - a, k)).T, out=y[:, a:b])
    return y
