"""The skinny tensor-core product over `QuantWeight` planes, a torch custom op: `hydra::qmma`,
y = x @ w.T for 1-QMMA_MAX_ROWS rows of x (speculative verifies of one or several slots). Each
program decodes a [BLOCK_N, BLOCK_K] tile of the weight in registers (`triton_qplanes.py`), rounds it
to x's dtype and multiplies it with x's rows on the tensor cores (`tl.dot`, fp32 accumulate): the
weight is read once for every row, where the GEMV (`triton_qmatmul.py`) pays CUDA-core work per row.
Narrow outputs split K over more programs (`split_k.py`): float32 partials summed in a fixed order,
so results are deterministic.

A tile's q bytes hold element i (low nibble) and 16 + i (high) of each 32-element tile, so the
product runs as two K-halves, dot(w_lo, x_lo) + dot(w_hi, x_hi), x loaded at the matching offsets:
the order of K inside a dot does not matter when both operands share it.

The tile is decoded a word at a time (`code_words`, `word_floats`): a tile's q as 4 int32 words (one
128-bit load), the h plane's share beside each, codes assembled four to an int32 and each made a
float by one byte permute; SASS for sm_90 (`benchmarks/gemv_sass.py --qmma`), the default tile:
Q4_K 7.35 -> 5.72 instructions per weight a thread, Q5_K 11.58 -> 6.32, Q6_K 10.43 -> 6.01
(docs/PERF.md, session 23).

Float32 x multiplies in float32 ("ieee": CUDA-core FMAs, the reference's precision); 16-bit x in
its own dtype. Custom ops are opaque to torch.compile and launch only Triton kernels and
allocations, so CUDA graphs capture them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .custom_op import kernel_op
from .qweight import QuantWeight
from .split_k import plan, reduced
from .triton_qplanes import code_words, layout_args, planes_args, scales, word_floats

# Tiles by row count rounded up to a power of two: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages,
# programs per SM that split-K aims for, SWAP). SWAP: the dot is w [BLOCK_N, ·] @ x.T, the weight's
# rows the MMA's M side (64 a warpgroup: Hopper's wgmma, its A operand in registers) and x's rows its N
# side (8 or more); else x @ w.T, BLOCK_M the M side (mma.sync, which pads it to 16). Either way Triton
# 3.9 passes the decoded tile through shared memory into the MMA's operand layout (its TTGIR). Rows
# past M are masked: BLOCK_M 8, 16 or 32.
# From `benchmarks/bench_qkernels.py --qmma --rows 1,4,8,16,32` on an H100 (session 23, docs/PERF.md): the
# 27B's Q5_K/Q6_K matrices at ~700-900 GB/s whatever the rows (the GEMV: 2,200 at one row, 570 at 16).
QMMA_CONFIGS: dict[int, tuple[int, int, int, int, int, int, bool]] = {
    1: (8, 32, 256, 4, 1, 16, False),
    2: (8, 32, 256, 4, 1, 16, False),
    4: (8, 32, 256, 4, 1, 16, False),
    8: (8, 32, 256, 4, 1, 16, False),
    16: (16, 64, 128, 4, 1, 16, True),
    32: (32, 64, 128, 4, 1, 16, True),
}
QMMA_MAX_ROWS = max(QMMA_CONFIGS)


@triton.jit
def _w_half(q_lo, q_hi, d_lo, d_hi, m, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, dt: tl.constexpr):
    """The decoded tile's halves [BLOCK_N, BLOCK_K // 2] in dtype dt, as quant.dequantize computes
    them: (d * sc) * (u - offset) + m."""
    w_lo = tl.reshape(d_lo * q_lo + m, [BLOCK_N, BLOCK_K // 2]).to(dt)
    w_hi = tl.reshape(d_hi * q_hi + m, [BLOCK_N, BLOCK_K // 2]).to(dt)
    return w_lo, w_hi


@triton.jit
def _qmma_kernel(
    x_ptr,
    q_ptr,
    h_ptr,
    d_ptr,
    sc_ptr,
    m_ptr,
    out_ptr,
    M,
    N,
    K,
    x_stride,
    q_stride,
    h_stride,
    d_stride,
    s_stride,
    k_split,
    BITS: tl.constexpr,
    OFFSET: tl.constexpr,
    SB: tl.constexpr,
    G: tl.constexpr,
    HAS_M: tl.constexpr,
    HAS_MN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SWAP: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    ASM: tl.constexpr,
):
    """y [M, N] (or split-K partial sums [splits, M, N]) of program_id(1)'s k_split elements of K."""
    T: tl.constexpr = BLOCK_K // 32  # 32-element tiles a step
    n0 = tl.program_id(0) * BLOCK_N
    rows = n0 + tl.arange(0, BLOCK_N)[:, None, None]  # [weight row, tile, byte of the tile]
    r_ok = rows < N
    r = rows.to(tl.int64)
    t = tl.arange(0, T)[None, :, None]
    # The same frame with a tile as 4 int32 words of q: [weight row, tile, 1, word] (`code_words`).
    r4 = tl.reshape(r, [BLOCK_N, 1, 1, 1])
    r_ok4 = tl.reshape(r_ok, [BLOCK_N, 1, 1, 1])
    t4 = tl.arange(0, T)[None, :, None, None]
    j4 = tl.arange(0, 4)[None, None, None, :]
    # x's rows at the weight's K order: column j of a half is element 32 * (j // 16) + j % 16 (+ 16: hi).
    xm = tl.arange(0, BLOCK_M)[:, None]
    j = tl.arange(0, BLOCK_K // 2)[None, :]
    x_col = tl.max_contiguous(tl.multiple_of((j // 16) * 32 + j % 16, [1, 16]), [1, 16])  # 16-element runs
    x_at = x_ptr + xm * x_stride + x_col
    dt = x_ptr.dtype.element_ty
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    start = tl.program_id(1) * (k_split // 2)  # in bytes of q
    end = tl.minimum(start + k_split // 2, K // 2)
    for b0 in range(start, end, BLOCK_K // 2):
        k_lo = 2 * b0 + t * 32
        ok = r_ok & (k_lo < K)
        # Each tile's 16 bytes are 4 int32 words, provably contiguous and aligned: one 128-bit load.
        w = tl.max_contiguous(tl.multiple_of(b0 // 4 + t4 * 4 + j4, [1, 4, 1, 4]), [1, 1, 1, 4])
        lo, hi = code_words(q_ptr, h_ptr, r4, r_ok4 & (2 * b0 + t4 * 32 < K), w, q_stride, h_stride, BITS, BLOCK_N, T)
        q_lo = word_floats(lo, OFFSET, ASM)
        q_hi = word_floats(hi, OFFSET, ASM)
        d_lo, d_hi, m = scales(d_ptr, sc_ptr, m_ptr, r, ok, k_lo, d_stride, s_stride, SB, G, HAS_M, HAS_MN)
        w_lo, w_hi = _w_half(q_lo, q_hi, d_lo, d_hi, m, BLOCK_N, BLOCK_K, dt)
        x_ok = (xm < M) & (2 * b0 + x_col < K)
        x_lo = tl.load(x_at + 2 * b0, mask=x_ok, other=0.0)
        x_hi = tl.load(x_at + 2 * b0 + 16, mask=x_ok, other=0.0)
        if UPCAST:  # the same products (16-bit ones are exact in float32), for Triton's interpreter
            w_lo, w_hi, x_lo, x_hi = w_lo.to(tl.float32), w_hi.to(tl.float32), x_lo.to(tl.float32), x_hi.to(tl.float32)
        if SWAP:
            acc = tl.dot(w_lo, tl.trans(x_lo), acc, input_precision=PRECISION)
            acc = tl.dot(w_hi, tl.trans(x_hi), acc, input_precision=PRECISION)
        else:
            acc = tl.dot(x_lo, tl.trans(w_lo), acc, input_precision=PRECISION)
            acc = tl.dot(x_hi, tl.trans(w_hi), acc, input_precision=PRECISION)
    base = out_ptr + tl.program_id(1) * M * N
    if SWAP:
        n_at = n0 + tl.arange(0, BLOCK_N)[:, None]
        m_at = tl.arange(0, BLOCK_M)[None, :]
    else:
        m_at = tl.arange(0, BLOCK_M)[:, None]
        n_at = n0 + tl.arange(0, BLOCK_N)[None, :]
    tl.store(base + m_at * N + n_at, acc.to(out_ptr.dtype.element_ty), mask=(m_at < M) & (n_at < N))


def qmma_launch(x: torch.Tensor, planes: tuple, config: tuple) -> torch.Tensor:
    """x [M, K] (contiguous) @ w.T with one configuration of QMMA_CONFIGS' shape (the benchmark's sweep)."""
    q, h, d, sc, m, qtype = planes
    rows, k = x.shape
    n = q.shape[0]
    block_m, block_n, block_k, warps, stages, per_sm, swap = config
    if rows > block_m:
        raise ValueError(f"the tensor-core GEMM takes up to {block_m} rows in this configuration, got {rows}")
    ptrs, strides, consts = layout_args(qtype, q, h, d, sc, m)
    grid, k_split, out = plan(rows, n, k, block_n, block_k, per_sm, x.dtype, x.device)
    _qmma_kernel[grid](
        x,
        *ptrs,
        out,
        rows,
        n,
        k,
        x.stride(0),
        *strides,
        k_split,
        **consts,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        SWAP=swap,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # 16-bit x: the option is not read
        # On CPU tensors (tests, TRITON_INTERPRET=1): the interpreter's tl.dot multiplies bfloat16's
        # bit patterns as integers (triton-lang/triton#11584), so its operands go to float32 first.
        UPCAST=x.device.type != "cuda",
        ASM=x.device.type == "cuda",  # the interpreter runs no inline assembly
        num_warps=warps,
        num_stages=stages,
    )
    return reduced(out, x.dtype)


@kernel_op("hydra::qmma")
def qmma(
    x: torch.Tensor,
    q: torch.Tensor,
    h: torch.Tensor | None,
    d: torch.Tensor,
    sc: torch.Tensor | None,
    m: torch.Tensor | None,
    qtype: int,
) -> torch.Tensor:
    """x [M, K] @ w.T -> [M, N] in x's dtype, for M up to QMMA_MAX_ROWS."""
    rows = x.shape[0]
    if rows == 0:
        return x.new_empty(0, q.shape[0])
    mr = triton.next_power_of_2(rows)
    if mr not in QMMA_CONFIGS:
        raise ValueError(f"the tensor-core GEMM takes 1..{QMMA_MAX_ROWS} rows, got {rows}")
    return qmma_launch(x.contiguous(), (q, h, d, sc, m, qtype), QMMA_CONFIGS[mr])


@qmma.register_fake
def _(x, q, h, d, sc, m, qtype):
    return x.new_empty(x.shape[0], q.shape[0])


def tensor_core_matmul(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """x [M, K] @ w.T, M <= QMMA_MAX_ROWS, with the weight decoded in registers for the tensor cores."""
    return qmma(x, *planes_args(w))
