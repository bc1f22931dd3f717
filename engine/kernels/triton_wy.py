"""The first of the chunked gated delta rule's kernels (`triton_delta_rule.py` has the rule and the
other two): per (chunk, row, head) the WY/UT form's cumulative log-gate gc, A, T = (I + A)⁻¹ and
w = T diag(β exp(gc)) K, u = T diag(β) V, every chunk at once. `wy_kernel` solves T by rows
(forward substitution, 63 serial steps on the 64 x 64 tile, -A through a scratch in global memory),
`wy_blocked_kernel` by 16 x 16 blocks (`triton_delta_rule.CONFIG["wy_solve"]` picks).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def wy_kernel(
    k_ptr,
    v_ptr,
    g_ptr,
    b_ptr,
    len_ptr,
    a_ptr,
    w_ptr,
    u_ptr,
    gc_ptr,
    L,
    H: tl.constexpr,
    HK: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    PRECISION: tl.constexpr,
):
    c = tl.program_id(0)
    rh = tl.program_id(1)
    r = rh // H
    h = rh % H
    hk = h % HK
    n = tl.load(len_ptr + r)
    if c * BT >= n:  # a chunk past the row's end (a PACKED batch's short and empty runs): nothing reads it
        return
    i = tl.arange(0, BT)
    t = c * BT + i
    ok = t < n
    row = (r * L + t).to(tl.int64)  # token rows of [R, L, ...]
    g = tl.load(g_ptr + row * H + h, mask=ok, other=0.0)
    beta = tl.load(b_ptr + row * H + h, mask=ok, other=0.0)
    gc = tl.cumsum(g, 0)
    tl.store(gc_ptr + row * H + h, gc, mask=t < L)

    kk = tl.zeros([BT, BT], dtype=tl.float32)
    for k0 in range(0, DK, BK):
        d = k0 + tl.arange(0, BK)
        kt = tl.load(
            k_ptr + (row * HK + hk)[:, None] * DK + d[None, :], mask=ok[:, None] & (d < DK)[None, :], other=0.0
        )
        kk += tl.dot(kt, tl.trans(kt), input_precision=PRECISION)
    lower = i[:, None] > i[None, :]
    decay = tl.exp(tl.where(lower, gc[:, None] - gc[None, :], 0.0))
    a = tl.where(lower, -(beta[:, None] * kk * decay), 0.0)  # -A, strictly lower
    # T = (I + A)⁻¹ by forward substitution: row s of T - I = Σ_{j<s} (-A)_sj (row j of T), in place;
    # row s of -A read back from the scratch (one reduction a row instead of two).
    scratch = a_ptr + ((rh.to(tl.int64) * tl.num_programs(0) + c) * BT) * BT  # [BT, BT] of this program
    tl.store(scratch + i[:, None] * BT + i[None, :], a)
    tl.debug_barrier()
    for s in range(1, BT):
        ai = tl.load(scratch + s * BT + i)
        ai = ai + tl.sum(ai[:, None] * a, 0) * (i < s)
        a = tl.where((i == s)[:, None], ai[None, :], a)
    tri = a + (i[:, None] == i[None, :]).to(tl.float32)

    for v0 in range(0, DV, BV):
        e = v0 + tl.arange(0, BV)
        m = ok[:, None] & (e < DV)[None, :]
        vt = tl.load(v_ptr + (row * H + h)[:, None] * DV + e[None, :], mask=m, other=0.0)
        u = tl.dot(tri, vt * beta[:, None], input_precision=PRECISION)
        tl.store(u_ptr + (row * H + h)[:, None] * DV + e[None, :], u, mask=(t < L)[:, None] & (e < DV)[None, :])
    kb = beta * tl.exp(gc)
    for k0 in range(0, DK, BK):
        d = k0 + tl.arange(0, BK)
        kt = tl.load(
            k_ptr + (row * HK + hk)[:, None] * DK + d[None, :], mask=ok[:, None] & (d < DK)[None, :], other=0.0
        )
        w = tl.dot(tri, kt * kb[:, None], input_precision=PRECISION)
        tl.store(w_ptr + (row * H + h)[:, None] * DK + d[None, :], w, mask=(t < L)[:, None] & (d < DK)[None, :])


@triton.jit
def _inv_lower(a, BC: tl.constexpr):
    """(I - a)⁻¹ of a strictly lower [BC, BC] tile a, by forward substitution in registers."""
    i = tl.arange(0, BC)
    for s in range(1, BC):
        pick = i == s
        ai = tl.sum(tl.where(pick[:, None], a, 0.0), 0)  # row s, not updated yet
        ai = ai + tl.sum(ai[:, None] * a, 0) * (i < s)
        a = tl.where(pick[:, None], ai[None, :], a)
    return a + (i[:, None] == i[None, :]).to(tl.float32)


@triton.jit
def _rows(ptr, row, width, col, ok):
    """[rows, cols] tile of a row-major [.., width] tensor; rows outside `ok` read 0."""
    return tl.load(ptr + row[:, None] * width + col[None, :], mask=ok[:, None] & (col < width)[None, :], other=0.0)


@triton.jit
def _wy_store(ptr, row, width, col, ok, val):
    tl.store(ptr + row[:, None] * width + col[None, :], val, mask=ok[:, None] & (col < width)[None, :])


@triton.jit
def _off(a_ik, kk, beta_i, gc_i, gc_j):
    """-A of a block below the diagonal (every row after every column: no mask)."""
    return a_ik - beta_i[:, None] * kk * tl.exp(gc_i[:, None] - gc_j[None, :])


@triton.jit
def wy_blocked_kernel(
    k_ptr,
    v_ptr,
    g_ptr,
    b_ptr,
    len_ptr,
    a_ptr,
    w_ptr,
    u_ptr,
    gc_ptr,
    L,
    H: tl.constexpr,
    HK: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """`wy_kernel` with T = (I + A)⁻¹ by blocks of 16 (flash-linear-attention's solve_tril): the
    four diagonal blocks by forward substitution side by side (15 steps on 16 x 16 tiles instead of
    63 on 64 x 64), the blocks below from them by block forward substitution (16 x 16 products)."""
    tl.static_assert(BT == 64)
    BC: tl.constexpr = 16
    c = tl.program_id(0)
    rh = tl.program_id(1)
    r = rh // H
    h = rh % H
    hk = h % HK
    n = tl.load(len_ptr + r)
    if c * BT >= n:  # as wy_kernel
        return
    i = tl.arange(0, BC)
    t0 = c * BT + i
    t1 = t0 + BC
    t2 = t1 + BC
    t3 = t2 + BC
    r0 = (r * L + t0).to(tl.int64)
    r1 = r0 + BC
    r2 = r1 + BC
    r3 = r2 + BC
    g0 = tl.load(g_ptr + r0 * H + h, mask=t0 < n, other=0.0)
    g1 = tl.load(g_ptr + r1 * H + h, mask=t1 < n, other=0.0)
    g2 = tl.load(g_ptr + r2 * H + h, mask=t2 < n, other=0.0)
    g3 = tl.load(g_ptr + r3 * H + h, mask=t3 < n, other=0.0)
    gc0 = tl.cumsum(g0, 0)
    gc1 = tl.cumsum(g1, 0) + tl.sum(g0, 0)
    gc2 = tl.cumsum(g2, 0) + (tl.sum(g0, 0) + tl.sum(g1, 0))
    gc3 = tl.cumsum(g3, 0) + (tl.sum(g0, 0) + tl.sum(g1, 0) + tl.sum(g2, 0))
    tl.store(gc_ptr + r0 * H + h, gc0, mask=t0 < L)
    tl.store(gc_ptr + r1 * H + h, gc1, mask=t1 < L)
    tl.store(gc_ptr + r2 * H + h, gc2, mask=t2 < L)
    tl.store(gc_ptr + r3 * H + h, gc3, mask=t3 < L)
    b0 = tl.load(b_ptr + r0 * H + h, mask=t0 < n, other=0.0)
    b1 = tl.load(b_ptr + r1 * H + h, mask=t1 < n, other=0.0)
    b2 = tl.load(b_ptr + r2 * H + h, mask=t2 < n, other=0.0)
    b3 = tl.load(b_ptr + r3 * H + h, mask=t3 < n, other=0.0)

    z = tl.zeros([BC, BC], dtype=tl.float32)
    kk00 = z
    kk10 = z
    kk11 = z
    kk20 = z
    kk21 = z
    kk22 = z
    kk30 = z
    kk31 = z
    kk32 = z
    kk33 = z
    for k0 in range(0, DK, BK):
        d = k0 + tl.arange(0, BK)
        k0t = _rows(k_ptr, r0 * HK + hk, DK, d, t0 < n)
        k1t = _rows(k_ptr, r1 * HK + hk, DK, d, t1 < n)
        k2t = _rows(k_ptr, r2 * HK + hk, DK, d, t2 < n)
        k3t = _rows(k_ptr, r3 * HK + hk, DK, d, t3 < n)
        kk00 += tl.dot(k0t, tl.trans(k0t), input_precision=PRECISION)
        kk10 += tl.dot(k1t, tl.trans(k0t), input_precision=PRECISION)
        kk11 += tl.dot(k1t, tl.trans(k1t), input_precision=PRECISION)
        kk20 += tl.dot(k2t, tl.trans(k0t), input_precision=PRECISION)
        kk21 += tl.dot(k2t, tl.trans(k1t), input_precision=PRECISION)
        kk22 += tl.dot(k2t, tl.trans(k2t), input_precision=PRECISION)
        kk30 += tl.dot(k3t, tl.trans(k0t), input_precision=PRECISION)
        kk31 += tl.dot(k3t, tl.trans(k1t), input_precision=PRECISION)
        kk32 += tl.dot(k3t, tl.trans(k2t), input_precision=PRECISION)
        kk33 += tl.dot(k3t, tl.trans(k3t), input_precision=PRECISION)
    lower = i[:, None] > i[None, :]
    # -A on the diagonal blocks (strictly lower) and below them
    a00 = tl.where(lower, -(b0[:, None] * kk00 * tl.exp(tl.where(lower, gc0[:, None] - gc0[None, :], 0.0))), 0.0)
    a11 = tl.where(lower, -(b1[:, None] * kk11 * tl.exp(tl.where(lower, gc1[:, None] - gc1[None, :], 0.0))), 0.0)
    a22 = tl.where(lower, -(b2[:, None] * kk22 * tl.exp(tl.where(lower, gc2[:, None] - gc2[None, :], 0.0))), 0.0)
    a33 = tl.where(lower, -(b3[:, None] * kk33 * tl.exp(tl.where(lower, gc3[:, None] - gc3[None, :], 0.0))), 0.0)
    a10 = _off(z, kk10, b1, gc1, gc0)
    a20 = _off(z, kk20, b2, gc2, gc0)
    a21 = _off(z, kk21, b2, gc2, gc1)
    a30 = _off(z, kk30, b3, gc3, gc0)
    a31 = _off(z, kk31, b3, gc3, gc1)
    a32 = _off(z, kk32, b3, gc3, gc2)
    T00 = _inv_lower(a00, BC)
    T11 = _inv_lower(a11, BC)
    T22 = _inv_lower(a22, BC)
    T33 = _inv_lower(a33, BC)
    # T_ij = T_ii Σ_{j<=m<i} (-A)_im T_mj
    T10 = tl.dot(T11, tl.dot(a10, T00, input_precision=PRECISION), input_precision=PRECISION)
    T21 = tl.dot(T22, tl.dot(a21, T11, input_precision=PRECISION), input_precision=PRECISION)
    T20 = tl.dot(
        T22,
        tl.dot(a20, T00, input_precision=PRECISION) + tl.dot(a21, T10, input_precision=PRECISION),
        input_precision=PRECISION,
    )
    T32 = tl.dot(T33, tl.dot(a32, T22, input_precision=PRECISION), input_precision=PRECISION)
    T31 = tl.dot(
        T33,
        tl.dot(a31, T11, input_precision=PRECISION) + tl.dot(a32, T21, input_precision=PRECISION),
        input_precision=PRECISION,
    )
    T30 = tl.dot(
        T33,
        tl.dot(a30, T00, input_precision=PRECISION)
        + tl.dot(a31, T10, input_precision=PRECISION)
        + tl.dot(a32, T20, input_precision=PRECISION),
        input_precision=PRECISION,
    )

    for v0 in range(0, DV, BV):
        e = v0 + tl.arange(0, BV)
        x0 = _rows(v_ptr, r0 * H + h, DV, e, t0 < n) * b0[:, None]
        x1 = _rows(v_ptr, r1 * H + h, DV, e, t1 < n) * b1[:, None]
        x2 = _rows(v_ptr, r2 * H + h, DV, e, t2 < n) * b2[:, None]
        x3 = _rows(v_ptr, r3 * H + h, DV, e, t3 < n) * b3[:, None]
        _wy_store(u_ptr, r0 * H + h, DV, e, t0 < L, tl.dot(T00, x0, input_precision=PRECISION))
        _wy_store(
            u_ptr,
            r1 * H + h,
            DV,
            e,
            t1 < L,
            tl.dot(T10, x0, input_precision=PRECISION) + tl.dot(T11, x1, input_precision=PRECISION),
        )
        u2 = (
            tl.dot(T20, x0, input_precision=PRECISION)
            + tl.dot(T21, x1, input_precision=PRECISION)
            + tl.dot(T22, x2, input_precision=PRECISION)
        )
        _wy_store(u_ptr, r2 * H + h, DV, e, t2 < L, u2)
        u3 = tl.dot(T30, x0, input_precision=PRECISION) + tl.dot(T31, x1, input_precision=PRECISION)
        u3 += tl.dot(T32, x2, input_precision=PRECISION) + tl.dot(T33, x3, input_precision=PRECISION)
        _wy_store(u_ptr, r3 * H + h, DV, e, t3 < L, u3)
    for k0 in range(0, DK, BK):
        d = k0 + tl.arange(0, BK)
        x0 = _rows(k_ptr, r0 * HK + hk, DK, d, t0 < n) * (b0 * tl.exp(gc0))[:, None]
        x1 = _rows(k_ptr, r1 * HK + hk, DK, d, t1 < n) * (b1 * tl.exp(gc1))[:, None]
        x2 = _rows(k_ptr, r2 * HK + hk, DK, d, t2 < n) * (b2 * tl.exp(gc2))[:, None]
        x3 = _rows(k_ptr, r3 * HK + hk, DK, d, t3 < n) * (b3 * tl.exp(gc3))[:, None]
        _wy_store(w_ptr, r0 * H + h, DK, d, t0 < L, tl.dot(T00, x0, input_precision=PRECISION))
        _wy_store(
            w_ptr,
            r1 * H + h,
            DK,
            d,
            t1 < L,
            tl.dot(T10, x0, input_precision=PRECISION) + tl.dot(T11, x1, input_precision=PRECISION),
        )
        w2 = (
            tl.dot(T20, x0, input_precision=PRECISION)
            + tl.dot(T21, x1, input_precision=PRECISION)
            + tl.dot(T22, x2, input_precision=PRECISION)
        )
        _wy_store(w_ptr, r2 * H + h, DK, d, t2 < L, w2)
        w3 = tl.dot(T30, x0, input_precision=PRECISION) + tl.dot(T31, x1, input_precision=PRECISION)
        w3 += tl.dot(T32, x2, input_precision=PRECISION) + tl.dot(T33, x3, input_precision=PRECISION)
        _wy_store(w_ptr, r3 * H + h, DK, d, t3 < L, w3)
