"""`hydra::dmm`: y = x @ w.T for 1 to DENSE_GEMV_MAX_ROWS rows of x and a dense 16-bit w [N, K]
(decode on F16/BF16 models), a Triton GEMV on CUDA cores.

cuBLAS leaves bandwidth unused on decode's smaller shapes (1.1B llama, H100: 2048 x 2048 in 6.6 us,
1.27 TB/s; here 5.3 us). Each program reads BLOCK_N whole rows in BLOCK_K steps of 16-byte vectors;
narrow outputs split K over more programs (`split_k.plan`), their float32 partials summed in a fixed
order (`reduced`): the result is deterministic, as a split must equal solo bit for bit. From 4 rows on,
cuBLAS was as fast or faster on most shapes and keeps them (`benchmarks/bench_dense_gemv.py`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .custom_op import kernel_op
from .split_k import plan, reduced

# By row count rounded up to a power of two: (BLOCK_N, BLOCK_K, num_warps, programs per SM that
# split-K aims for). Chosen by `benchmarks/bench_dense_gemv.py --sweep` (docs/PERF.md, session 15).
# At 4 and 8 rows cuBLAS was faster on every shape but two (H100, 1.1B's matrices): it keeps them.
DENSE_GEMV_CONFIGS: dict[int, tuple[int, int, int, int]] = {
    1: (2, 2048, 8, 4),
    2: (2, 1024, 4, 2),
}
DENSE_GEMV_MAX_ROWS = max(DENSE_GEMV_CONFIGS)
_VEC = 8  # 16-bit elements in one 16-byte load


@triton.jit
def _dense_gemv_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    M,
    N,
    K,
    x_stride,
    w_stride,
    k_split,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    MR: tl.constexpr,
    VEC: tl.constexpr,
):
    """y [M, N] (or split-K partials [splits, M, N]) of program_id(1)'s k_split elements of K."""
    # Axes [weight row, vector, x row, element of a vector]: a thread holds whole vectors, x's rows
    # stay in its registers, and products are summed within the thread until the final reduction.
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)[:, None, None, None]
    r_ok = rows < N
    w_row = w_ptr + rows.to(tl.int64) * w_stride
    v = tl.arange(0, BLOCK_K // VEC)[None, :, None, None]
    x_row = tl.arange(0, MR)[None, None, :, None]
    i = tl.arange(0, VEC)[None, None, None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_K // VEC, MR], tl.float32)
    start = tl.program_id(1) * k_split
    k0 = start
    while k0 < start + k_split:  # a runtime trip count: one compile for every K
        k = tl.max_contiguous(tl.multiple_of(k0 + v * VEC + i, [1, VEC, 1, VEC]), [1, 1, 1, VEC])
        k_ok = k < K
        w = tl.load(w_row + k, mask=r_ok & k_ok, other=0.0, eviction_policy="evict_first")
        x = tl.load(x_ptr + x_row * x_stride + k, mask=(x_row < M) & k_ok, other=0.0)
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32), axis=3)
        k0 += BLOCK_K
    y = tl.sum(acc, axis=1)  # [BLOCK_N, MR]
    rows2 = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]
    x_row2 = tl.arange(0, MR)[None, :]
    out = out_ptr + tl.program_id(1) * M * N + x_row2 * N + rows2
    tl.store(out, y.to(out_ptr.dtype.element_ty), mask=(rows2 < N) & (x_row2 < M))


def dense_gemv(x: torch.Tensor, w: torch.Tensor, config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] @ w.T -> [M, N] in x's dtype; `config` overrides DENSE_GEMV_CONFIGS (the benchmark's sweep)."""
    rows, k = x.shape
    n = w.shape[0]
    if rows == 0:
        return x.new_empty(0, n)
    mr = triton.next_power_of_2(rows)
    if config is None:
        if mr not in DENSE_GEMV_CONFIGS:
            raise ValueError(f"the dense GEMV takes 1..{DENSE_GEMV_MAX_ROWS} rows, got {rows}")
        config = DENSE_GEMV_CONFIGS[mr]
    block_n, block_k, warps, per_sm = config
    x = x.contiguous()
    grid, k_split, out = plan(rows, n, k, block_n, block_k, per_sm, x.dtype, x.device)
    _dense_gemv_kernel[grid](
        x,
        w,
        out,
        rows,
        n,
        k,
        x.stride(0),
        w.stride(0),
        k_split,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        MR=mr,
        VEC=_VEC,
        num_warps=warps,
    )
    return reduced(out, x.dtype)


@kernel_op("hydra::dmm")
def dmm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`dense_gemv` as an op torch.compile keeps whole (and CUDA graphs capture: Triton launches only)."""
    return dense_gemv(x, w)


@dmm.register_fake
def _(x, w):
    return x.new_empty(x.shape[0], w.shape[0])
