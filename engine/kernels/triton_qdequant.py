"""The dequantization of `QuantWeight` planes, as torch custom ops over Triton kernels:
`hydra::qdequant` (the dense weight), `hydra::qembed` (rows by id, the planes on the GPU or pinned
on the host: the embedding lookup) and `hydra::qdequant_into` (into the prefill's scratch for
cuBLAS, a block of rows at a time). Float32 output is bit-exact with `quant.dequantize`.

Custom ops are opaque to torch.compile and launch only Triton kernels and allocations, so CUDA
graphs capture them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .custom_op import kernel_op
from .qweight import QuantWeight
from .triton_qplanes import code_words, layout_args, planes_args, scales, word_floats

DEQUANT_TILE = (16, 256)  # (BLOCK_N, BLOCK_K) of a program


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
    ASM: tl.constexpr,
):
    """Rows of the weight into `out`; with HAS_IDS, output row i is weight row ids[i] (the embedding)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)[:, None, None]
    r_ok = rows < N
    r_out = rows.to(tl.int64)
    r = tl.load(ids_ptr + rows, mask=r_ok, other=0).to(tl.int64) if HAS_IDS else r_out
    k_lo = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K // 32)[None, :, None] * 32
    i = tl.arange(0, 16)[None, None, :]
    # A tile's q as 4 int32 words (one 128-bit load), in `code_words`' frame [row, tile, 1, word].
    t4 = tl.arange(0, BLOCK_K // 32)[None, :, None, None]
    j4 = tl.arange(0, 4)[None, None, None, :]
    w = tl.max_contiguous(tl.multiple_of(tl.program_id(1) * (BLOCK_K // 8) + t4 * 4 + j4, [1, 4, 1, 4]), [1, 1, 1, 4])
    r4 = tl.reshape(r, [BLOCK_N, 1, 1, 1])
    ok4 = tl.reshape(r_ok, [BLOCK_N, 1, 1, 1]) & (tl.program_id(1) * BLOCK_K + t4 * 32 < K)
    lo, hi = code_words(q_ptr, h_ptr, r4, ok4, w, q_stride, h_stride, BITS, BLOCK_N, BLOCK_K // 32)
    q_lo = word_floats(lo, OFFSET, ASM)
    q_hi = word_floats(hi, OFFSET, ASM)
    d_lo, d_hi, m = scales(d_ptr, sc_ptr, m_ptr, r, r_ok & (k_lo < K), k_lo, d_stride, s_stride, SB, G, HAS_M, HAS_MN)
    # The same operations, in the same order, as quant.dequantize: (d * sc) * (u - offset) + m * mn.
    w_lo = d_lo * q_lo + m
    w_hi = d_hi * q_hi + m
    k = k_lo + i
    ok = r_ok & (k < K)
    dt = out_ptr.dtype.element_ty
    tl.store(out_ptr + r_out * K + k, w_lo.to(dt), mask=ok)
    tl.store(out_ptr + r_out * K + k + 16, w_hi.to(dt), mask=ok)


def _dequant_launch(q, h, d, sc, m, qtype: int, out: torch.Tensor, ids: torch.Tensor | None = None) -> None:
    n, k = out.shape
    ptrs, strides, consts = layout_args(qtype, q, h, d, sc, m)
    block_n, block_k = DEQUANT_TILE
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
        ASM=out.device.type == "cuda",  # the interpreter runs no inline assembly
        enable_fp_fusion=False,
    )


@kernel_op("hydra::qdequant")
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


@kernel_op("hydra::qembed")
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


@kernel_op("hydra::qdequant_into", mutates_args=("out",))
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


def kernel_dequantize(w: QuantWeight, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """Dense [n, k]: a new tensor, or written into `out` (a scratch view of that shape) and returned."""
    if out is None:
        return qdequant(*planes_args(w), dtype)
    qdequant_into(*planes_args(w), out)
    return out


def kernel_rows(w: QuantWeight, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Dequantized rows `ids` (a CUDA tensor) of `w`, its planes on that GPU or pinned on the host."""
    return qembed(ids, *planes_args(w), dtype)
