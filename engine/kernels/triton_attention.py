"""Decode attention in Triton (flash-decoding), registered as the torch custom op `hydra::decode_attention`.

One query token per slot. Each program takes one slot, one KV head (with the query heads that share
it, GQA) and one slice of that slot's own positions: the slot's length comes from its position on
the device, so no program walks past its slot (no padding to the longest slot, no mask over the
context) and the grid stays static (CUDA graphs capture it). Slices are split-K over the sequence:
each program leaves a partial max, sum and weighted V; a second kernel reduces the slices in a
fixed order (deterministic: a GPU split equals solo bit for bit).

K and V are read in the cache's own type (model/kv_cache.py): f32/f16/bf16 as stored, q8_0 as int8
codes times the float16 scale of each 32 values, dequantized in registers. A cache is blocks
[n_blocks, n_kv, block_size, head_dim]; the block table (model/kv_blocks.py) maps (slot,
position // block_size) to the block that holds the position.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .custom_op import kernel_op
from .split_k import sm_count


@triton.jit
def _tile(
    codes_ptr,
    scale_ptr,
    x,
    head,
    tt,
    d,
    t_ok,
    d_ok,
    c_s0,
    c_s1,
    c_s2,
    s_s0,
    s_s1,
    s_s2,
    Q8: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """K or V of head `head` at offsets tt of blocks x (one per position), as float32 [BLOCK_N, BLOCK_D]."""
    base = x.to(tl.int64)[:, None]
    at = codes_ptr + base * c_s0 + head * c_s1 + tt[:, None] * c_s2 + d[None, :]
    vals = tl.load(at, mask=t_ok[:, None] & d_ok[None, :], other=0).to(tl.float32)
    if Q8:  # one scale per 32 values: loaded once, broadcast over its block
        G: tl.constexpr = BLOCK_D // 32
        g = tl.arange(0, G)
        at = scale_ptr + base * s_s0 + head * s_s1 + tt[:, None] * s_s2 + g[None, :]
        scale = tl.load(at, mask=t_ok[:, None] & (g < HEAD_DIM // 32)[None, :], other=0).to(tl.float32)
        vals = tl.reshape(tl.reshape(vals, [BLOCK_N, G, 32]) * scale[:, :, None], [BLOCK_N, BLOCK_D])
    return vals


@triton.jit
def _partial_kernel(
    q_ptr,
    k_ptr,
    ks_ptr,
    v_ptr,
    vs_ptr,
    slots_ptr,
    pos_ptr,
    table_ptr,
    m_ptr,
    l_ptr,
    acc_ptr,
    pad_from,
    window,
    scale,
    q_sb,
    q_sh,
    table_stride,
    block_size,
    k_s0,
    k_s1,
    k_s2,
    ks_s0,
    ks_s1,
    ks_s2,
    v_s0,
    v_s1,
    v_s2,
    vs_s0,
    vs_s1,
    vs_s2,
    SPLITS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    K_Q8: tl.constexpr,
    V_Q8: tl.constexpr,
    PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    length = tl.load(pos_ptr + b).to(tl.int32) + 1  # the token at `position` is already written
    start = 0
    if window > 0:
        start = tl.maximum(length - window, 0)
    if length > pad_from:  # a CUDA graph's padding row: its own position only, not a context's worth
        start = length - 1
    first = (start // BLOCK_N) * BLOCK_N  # tiles on tile boundaries: within one block when it holds whole tiles
    chunk = tl.cdiv(tl.cdiv(length - first, SPLITS), BLOCK_N) * BLOCK_N
    lo = first + split * chunk
    hi = tl.minimum(lo + chunk, length)

    h = tl.arange(0, BLOCK_H)
    heads = kvh * GROUP + h
    h_ok = h < GROUP
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + b * q_sb + heads[:, None] * q_sh + d[None, :], mask=h_ok[:, None] & d_ok[None, :], other=0)
    q = q.to(tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    t0 = lo
    while t0 < hi:  # bounds read from the device: a while loop (Triton's interpreter cannot range() over them)
        t = t0 + tl.arange(0, BLOCK_N)
        t_ok = (t >= start) & (t < hi)
        x = tl.load(table_ptr + slot * table_stride + t // block_size, mask=t_ok, other=0)  # each position's block
        tt = t % block_size
        k = _tile(
            k_ptr,
            ks_ptr,
            x,
            kvh,
            tt,
            d,
            t_ok,
            d_ok,
            k_s0,
            k_s1,
            k_s2,
            ks_s0,
            ks_s1,
            ks_s2,
            K_Q8,
            HEAD_DIM,
            BLOCK_N,
            BLOCK_D,
        )
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        s = tl.where(t_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # every tile holds a visible position: finite
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _tile(
            v_ptr,
            vs_ptr,
            x,
            kvh,
            tt,
            d,
            t_ok,
            d_ok,
            v_s0,
            v_s1,
            v_s2,
            vs_s0,
            vs_s1,
            vs_s2,
            V_Q8,
            HEAD_DIM,
            BLOCK_N,
            BLOCK_D,
        )
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m_i = m_new
        t0 += BLOCK_N
    row = (b * (GROUP * tl.num_programs(1)) + heads) * SPLITS + split  # [B, n_head, SPLITS]
    tl.store(m_ptr + row, m_i, mask=h_ok)
    tl.store(l_ptr + row, l_i, mask=h_ok)
    tl.store(acc_ptr + row[:, None] * HEAD_DIM + d[None, :], acc, mask=h_ok[:, None] & d_ok[None, :])


@triton.jit
def _reduce_kernel(
    m_ptr,
    l_ptr,
    acc_ptr,
    out_ptr,
    SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0)  # b * n_head + head
    s = tl.arange(0, BLOCK_S)
    s_ok = s < SPLITS
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    m = tl.load(m_ptr + row * SPLITS + s, mask=s_ok, other=float("-inf"))
    l = tl.load(l_ptr + row * SPLITS + s, mask=s_ok, other=0.0)
    acc = tl.load(
        acc_ptr + (row * SPLITS + s)[:, None] * HEAD_DIM + d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0
    )
    top = tl.max(m, 0)  # the first slice always holds the token itself: finite
    w = tl.where(m > float("-inf"), tl.exp(m - top), 0.0)
    o = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
    tl.store(out_ptr + row * HEAD_DIM + d, o.to(out_ptr.dtype.element_ty), mask=d_ok)


def _block_n(head_dim: int) -> int:
    return 64 if head_dim <= 128 else 32


def default_splits(batch: int, n_kv: int, max_len: int, head_dim: int, device: torch.device) -> int:
    """Slices per (slot, KV head): about four programs per multiprocessor, at most one tile each."""
    want = triton.cdiv(4 * sm_count(device), batch * n_kv)
    return max(1, min(want, triton.cdiv(max_len, _block_n(head_dim)), 64))


def _strides(t: torch.Tensor | None) -> tuple[int, int, int]:
    return (0, 0, 0) if t is None else t.stride()[:3]


@kernel_op("hydra::decode_attention")
def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    k_scale: torch.Tensor | None,
    v: torch.Tensor,
    v_scale: torch.Tensor | None,
    slots: torch.Tensor,
    positions: torch.Tensor,
    block_table: torch.Tensor,
    pad_from: int,
    window: int,
    scale: float,
    splits: int,
) -> torch.Tensor:
    """q [B, n_head, head_dim] over each slot's positions 0..positions[b] (the last `window` of them when
    window > 0) of the cache k, v [n_blocks, n_kv, block_size, head_dim] (int8 with k_scale / v_scale
    [n_blocks, n_kv, block_size, head_dim / 32] for q8_0); block_table [slots, blocks per slot] int32:
    entry j of a slot is the block holding its positions from j * block_size; a row at position
    pad_from or later (a CUDA graph's padding row, past the context) attends to itself only. ->
    [B, n_head, head_dim] in q's dtype."""
    B, n_head, head_dim = q.shape
    n_kv = k.shape[1]
    group = n_head // n_kv
    for t in (k, v):
        if t.stride(3) != 1:
            raise ValueError("the KV cache's head_dim must be contiguous")
    q = q.contiguous()
    m = torch.empty(B, n_head, splits, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    acc = torch.empty(B, n_head, splits, head_dim, dtype=torch.float32, device=q.device)
    block_d = triton.next_power_of_2(head_dim)
    # Products in float32 on tensor cores: TF32 holds a 16-bit value exactly; a float32 compute stays IEEE.
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    _partial_kernel[(B, n_kv, splits)](
        q,
        k,
        k if k_scale is None else k_scale,
        v,
        v if v_scale is None else v_scale,
        slots,
        positions,
        block_table,
        m,
        l,
        acc,
        pad_from,
        window,
        scale,
        q.stride(0),
        q.stride(1),
        block_table.stride(0),
        k.shape[2],
        *k.stride()[:3],
        *_strides(k_scale),
        *v.stride()[:3],
        *_strides(v_scale),
        SPLITS=splits,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_D=block_d,
        BLOCK_N=_block_n(head_dim),
        K_Q8=k_scale is not None,
        V_Q8=v_scale is not None,
        PRECISION=precision,
        num_warps=4,
    )
    out = torch.empty_like(q)
    _reduce_kernel[(B * n_head,)](
        m,
        l,
        acc,
        out,
        SPLITS=splits,
        BLOCK_S=triton.next_power_of_2(splits),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        num_warps=4,
    )
    return out


@decode_attention.register_fake
def _(q, k, k_scale, v, v_scale, slots, positions, block_table, pad_from, window, scale, splits):
    return torch.empty_like(q)
