"""Reading `QuantWeight` planes (`qweight.py`'s layouts) in Triton: the jit helpers the dequantization
kernels (`triton_qdequant.py`), the GEMV (`triton_qmatmul.py`) and the tensor-core GEMM
(`triton_qmma.py`) decode a tile with, and the planes as the kernels' arguments."""

from __future__ import annotations

import triton
import triton.language as tl
from gguf.constants import GGMLQuantizationType as T

from .qweight import LAYOUTS, QuantWeight


@triton.jit
def group(ptr, r, stride, k, DIV: tl.constexpr, ok):
    """The per-group field covering element k of rows r, as float32."""
    return tl.load(ptr + r * stride + k // DIV, mask=ok, other=0).to(tl.float32)


@triton.jit
def codes(q_ptr, h_ptr, r, ok, p, i, q_stride, h_stride, BITS: tl.constexpr, OFFSET: tl.constexpr):
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
def code_words(
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
def word_floats(words, OFFSET: tl.constexpr, ASM: tl.constexpr):
    """`code_words`' codes [BLOCK_N, TILES, 1, 4] -> minus offset as float32 [BLOCK_N, TILES, 16], byte b
    of word w at 4w + b (the nibble byte's index in its tile, as `codes`). Each byte goes into the low
    byte of a float whose high byte is 0x4B (2^23 + code, as `codes`): with ASM one byte permute (PRMT)
    a code, where shifts and masks took ptxas three; without (Triton's interpreter) the same in integers."""
    n: tl.constexpr = words.shape[0]
    tiles: tl.constexpr = words.shape[1]
    b = tl.arange(0, 4)[None, None, None, :]
    w = tl.reshape(words, [n, tiles, 4, 1])
    if ASM:  # bytes of {w, 0x4B000000}: [w's byte b, 0, 0, 0x4B]
        u = tl.inline_asm_elementwise(
            "prmt.b32 $0, $1, 0x4B000000, $2;", "=r,r,r", [w, 0x7440 + b], dtype=tl.int32, is_pure=True, pack=1
        )
    else:
        u = ((w >> (8 * b)) & 0xFF) | 0x4B000000
    return tl.reshape(u, [n, tiles, 16]).to(tl.float32, bitcast=True) - (8388608.0 + OFFSET)


@triton.jit
def half(v, at: tl.constexpr):
    """The float16 at bits `at`..`at`+15 of int64 v, as float32."""
    return ((v >> at) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def scales(
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
        d_lo = half(v, 0) * ((low & 15) | ((high & 3) << 4)).to(tl.float32)
        m = half(v, 16) * ((low >> 4) | ((high & 12) << 2)).to(tl.float32)
        return d_lo, d_lo, m
    d_lo = group(d_ptr, r, d_stride, k_lo, SB, ok)
    d_hi = d_lo
    if G == 16:
        d_lo = d_lo * group(sc_ptr, r, s_stride, k_lo, G, ok)
        d_hi = d_hi * group(sc_ptr, r, s_stride, k_lo + 16, G, ok)
    m = 0.0
    if HAS_M:
        m = group(m_ptr, r, d_stride, k_lo, SB, ok)
    return d_lo, d_hi, m


def layout_args(qtype: int, q, h, d, sc, m) -> tuple[list, list, dict]:
    """Pointer and stride arguments (absent planes alias `d`, never read) and the layout's constexprs."""
    lay = LAYOUTS[T(qtype)]
    ptrs = [q, d if h is None else h, d, d if sc is None else sc, d if m is None else m]
    strides = [q.stride(0), 0 if h is None else h.stride(0), d.stride(0), 0 if sc is None else sc.stride(0)]
    consts = dict(BITS=lay.bits, OFFSET=lay.offset, SB=lay.sb, G=lay.g, HAS_M=lay.has_m, HAS_MN=lay.has_mn)
    return ptrs, strides, consts


def planes_args(w: QuantWeight) -> tuple:
    p = w.planes
    if w.layout.has_mn:  # the K-quants' `dm` and `sm` take the places of `d` and `sc` (see `scales`)
        return p["q"], p.get("h"), p["dm"], p["sm"], None, int(w.qtype)
    return p["q"], p.get("h"), p["d"], p.get("sc"), p.get("m"), int(w.qtype)
