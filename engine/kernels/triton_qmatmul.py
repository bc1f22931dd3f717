"""Triton kernels over `QuantWeight` planes, registered as torch custom ops.

- `hydra::qdequant`, `hydra::qdequant_into`: planes -> dense weight (the embedding rows; the prefill's
  scratch for cuBLAS, a block of rows at a time).
- `hydra::qmm`: y = x @ w.T for 1-GEMV_MAX_ROWS rows of x (decode, speculative verify): a GEMV on
  CUDA cores with w decoded in registers, each weight read once and used for every row, fp32
  accumulate. Per `GEMV_CONFIGS` 16-bit x is first quantized per 32 to one or two int8 terms
  (`quantize_x`), and codes meet x four bytes at a time in dp4a (integer dot products, as llama.cpp's
  mmvq); else (and for float32 x) the codes become floats and meet x in fused multiply-adds.
  A dequant-in-tile tensor-core GEMM was measured 3-6x slower than scratch + cuBLAS at 512 rows and
  no faster at 8-16 (see the benchmark), so prefill dequantizes into scratch for cuBLAS instead.
Narrow outputs split K over more programs; their float32 partials are summed in a fixed order,
so results are deterministic (a GPU split must equal solo bit for bit).

Custom ops are opaque to torch.compile (fullgraph stays whole) and launch only Triton kernels
and allocations, so CUDA graphs capture them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from gguf.constants import GGMLQuantizationType as T

from .qweight import LAYOUTS, QuantWeight
from .split_k import plan, reduced

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


@triton.jit
def _group(ptr, r, stride, k, DIV: tl.constexpr, ok):
    """The per-group field covering element k of rows r, as float32."""
    return tl.load(ptr + r * stride + k // DIV, mask=ok, other=0).to(tl.float32)


@triton.jit
def _codes(q_ptr, h_ptr, r, ok, p, i, q_stride, h_stride, BITS: tl.constexpr, OFFSET: tl.constexpr):
    """Codes minus offset as float32, (lo, hi), at nibble bytes p of rows r (int64), byte i of their
    32-element tile: it holds element i (lo) and element 16 + i (hi)."""
    byte = tl.load(q_ptr + r * q_stride + p, mask=ok, other=0).to(tl.int32)
    lo = byte & 15
    hi = byte >> 4
    if BITS > 4:
        HB = BITS - 4
        PER = 8 // (2 * HB)
        j = i // 4  # the tile's q word holding byte i (see qweight's `h` plane)
        at = (p - i) // PER + j // PER * 4 + i % 4
        hb = tl.load(h_ptr + r * h_stride + at, mask=ok, other=0).to(tl.int32) >> ((j % PER) * (2 * HB))
        lo = lo | ((hb & ((1 << HB) - 1)) << 4)
        hi = hi | (((hb >> HB) & ((1 << HB) - 1)) << 4)
    # Integer to float without the slow conversion unit: the float with bits 0x4B000000 | u is exactly 2^23 + u.
    q_lo = (lo | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + OFFSET)
    q_hi = (hi | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + OFFSET)
    return q_lo, q_hi


@triton.jit
def _half(v, at: tl.constexpr):
    """The float16 at bits `at`..`at`+15 of int64 v, as float32."""
    return ((v >> at) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _scales(
    d_ptr,
    sc_ptr,
    m_ptr,
    r,
    ok,
    k_lo,
    d_stride,
    s_stride,
    SB: tl.constexpr,
    G: tl.constexpr,
    HAS_M: tl.constexpr,
    HAS_MN: tl.constexpr,
):
    """(d_lo, d_hi, m) of the tiles starting at elements k_lo of rows r: the scales of a tile's lo and hi
    halves (a group of 16, Q6_K, splits a tile; wider groups cover both halves) and its min (0: none),
    as quant.dequantize computes them: d * sc and m * mn. The K-quants with mins pass their `dm` as
    `d_ptr` and `sm` as `sc_ptr` (qweight's layout): two loads a tile, the word shared by its block."""
    if HAS_MN:
        g = (k_lo // 32) % 8
        v = tl.load(d_ptr + r * d_stride + k_lo // 256, mask=ok, other=0)
        low = tl.load(sc_ptr + r * s_stride + k_lo // 32, mask=ok, other=0).to(tl.int32)
        high = (v >> 32).to(tl.int32) >> (4 * g)
        d_lo = _half(v, 0) * ((low & 15) | ((high & 3) << 4)).to(tl.float32)
        m = _half(v, 16) * ((low >> 4) | ((high & 12) << 2)).to(tl.float32)
        return d_lo, d_lo, m
    d_lo = _group(d_ptr, r, d_stride, k_lo, SB, ok)
    d_hi = d_lo
    if G == 16:
        d_lo = d_lo * _group(sc_ptr, r, s_stride, k_lo, G, ok)
        d_hi = d_hi * _group(sc_ptr, r, s_stride, k_lo + 16, G, ok)
    m = 0.0
    if HAS_M:
        m = _group(m_ptr, r, d_stride, k_lo, SB, ok)
    return d_lo, d_hi, m


@triton.jit
def _dequant_kernel(
    q_ptr,
    h_ptr,
    d_ptr,
    sc_ptr,
    m_ptr,
    out_ptr,
    ids_ptr,
    N,
    K,
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
    HAS_IDS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Rows of the weight into `out`; with HAS_IDS, output row i is weight row ids[i] (the embedding)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)[:, None, None]
    r_ok = rows < N
    r_out = rows.to(tl.int64)
    r = tl.load(ids_ptr + rows, mask=r_ok, other=0).to(tl.int64) if HAS_IDS else r_out
    k_lo = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K // 32)[None, :, None] * 32
    i = tl.arange(0, 16)[None, None, :]
    p = k_lo // 2 + i
    q_lo, q_hi = _codes(q_ptr, h_ptr, r, r_ok & (k_lo < K), p, i, q_stride, h_stride, BITS, OFFSET)
    d_lo, d_hi, m = _scales(d_ptr, sc_ptr, m_ptr, r, r_ok & (k_lo < K), k_lo, d_stride, s_stride, SB, G, HAS_M, HAS_MN)
    # The same operations, in the same order, as quant.dequantize: (d * sc) * (u - offset) + m * mn.
    w_lo = d_lo * q_lo + m
    w_hi = d_hi * q_hi + m
    k = k_lo + i
    ok = r_ok & (k < K)
    dt = out_ptr.dtype.element_ty
    tl.store(out_ptr + r_out * K + k, w_lo.to(dt), mask=ok)
    tl.store(out_ptr + r_out * K + k + 16, w_hi.to(dt), mask=ok)


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
def _code_words(
    q_ptr, h_ptr, r, ok, w, q_stride, h_stride, BITS: tl.constexpr, BLOCK_N: tl.constexpr, TILES: tl.constexpr
):
    """Unsigned codes four to an int32, one per byte, (lo, hi), of int32 words w ([BLOCK_N, TILES, 1, 4],
    a tile's 4 on the last axis) of rows r of `q`: word w holds nibble bytes 4w..4w+3."""
    qw = tl.load(q_ptr.to(tl.pointer_type(tl.int32)) + r * (q_stride // 4) + w, mask=ok, other=0)
    lo = qw & 0x0F0F0F0F
    hi = (qw >> 4) & 0x0F0F0F0F
    if BITS > 4:
        HB: tl.constexpr = BITS - 4
        PER: tl.constexpr = 8 // (2 * HB)
        # Each q word's share of the tile's h words (HB bytes), loaded beside it; then the h word each
        # serves (qweight's `h` plane), assembled from its PER shares in registers.
        if HB == 1:
            h_share = h_ptr
        elif HB == 2:
            h_share = h_ptr.to(tl.pointer_type(tl.uint16))
        else:
            h_share = h_ptr.to(tl.pointer_type(tl.int32))
        share = tl.load(h_share + r * (h_stride // HB) + w, mask=ok, other=0).to(tl.int32)
        if PER > 1:
            c = tl.arange(0, PER)[None, None, None, :]
            word = tl.sum(tl.reshape(share, [BLOCK_N, TILES, 4 // PER, PER]) << (8 * HB * c), axis=3)
            share = tl.reshape(
                tl.broadcast_to(word[:, :, :, None], [BLOCK_N, TILES, 4 // PER, PER]), [BLOCK_N, TILES, 1, 4]
            )
        j = tl.arange(0, 4)[None, None, None, :]
        at = (j % PER) * (2 * HB)  # the bits of this q word's lo codes; its hi codes' HB above
        MASK: tl.constexpr = ((1 << HB) - 1) * 0x01010101
        lo |= ((share >> at) & MASK) << 4
        hi |= ((share >> (at + HB)) & MASK) << 4
    return lo, hi


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
        lo, hi = _code_words(q_ptr, h_ptr, r, r_ok & (k_lo < K), w, q_stride, h_stride, BITS, BLOCK_N, BLOCK_K // 32)
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
        q_lo, q_hi = _codes(q_ptr, h_ptr, r, r_ok & (k_lo < K), p, i, q_stride, h_stride, BITS, OFFSET)
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
    d_lo, d_hi, m = _scales(d_ptr, sc_ptr, m_ptr, r3, (r3 < N) & (k3 < K), k3, d_stride, s_stride, SB, G, HAS_M, HAS_MN)
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


def _layout_args(qtype: int, q, h, d, sc, m) -> tuple[list, list, dict]:
    """Pointer and stride arguments (absent planes alias `d`, never read) and the layout's constexprs."""
    lay = LAYOUTS[T(qtype)]
    ptrs = [q, d if h is None else h, d, d if sc is None else sc, d if m is None else m]
    strides = [q.stride(0), 0 if h is None else h.stride(0), d.stride(0), 0 if sc is None else sc.stride(0)]
    consts = dict(BITS=lay.bits, OFFSET=lay.offset, SB=lay.sb, G=lay.g, HAS_M=lay.has_m, HAS_MN=lay.has_mn)
    return ptrs, strides, consts


def _dequant_launch(q, h, d, sc, m, qtype: int, out: torch.Tensor, ids: torch.Tensor | None = None) -> None:
    n, k = out.shape
    ptrs, strides, consts = _layout_args(qtype, q, h, d, sc, m)
    block_n, block_k = 16, 256
    # No fused multiply-adds: float32 output equals quant.dequantize bit for bit.
    _dequant_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        *ptrs,
        out,
        out if ids is None else ids,
        n,
        k,
        *strides,
        **consts,
        HAS_IDS=ids is not None,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        enable_fp_fusion=False,
    )


@torch.library.custom_op("hydra::qdequant", mutates_args=())
def qdequant(
    q: torch.Tensor,
    h: torch.Tensor | None,
    d: torch.Tensor,
    sc: torch.Tensor | None,
    m: torch.Tensor | None,
    qtype: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    out = torch.empty(q.shape[0], q.shape[1] * 2, dtype=dtype, device=q.device)
    _dequant_launch(q, h, d, sc, m, qtype, out)
    return out


@qdequant.register_fake
def _(q, h, d, sc, m, qtype, dtype):
    return q.new_empty(q.shape[0], q.shape[1] * 2, dtype=dtype)


@torch.library.custom_op("hydra::qembed", mutates_args=())
def qembed(
    ids: torch.Tensor,
    q: torch.Tensor,
    h: torch.Tensor | None,
    d: torch.Tensor,
    sc: torch.Tensor | None,
    m: torch.Tensor | None,
    qtype: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Rows `ids` (on the GPU) of a weight whose planes may lie in pinned host memory (the token
    embedding, as llama.cpp keeps it): the kernel reads just those rows across the bus, on the
    device's stream, so a lookup is still graph-capturable and never waits for the host."""
    out = torch.empty(ids.numel(), q.shape[1] * 2, dtype=dtype, device=ids.device)
    _dequant_launch(q, h, d, sc, m, qtype, out, ids.reshape(-1))
    return out


@qembed.register_fake
def _(ids, q, h, d, sc, m, qtype, dtype):
    return ids.new_empty(ids.numel(), q.shape[1] * 2, dtype=dtype)


@torch.library.custom_op("hydra::qdequant_into", mutates_args=("out",))
def qdequant_into(
    q: torch.Tensor,
    h: torch.Tensor | None,
    d: torch.Tensor,
    sc: torch.Tensor | None,
    m: torch.Tensor | None,
    qtype: int,
    out: torch.Tensor,
) -> None:
    """The weight dequantized into `out` [n, k] (a reused scratch, contiguous)."""
    _dequant_launch(q, h, d, sc, m, qtype, out)


@qdequant_into.register_fake
def _(q, h, d, sc, m, qtype, out):
    return None


@torch.library.custom_op("hydra::qmm", mutates_args=())
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
    ptrs, strides, consts = _layout_args(qtype, q, h, d, sc, m)
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


def planes_args(w: QuantWeight) -> tuple:
    p = w.planes
    if w.layout.has_mn:  # the K-quants' `dm` and `sm` take the places of `d` and `sc` (see `_scales`)
        return p["q"], p.get("h"), p["dm"], p["sm"], None, int(w.qtype)
    return p["q"], p.get("h"), p["d"], p.get("sc"), p.get("m"), int(w.qtype)


def kernel_dequantize(w: QuantWeight, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """Dense [n, k]: a new tensor, or written into `out` (a scratch view of that shape) and returned."""
    if out is None:
        return qdequant(*planes_args(w), dtype)
    qdequant_into(*planes_args(w), out)
    return out


def kernel_rows(w: QuantWeight, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Dequantized rows `ids` (a CUDA tensor) of `w`, its planes on that GPU or pinned on the host."""
    return qembed(ids, *planes_args(w), dtype)


def fused_matmul(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """x [M, K] @ w.T with the weight dequantized in registers, M <= GEMV_MAX_ROWS."""
    return qmm(x, *planes_args(w))
