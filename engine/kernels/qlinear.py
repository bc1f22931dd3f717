"""y = x @ w.T for a quantized weight, by device and row count."""

from __future__ import annotations

import torch

from .qweight import QuantWeight


def qlinear(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """x [..., k] -> [..., n] in x's dtype. On CPU the reference (dequantize, then matmul) for tests.
    On CUDA, up to GEMV_MAX_ROWS rows (decode, speculative verify) the fused GEMV reads the weight
    once; its multiply-adds grow with the rows, and from about 8 rows one dequantization into a
    scratch dense weight amortized over cuBLAS's tensor-core GEMM is as fast (`benchmarks/bench_qkernels.py`)."""
    x2 = x.reshape(-1, x.shape[-1])
    if x.device.type != "cuda":
        y = x2 @ w.dequantize_reference().to(x.dtype).T
    else:
        from .triton_qmatmul import GEMV_MAX_ROWS, fused_matmul

        if x2.shape[0] <= GEMV_MAX_ROWS:
            y = fused_matmul(x2, w)
        else:
            # The caching allocator hands each layer the block the previous one freed: a reused scratch.
            y = x2 @ w.dequantize(x.dtype).T
    return y.view(*x.shape[:-1], w.shape[0])
