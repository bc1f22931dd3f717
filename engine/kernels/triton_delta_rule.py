"""The gated delta rule over long runs (prefill) in Triton, chunked: the torch custom op
`hydra::chunk_gated_delta_rule`.

Per V head the state S [dk, dv] (float32) follows, token by token (model/deltanet.py):

    S = exp(g_t) S;   S += k_t ⊗ β_t (v_t - Sᵀk_t);   o_t = Sᵀq_t

In chunks of BT = 64 tokens this is the WY/UT form (flash-linear-attention's chunk_gated_delta_rule,
llama.cpp's chunked GDN). With gc the cumulative log-gate from the chunk's start and S0 the state
entering the chunk, the chunk's corrections U_t = β_t (v_t - (exp(g_t) S_{t-1})ᵀ k_t) solve a unit
lower-triangular system:

    (I + A) U = diag(β) V - diag(β exp(gc)) K S0,   A_ts = β_t exp(gc_t - gc_s) k_t·k_s  (s < t)

so with T = (I + A)⁻¹ (forward substitution), u = T diag(β) V and w = T diag(β exp(gc)) K:

    U = u - w S0
    o_t = exp(gc_t) S0ᵀ q_t + Σ_{s≤t} exp(gc_t - gc_s) (q_t·k_s) U_s
    S_end = exp(gc_last) S0 + Σ_s exp(gc_last - gc_s) k_s U_sᵀ

Three kernels: `_wy_kernel` (one program per (chunk, row, head): gc, A, T, w, u; every chunk at once;
`_wy_blocked_kernel` solves T by 16 x 16 blocks instead, `CONFIG["wy_solve"]`), `_state_kernel` (one
per (V tile, row, head), looping over the chunks: U and the state entering each chunk, the final
state and the checkpoints), `_output_kernel` (one per (V tile, chunk, row, head): o; given the layer's
output gate z and norm weight, a whole head per program and the layer's output side applied:
RMSNorm(o · scale) · norm · SiLU(z), written in z's dtype where the flat batch has the token).
Products (tl.dot) in TF32 for a 16-bit model, "tf32x3" (three TF32 products: float32's accuracy) for a
float32 one; on an H100 at the 27B shape the rule takes 0.42 / 1.67 / 6.0 ms at 512 / 4096 / 16384
tokens in TF32 (the torch forms: 9.5 / 22 / 56 ms), see benchmarks/bench_delta_rule.py.

Rows are runs padded to one length L; row r's steps past lengths[r] are absent (read as g = 0,
β = 0, k = 0: the state stays), so the final state is the one after its last step. Besides it, the
op returns the states `1..n_ckpt` steps before each row's end (the draft-rollback checkpoints).
Q/K heads are shared GQA-style as ggml tiles them: V head h reads Q/K head h % n_k_heads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BT = 64  # tokens per chunk (llama.cpp's and fla's)
# Launch settings: V tile and warps of the state recurrence (its programs: V tiles x rows x heads, each
# walking every chunk), of the output, and the WY kernel's warps (its forward substitution is serial:
# fewer warps, less synchronisation). The fastest of benchmarks/bench_delta_rule.py --sweep on an H100
# at 512, 4096 and 16384 tokens of the 27B shape (state_bv 64 does not fit shared memory).
# `*_stages`: software-pipelining depth of each kernel's loops (Triton's num_stages; deeper stages hold
# more tiles in shared memory, fewer programs fit a multiprocessor).
# `wy_solve`: T = (I + A)⁻¹ by rows ("rows": 63 serial steps on the 64 x 64 tile) or by 16 x 16 blocks
# ("blocks": `_wy_blocked_kernel`).
CONFIG = {
    "wy_solve": "rows",
    "wy_warps": 2,
    "wy_stages": 3,
    "state_bv": 32,
    "state_warps": 8,
    "state_stages": 3,
    "out_bv": 64,
    "out_warps": 4,
    "out_stages": 3,
}


@triton.jit
def _wy_kernel(
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
def _wy_blocked_kernel(
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
    """`_wy_kernel` with T = (I + A)⁻¹ by blocks of 16 (flash-linear-attention's solve_tril): the
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
    P = PRECISION
    T10 = tl.dot(T11, tl.dot(a10, T00, input_precision=P), input_precision=P)
    T21 = tl.dot(T22, tl.dot(a21, T11, input_precision=P), input_precision=P)
    T20 = tl.dot(T22, tl.dot(a20, T00, input_precision=P) + tl.dot(a21, T10, input_precision=P), input_precision=P)
    T32 = tl.dot(T33, tl.dot(a32, T22, input_precision=P), input_precision=P)
    T31 = tl.dot(T33, tl.dot(a31, T11, input_precision=P) + tl.dot(a32, T21, input_precision=P), input_precision=P)
    T30 = tl.dot(
        T33,
        tl.dot(a30, T00, input_precision=P) + tl.dot(a31, T10, input_precision=P) + tl.dot(a32, T20, input_precision=P),
        input_precision=P,
    )

    for v0 in range(0, DV, BV):
        e = v0 + tl.arange(0, BV)
        x0 = _rows(v_ptr, r0 * H + h, DV, e, t0 < n) * b0[:, None]
        x1 = _rows(v_ptr, r1 * H + h, DV, e, t1 < n) * b1[:, None]
        x2 = _rows(v_ptr, r2 * H + h, DV, e, t2 < n) * b2[:, None]
        x3 = _rows(v_ptr, r3 * H + h, DV, e, t3 < n) * b3[:, None]
        _wy_store(u_ptr, r0 * H + h, DV, e, t0 < L, tl.dot(T00, x0, input_precision=P))
        _wy_store(
            u_ptr, r1 * H + h, DV, e, t1 < L, tl.dot(T10, x0, input_precision=P) + tl.dot(T11, x1, input_precision=P)
        )
        u2 = (
            tl.dot(T20, x0, input_precision=P) + tl.dot(T21, x1, input_precision=P) + tl.dot(T22, x2, input_precision=P)
        )
        _wy_store(u_ptr, r2 * H + h, DV, e, t2 < L, u2)
        u3 = tl.dot(T30, x0, input_precision=P) + tl.dot(T31, x1, input_precision=P)
        u3 += tl.dot(T32, x2, input_precision=P) + tl.dot(T33, x3, input_precision=P)
        _wy_store(u_ptr, r3 * H + h, DV, e, t3 < L, u3)
    for k0 in range(0, DK, BK):
        d = k0 + tl.arange(0, BK)
        x0 = _rows(k_ptr, r0 * HK + hk, DK, d, t0 < n) * (b0 * tl.exp(gc0))[:, None]
        x1 = _rows(k_ptr, r1 * HK + hk, DK, d, t1 < n) * (b1 * tl.exp(gc1))[:, None]
        x2 = _rows(k_ptr, r2 * HK + hk, DK, d, t2 < n) * (b2 * tl.exp(gc2))[:, None]
        x3 = _rows(k_ptr, r3 * HK + hk, DK, d, t3 < n) * (b3 * tl.exp(gc3))[:, None]
        _wy_store(w_ptr, r0 * H + h, DK, d, t0 < L, tl.dot(T00, x0, input_precision=P))
        _wy_store(
            w_ptr, r1 * H + h, DK, d, t1 < L, tl.dot(T10, x0, input_precision=P) + tl.dot(T11, x1, input_precision=P)
        )
        w2 = (
            tl.dot(T20, x0, input_precision=P) + tl.dot(T21, x1, input_precision=P) + tl.dot(T22, x2, input_precision=P)
        )
        _wy_store(w_ptr, r2 * H + h, DK, d, t2 < L, w2)
        w3 = tl.dot(T30, x0, input_precision=P) + tl.dot(T31, x1, input_precision=P)
        w3 += tl.dot(T32, x2, input_precision=P) + tl.dot(T33, x3, input_precision=P)
        _wy_store(w_ptr, r3 * H + h, DK, d, t3 < L, w3)


@triton.jit
def _state_kernel(
    k_ptr,
    w_ptr,
    u_ptr,
    gc_ptr,
    len_ptr,
    s0_ptr,
    hs_ptr,
    vn_ptr,
    sf_ptr,
    ck_ptr,
    L,
    NT,
    H: tl.constexpr,
    HK: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BT: tl.constexpr,
    BKS: tl.constexpr,
    BV: tl.constexpr,
    NCK: tl.constexpr,
    PRECISION: tl.constexpr,
):
    vb = tl.program_id(0)
    rh = tl.program_id(1)
    r = rh // H
    h = rh % H
    hk = h % HK
    n = tl.load(len_ptr + r)
    d = tl.arange(0, BKS)
    e = vb * BV + tl.arange(0, BV)
    de = (d < DK)[:, None] & (e < DV)[None, :]
    at = d[:, None] * DV + e[None, :]  # [DK, DV] offsets of this tile
    state = tl.load(s0_ptr + rh.to(tl.int64) * DK * DV + at, mask=de, other=0.0)
    for j in tl.static_range(NCK):  # a checkpoint before the row's first step: the incoming state
        if n - 2 - j < 0:
            tl.store(ck_ptr + ((r * NCK + j) * H + h).to(tl.int64) * DK * DV + at, state, mask=de)
    i = tl.arange(0, BT)
    for c in range(0, NT):
        tl.store(hs_ptr + (((r * NT + c) * H + h).to(tl.int64) * DK * DV) + at, state, mask=de)
        t = c * BT + i
        in_l = t < L
        row = (r * L + t).to(tl.int64)
        w = tl.load(w_ptr + (row * H + h)[:, None] * DK + d[None, :], mask=in_l[:, None] & (d < DK)[None, :], other=0.0)
        te = in_l[:, None] & (e < DV)[None, :]
        u = tl.load(u_ptr + (row * H + h)[:, None] * DV + e[None, :], mask=te, other=0.0)
        vn = u - tl.dot(w, state, input_precision=PRECISION)  # U: [BT, BV]
        tl.store(vn_ptr + (row * H + h)[:, None] * DV + e[None, :], vn, mask=te)
        gc = tl.load(gc_ptr + row * H + h, mask=in_l, other=0.0)
        kt = tl.load(
            k_ptr + (row * HK + hk)[:, None] * DK + d[None, :], mask=(t < n)[:, None] & (d < DK)[None, :], other=0.0
        )
        for j in tl.static_range(NCK):  # the state after step p = n - 2 - j, where p falls in this chunk
            p = n - 2 - j
            if (p >= c * BT) & (p < c * BT + BT):
                gp = tl.sum(tl.where(t == p, gc, 0.0), 0)
                coef = tl.where(t <= p, tl.exp(gp - gc), 0.0)
                sp = state * tl.exp(gp) + tl.dot(tl.trans(kt * coef[:, None]), vn, input_precision=PRECISION)
                tl.store(ck_ptr + ((r * NCK + j) * H + h).to(tl.int64) * DK * DV + at, sp, mask=de)
        last = tl.minimum(c * BT + BT, L) - 1
        gl = tl.sum(tl.where(t == last, gc, 0.0), 0)
        kd = kt * tl.exp(gl - gc)[:, None]
        state = state * tl.exp(gl) + tl.dot(tl.trans(kd), vn, input_precision=PRECISION)
    tl.store(sf_ptr + rh.to(tl.int64) * DK * DV + at, state, mask=de)


@triton.jit
def _output_kernel(
    q_ptr,
    k_ptr,
    gc_ptr,
    hs_ptr,
    vn_ptr,
    o_ptr,
    z_ptr,
    nw_ptr,
    start_ptr,
    len_ptr,
    L,
    NT,
    z_stride,
    scale,
    eps,
    GATED: tl.constexpr,
    H: tl.constexpr,
    HK: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    PRECISION: tl.constexpr,
):
    vb = tl.program_id(0)
    c = tl.program_id(1)
    rh = tl.program_id(2)
    r = rh // H
    h = rh % H
    hk = h % HK
    i = tl.arange(0, BT)
    t = c * BT + i
    in_l = t < L
    row = (r * L + t).to(tl.int64)
    e = vb * BV + tl.arange(0, BV)
    o = tl.zeros([BT, BV], dtype=tl.float32)
    a = tl.zeros([BT, BT], dtype=tl.float32)
    hs = hs_ptr + ((r * NT + c) * H + h).to(tl.int64) * DK * DV
    for k0 in range(0, DK, BK):
        d = k0 + tl.arange(0, BK)
        m = in_l[:, None] & (d < DK)[None, :]
        qt = tl.load(q_ptr + (row * HK + hk)[:, None] * DK + d[None, :], mask=m, other=0.0)
        kt = tl.load(k_ptr + (row * HK + hk)[:, None] * DK + d[None, :], mask=m, other=0.0)
        st = tl.load(hs + d[:, None] * DV + e[None, :], mask=(d < DK)[:, None] & (e < DV)[None, :], other=0.0)
        o += tl.dot(qt, st, input_precision=PRECISION)
        a += tl.dot(qt, tl.trans(kt), input_precision=PRECISION)
    gc = tl.load(gc_ptr + row * H + h, mask=in_l, other=0.0)
    causal = i[:, None] >= i[None, :]
    a = tl.where(causal, a * tl.exp(tl.where(causal, gc[:, None] - gc[None, :], 0.0)), 0.0)
    te = in_l[:, None] & (e < DV)[None, :]
    vn = tl.load(vn_ptr + (row * H + h)[:, None] * DV + e[None, :], mask=te, other=0.0)
    o = o * tl.exp(gc)[:, None] + tl.dot(a, vn, input_precision=PRECISION)
    if GATED:  # the layer's output side: scale, RMSNorm over the head (BV = DV), * norm weight * SiLU(z)
        n = tl.load(len_ptr + r)
        flat = tl.load(start_ptr + r).to(tl.int64) + t  # the token's row in the flat batch
        m = (t < n)[:, None] & (e < DV)[None, :]
        o = o * scale
        o = o * tl.rsqrt(tl.sum(o * o, 1) / DV + eps)[:, None] * tl.load(nw_ptr + e, mask=e < DV, other=0.0)[None, :]
        z = tl.load(z_ptr + flat[:, None] * z_stride + h * DV + e[None, :], mask=m, other=0.0).to(tl.float32)
        o = o * (z * tl.sigmoid(z))
        tl.store(o_ptr + flat[:, None] * (H * DV) + h * DV + e[None, :], o.to(o_ptr.dtype.element_ty), mask=m)
    else:
        tl.store(o_ptr + (row * H + h)[:, None] * DV + e[None, :], o, mask=te)


def _pow2(n: int, at_least: int = 16) -> int:
    return max(at_least, triton.next_power_of_2(n))


@torch.library.custom_op("hydra::chunk_gated_delta_rule", mutates_args=())
def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    lengths: torch.Tensor,
    n_ckpt: int,
    precision: str,
    z: torch.Tensor | None = None,
    norm: torch.Tensor | None = None,
    starts: torch.Tensor | None = None,
    scale: float = 1.0,
    eps: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k [R, L, HK, dk], v [R, L, H, dv], g, beta [R, L, H], state [R, H, dk, dv] (all float32),
    lengths [R] (steps of each row, ≤ L) -> (o [R, L, H, dv]: Sᵀq per step, unscaled; rows' steps past
    their length are left as they fall; the final state [R, H, dk, dv]; ckpt [R, n_ckpt, H, dk, dv]:
    the state j + 1 steps before each row's end, the incoming state where the row is shorter).
    `precision`: tl.dot's input_precision: "tf32", "tf32x3" (float32's accuracy on tensor cores) or "ieee".

    With the output gate z [T, ≥ H * dv] (any float dtype, rows of the flat batch; row r's steps from
    starts[r]) and the norm weight [dv], o is the gated DeltaNet output instead, in z's dtype,
    [T, H * dv] in batch order: RMSNorm(o * scale, eps) * norm * SiLU(z) per head."""
    R, L, HK, DK = k.shape
    H, DV = v.shape[2], v.shape[3]
    if H % HK:
        raise ValueError(f"{H} V heads do not tile {HK} Q/K heads")
    q, k, v, g, beta = (x.float().contiguous() for x in (q, k, v, g, beta))
    state = state.float().contiguous()
    lengths = lengths.to(device=k.device, dtype=torch.int32).contiguous()
    dev = k.device
    NT = triton.cdiv(L, BT)
    f32 = dict(dtype=torch.float32, device=dev)
    w = torch.empty(R, L, H, DK, **f32)
    u = torch.empty(R, L, H, DV, **f32)
    gc = torch.empty(R, L, H, **f32)
    hs = torch.empty(R, NT, H, DK, DV, **f32)
    gated = z is not None
    if gated:
        if norm is None or starts is None or z.stride(1) != 1:
            raise ValueError("a gated output needs z (rows contiguous), norm and starts")
        starts = starts.to(device=dev, dtype=torch.int64).contiguous()
        norm = norm.float().contiguous()
    vn = torch.empty(R, L, H, DV, **f32)
    o = torch.empty(z.shape[0], H * DV, dtype=z.dtype, device=dev) if gated else torch.empty(R, L, H, DV, **f32)
    final = torch.empty(R, H, DK, DV, **f32)
    ckpt = torch.empty(R, n_ckpt, H, DK, DV, **f32)
    BK = min(_pow2(DK), 64)
    shape = dict(H=H, HK=HK, DK=DK, DV=DV, BT=BT, PRECISION=precision)
    cfg = CONFIG
    BV = min(_pow2(DV), 64)
    blocks = cfg["wy_solve"] == "blocks"
    wy = _wy_blocked_kernel if blocks else _wy_kernel
    a = gc if blocks else torch.empty(R * H, NT, BT, BT, **f32)  # -A of each program of _wy_kernel
    wy[(NT, R * H)](
        k,
        v,
        g,
        beta,
        lengths,
        a,
        w,
        u,
        gc,
        L,
        BK=BK,
        BV=BV,
        **shape,
        num_warps=cfg["wy_warps"],
        num_stages=cfg["wy_stages"],
    )
    BV = min(_pow2(DV), cfg["state_bv"])
    _state_kernel[(triton.cdiv(DV, BV), R * H)](
        *(k, w, u, gc, lengths, state, hs, vn, final, ckpt, L, NT),
        **dict(BKS=_pow2(DK), BV=BV, NCK=n_ckpt, **shape, num_warps=cfg["state_warps"], num_stages=cfg["state_stages"]),
    )
    BV = _pow2(DV) if gated else min(_pow2(DV), cfg["out_bv"])  # gated: a whole head per program
    _output_kernel[(triton.cdiv(DV, BV), NT, R * H)](
        *(q, k, gc, hs, vn, o, z if gated else o, norm if gated else o, starts if gated else lengths, lengths),
        *(L, NT, z.stride(0) if gated else 0, scale, eps),
        **dict(
            GATED=gated,
            BK=BK,
            BV=BV,
            **shape,
            num_warps=cfg["out_warps"] * (2 if gated and BV > 64 else 1),
            num_stages=cfg["out_stages"],
        ),
    )
    return o, final, ckpt


@chunk_gated_delta_rule.register_fake
def _(q, k, v, g, beta, state, lengths, n_ckpt, precision, z=None, norm=None, starts=None, scale=1.0, eps=0.0):
    R, L, H, DV = v.shape
    DK = k.shape[3]
    o = z.new_empty(z.shape[0], H * DV) if z is not None else v.new_empty(R, L, H, DV)
    return o, v.new_empty(R, H, DK, DV), v.new_empty(R, n_ckpt, H, DK, DV)
