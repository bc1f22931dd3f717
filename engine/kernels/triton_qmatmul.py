"""The fused GEMV over `QuantWeight` planes, a torch custom op: `hydra::qmm`, y = x @ w.T for
1-GEMV_MAX_ROWS rows of x (decode, speculative verify), on CUDA cores with w decoded in registers
(`triton_qplanes.py`), each weight read once and used for every row, fp32 accumulate. Per
`GEMV_CONFIGS` 16-bit x is first quantized per 32 to one or two int8 terms (`quantize_x`), and codes
meet x four bytes at a time in dp4a (integer dot products, as llama.cpp's mmvq); else (and for
float32 x) the codes become floats and meet x in fused multiply-adds. A dequant-in-tile tensor-core
GEMM was measured 3-6x slower than scratch + cuBLAS at 512 rows and no faster at 8-16 (see the
benchmark), so prefill dequantizes into scratch for cuBLAS instead (`triton_qdequant.py`); its retry
for verify batches of up to 32 rows is `triton_qmma.py`.
Narrow outputs split K over more programs; their float32 partials are summed in a fixed order,
so results are deterministic (a GPU split must equal solo bit for bit).

Custom ops are opaque to torch.compile (fullgraph stays whole) and launch only Triton kernels
and allocations, so CUDA graphs capture them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .custom_op import kernel_op
from .qweight import QuantWeight
from .split_k import plan, reduced
from .triton_qplanes import code_words, codes, layout_args, planes_args, scales

# GEMV tiles by row count rounded up to a power of two: (BLOCK_N, BLOCK_K, num_warps, programs per SM
# that split-K aims for, x terms: 16-bit x as that many int8 terms per tile for dp4a (0: float x; one
# term rounds x to ~8 bits, as llama.cpp's q8_1 activations; two to ~15).
# Chosen on an H200 by `benchmarks/bench_qkernels.py --sweep` (docs/PERF.md, session 8).
GEMV_CONFIGS: dict[int, tuple[int, int, int, int, int]] = {
    1: (2, 2048, 4, 8, 1),
    2: (2, 2048, 4, 8, 1),
    4: (2, 2048, 4, 8, 1),
    8: (4, 1024, 4, 2, 1),
}
GEMV_MAX_ROWS = max(GEMV_CONFIGS)


X_TERM_BYTES = 48  # one int8 term of a 32-element tile of x: 32 codes, scale, two sums, padding


@triton.jit
def _quantize_x_kernel(x_ptr, out_ptr, K, x_stride, out_stride, TERMS: tl.constexpr, BLOCK_T: tl.constexpr):
    """Rows of x -> per 32-element tile TERMS int8 terms, x ≈ Σ scale_t * c_t, each of the residual
    the terms before it left: codes c = round(r / scale) with scale = max|r| / 127 (the 32 bytes in
    order), then int32 words [float32 scale, Σ c of elements 0-15, Σ c of 16-31, 0]."""
    row = tl.program_id(0).to(tl.int64)
    tt = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)[:, None]
    e = tl.arange(0, 32)[None, :]
    ok = tt * 32 < K
    res = tl.load(x_ptr + row * x_stride + tt * 32 + e, mask=ok, other=0.0).to(tl.float32)
    for term in tl.static_range(TERMS):
        amax = tl.max(tl.abs(res), axis=1)
        scale = amax / 127.0
        v = res * (127.0 / tl.where(amax > 0, amax, 1.0))[:, None]  # an all-zero tile: codes 0
        c = tl.where(v >= 0, v + 0.5, v - 0.5).to(tl.int32)  # rounded half away from zero, as llama.cpp's q8_1
        res = res - c.to(tl.float32) * scale[:, None]
        sums = tl.sum(tl.reshape(c, [BLOCK_T, 2, 16]), axis=2)
        half = tl.arange(0, 2)[None, :]
        sum_lo = tl.sum(tl.where(half == 0, sums, 0), axis=1)[:, None]
        sum_hi = tl.sum(tl.where(half == 1, sums, 0), axis=1)[:, None]
        b = tl.arange(0, 4)[None, None, :]
        words = tl.sum(tl.reshape(c & 255, [BLOCK_T, 8, 4]) << (8 * b), axis=2)
        out = out_ptr.to(tl.pointer_type(tl.int32)) + row * (out_stride // 4) + (tt * TERMS + term) * 12
        tl.store(out + tl.arange(0, 8)[None, :], words, mask=ok)
        meta = tl.arange(0, 4)[None, :]
        meta_val = tl.where(
            meta == 0,
            scale.to(tl.int32, bitcast=True)[:, None],
            tl.where(meta == 1, sum_lo, tl.where(meta == 2, sum_hi, 0)),
        )
        tl.store(out + 8 + meta, meta_val, mask=ok)


@triton.jit
def _dp4a(a, b, ASM: tl.constexpr):
    """Per int32 lane: the sum over its 4 bytes of unsigned a times signed b (PTX dp4a.u32.s32). Without
    ASM the same in plain integer ops: Triton's interpreter (tests on CPU) runs no inline assembly."""
    if ASM:
        return tl.inline_asm_elementwise(
            "dp4a.u32.s32 $0, $1, $2, 0;", "=r,r,r", [a, b], dtype=tl.int32, is_pure=True, pack=1
        )
    s = (a & 255) * ((b << 24) >> 24) + ((a >> 8) & 255) * ((b << 16) >> 24)
    return s + ((a >> 16) & 255) * ((b << 8) >> 24) + ((a >> 24) & 255) * (b >> 24)


@triton.jit
def _pick(v, j, c: tl.constexpr):
    """Lane c of the last axis (held by one thread): a reduction that stays in registers."""
    return tl.sum(tl.where(j == c, v, 0), axis=3)


@triton.jit
def _gemv_step(
    acc,
    b0,
    x_ptr,
    q_ptr,
    h_ptr,
    d_ptr,
    sc_ptr,
    m_ptr,
    M,
    N,
    K,
    x_stride,
    q_stride,
    h_stride,
    d_stride,
    s_stride,
    BITS: tl.constexpr,
    OFFSET: tl.constexpr,
    SB: tl.constexpr,
    G: tl.constexpr,
    HAS_M: tl.constexpr,
    HAS_MN: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    MR: tl.constexpr,
    X_TERMS: tl.constexpr,
    ASM: tl.constexpr,
):
    """acc [BLOCK_N, tiles, MR] plus the products of the BLOCK_K elements from byte b0 of q's rows."""
    # Axes [weight row, 32-element tile, x row, part of a tile]. Every load has this whole shape (x's
    # pointers broadcast over weight rows, the weight's over x rows where they meet), so Triton gives
    # all of them one layout: a thread holds whole parts, threads spread over weight rows and tiles,
    # x rows stay in registers, and nothing moves between threads until the final sum. The part axis
    # is 16 nibble bytes (float x), or 4 int32 words of nibble bytes (X_TERMS: x quantized per tile by
    # `_quantize_x_kernel` into that many int8 terms, codes and x multiplied four bytes at a time by
    # dp4a, as llama.cpp's mmvq with one term).
    # Each tile's codes are dotted with x first and scaled once per half tile.
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)[:, None, None, None]
    r_ok = rows < N
    r = rows.to(tl.int64)
    r3 = tl.reshape(r, [BLOCK_N, 1, 1])
    t = tl.arange(0, BLOCK_K // 32)[None, :, None, None]
    x_row = tl.arange(0, MR)[None, None, :, None] + 0 * r  # x's pointers over the whole frame
    k0 = 2 * b0
    k_lo = k0 + t * 32
    x_ok = (x_row < M) & (k_lo < K)
    if X_TERMS:
        j = tl.arange(0, 4)[None, None, None, :]
        w = tl.max_contiguous(tl.multiple_of(b0 // 4 + t * 4 + j, [1, 4, 1, 4]), [1, 1, 1, 4])
        lo, hi = code_words(q_ptr, h_ptr, r, r_ok & (k_lo < K), w, q_stride, h_stride, BITS, BLOCK_N, BLOCK_K // 32)
        s_lo = tl.zeros([BLOCK_N, BLOCK_K // 32, MR], tl.float32)
        s_hi = tl.zeros([BLOCK_N, BLOCK_K // 32, MR], tl.float32)
        x_sum = tl.zeros([BLOCK_N, BLOCK_K // 32, MR], tl.float32)
        for term in tl.static_range(X_TERMS):
            # x's term: per tile 8 words of int8 codes (lo half, hi half), then 4 words [scale, Σ lo, Σ hi, 0]
            xw = (
                x_ptr.to(tl.pointer_type(tl.int32)) + x_row * (x_stride // 4) + ((k_lo // 32) * X_TERMS + term) * 12 + j
            )
            x_lo = tl.load(xw, mask=x_ok, other=0)
            x_hi = tl.load(xw + 4, mask=x_ok, other=0)
            meta = tl.load(xw + 8, mask=x_ok, other=0)
            x_scale = _pick(meta, j, 0).to(tl.float32, bitcast=True)
            x_sum_lo = _pick(meta, j, 1)
            x_sum_hi = _pick(meta, j, 2)
            dot_lo = tl.sum(_dp4a(lo, x_lo, ASM), axis=3)
            dot_hi = tl.sum(_dp4a(hi, x_hi, ASM), axis=3)
            if G == 16:
                s_lo += (dot_lo - OFFSET * x_sum_lo).to(tl.float32) * x_scale
                s_hi += (dot_hi - OFFSET * x_sum_hi).to(tl.float32) * x_scale
            else:
                s_lo += (dot_lo + dot_hi - OFFSET * (x_sum_lo + x_sum_hi)).to(tl.float32) * x_scale
            x_sum += (x_sum_lo + x_sum_hi).to(tl.float32) * x_scale
        if G != 16:
            s_hi = s_lo
    else:
        i = tl.arange(0, 16)[None, None, None, :]
        # Offsets in bytes of `q`: each tile's 16 bytes are provably contiguous and aligned, one 128-bit load.
        p = tl.max_contiguous(tl.multiple_of(b0 + t * 16 + i, [1, 16, 1, 16]), [1, 1, 1, 16])
        q_lo, q_hi = codes(q_ptr, h_ptr, r, r_ok & (k_lo < K), p, i, q_stride, h_stride, BITS, OFFSET)
        if MR > 1:  # x's own shape: converted to the codes' layout once per step, fewer instructions than
            x_row = tl.arange(0, MR)[None, None, :, None]  # MR threads' worth of broadcast bf16 vectors
            x_ok = (x_row < M) & (k_lo < K)
        x_at = x_ptr + x_row * x_stride + k_lo + i
        x_lo = tl.load(x_at, mask=x_ok, other=0.0).to(tl.float32)
        x_hi = tl.load(x_at + 16, mask=x_ok, other=0.0).to(tl.float32)
        s_lo = tl.sum(q_lo * x_lo, axis=3)
        s_hi = tl.sum(q_hi * x_hi, axis=3)
        if G != 16:
            s_lo = s_lo + s_hi
        x_sum = tl.sum(x_lo + x_hi, axis=3)
    k3 = k0 + tl.arange(0, BLOCK_K // 32)[None, :, None] * 32
    d_lo, d_hi, m = scales(d_ptr, sc_ptr, m_ptr, r3, (r3 < N) & (k3 < K), k3, d_stride, s_stride, SB, G, HAS_M, HAS_MN)
    if G == 16:
        acc += s_lo * d_lo + s_hi * d_hi
    else:
        acc += s_lo * d_lo
    if HAS_M:
        acc += m * x_sum
    return acc


@triton.jit
def _gemv_kernel(
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
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    MR: tl.constexpr,
    X_TERMS: tl.constexpr,
    ASM: tl.constexpr,
):
    """y [M, N] (or split-K partial sums [splits, M, N]) of program_id(1)'s k_split elements of K."""
    acc = tl.zeros([BLOCK_N, BLOCK_K // 32, MR], tl.float32)
    start = tl.program_id(1) * (k_split // 2)  # in bytes of q; the last split's steps past K load nothing
    b0 = start
    while b0 < start + k_split // 2:  # a runtime trip count: one compile for every K
        acc = _gemv_step(
            acc,
            b0,
            x_ptr,
            q_ptr,
            h_ptr,
            d_ptr,
            sc_ptr,
            m_ptr,
            M,
            N,
            K,
            x_stride,
            q_stride,
            h_stride,
            d_stride,
            s_stride,
            BITS,
            OFFSET,
            SB,
            G,
            HAS_M,
            HAS_MN,
            BLOCK_N,
            BLOCK_K,
            MR,
            X_TERMS,
            ASM,
        )
        b0 += BLOCK_K // 2
    y = tl.sum(acc, axis=1)  # [BN, MR]
    rows2 = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]
    xr2 = tl.arange(0, MR)[None, :]
    out = out_ptr + tl.program_id(1) * M * N + xr2 * N + rows2
    tl.store(out, y.to(out_ptr.dtype.element_ty), mask=(rows2 < N) & (xr2 < M))


@kernel_op("hydra::qmm")
def qmm(
    x: torch.Tensor,
    q: torch.Tensor,
    h: torch.Tensor | None,
    d: torch.Tensor,
    sc: torch.Tensor | None,
    m: torch.Tensor | None,
    qtype: int,
) -> torch.Tensor:
    """x [M, K] @ w.T -> [M, N] in x's dtype, for M up to GEMV_MAX_ROWS."""
    rows, k = x.shape
    n = q.shape[0]
    x = x.contiguous()
    if rows == 0:  # e.g. the output head of a prefill chunk that needs no logits
        return x.new_empty(0, n)
    mr = triton.next_power_of_2(rows)
    if mr not in GEMV_CONFIGS:
        raise ValueError(f"the fused GEMV takes 1..{GEMV_MAX_ROWS} rows, got {rows}")
    block_n, block_k, warps, per_sm, x_terms = GEMV_CONFIGS[mr]
    x_terms = x_terms if x.dtype != torch.float32 else 0  # float32 x keeps float32 arithmetic throughout
    ptrs, strides, consts = layout_args(qtype, q, h, d, sc, m)
    grid, k_split, out = plan(rows, n, k, block_n, block_k, per_sm, x.dtype, x.device)
    xk = quantize_x(x, x_terms) if x_terms else x
    _gemv_kernel[grid](
        xk,
        *ptrs,
        out,
        rows,
        n,
        k,
        xk.stride(0),
        *strides,
        k_split,
        **consts,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        MR=mr,
        X_TERMS=x_terms,
        ASM=x.device.type == "cuda",
        num_warps=warps,
    )
    return reduced(out, x.dtype)


def quantize_x(x: torch.Tensor, terms: int = 1) -> torch.Tensor:
    """x [M, K] -> uint8 [M, K / 32 * terms * X_TERM_BYTES]: each 32-element tile's terms as
    `_quantize_x_kernel` writes them."""
    rows, k = x.shape
    out = torch.empty(rows, k // 32 * terms * X_TERM_BYTES, dtype=torch.uint8, device=x.device)
    block_t = 32
    _quantize_x_kernel[(rows, triton.cdiv(k // 32, block_t))](
        x, out, k, x.stride(0), out.stride(0), TERMS=terms, BLOCK_T=block_t
    )
    return out


@qmm.register_fake
def _(x, q, h, d, sc, m, qtype):
    return x.new_empty(x.shape[0], q.shape[0])


def fused_matmul(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """x [M, K] @ w.T with the weight dequantized in registers; more than GEMV_MAX_ROWS rows run
    GEMV_MAX_ROWS at a time (each pass reads the quantized weight once), the last pass padded with
    zero rows: every pass takes the same tile, so a row's result does not depend on where it sits
    (n identical greedy choices prefilled together stay identical)."""
    planes = planes_args(w)
    rows = x.shape[0]
    if rows <= GEMV_MAX_ROWS:
        return qmm(x, *planes)
    if rows % GEMV_MAX_ROWS:
        x = torch.nn.functional.pad(x, (0, 0, 0, -rows % GEMV_MAX_ROWS))
    return torch.cat([qmm(x[i : i + GEMV_MAX_ROWS], *planes) for i in range(0, rows, GEMV_MAX_ROWS)])[:rows]
