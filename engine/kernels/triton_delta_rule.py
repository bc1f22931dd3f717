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

Three kernels: `wy_kernel` (`triton_wy.py`: one program per (chunk, row, head): gc, A, T, w, u; every chunk at once;
`wy_blocked_kernel` solves T by 16 x 16 blocks instead, `CONFIG["wy_solve"]`), `_state_kernel` (one
per (V tile, row, head), looping over the chunks: U and the state entering each chunk, the final
state and the checkpoints), `_output_kernel` (one per (V tile, chunk, row, head): o; given the layer's
output gate z and norm weight, a whole head per program and the layer's output side applied:
RMSNorm(o · scale) · norm · SiLU(z), written in z's dtype where the flat batch has the token).
Products (tl.dot) in TF32 for a 16-bit model, "tf32x3" (three TF32 products: float32's accuracy) for a
float32 one; on an H100 at the 27B shape the rule takes 0.42 / 1.67 / 6.0 ms at 512 / 4096 / 16384
tokens in TF32 (the torch forms: 9.5 / 22 / 56 ms), see benchmarks/bench_delta_rule.py.

Rows are runs padded to one length L; row r's steps past lengths[r] are absent (read as g = 0,
β = 0, k = 0: the state stays), so the final state is the one after its last step; the chunks
wholly past them are skipped (a row of no steps costs its state's copy). Besides it, the
op returns the states `1..n_ckpt` steps before each row's end (the draft-rollback checkpoints).
Q/K heads are shared GQA-style as ggml tiles them: V head h reads Q/K head h % n_k_heads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .custom_op import kernel_op
from .triton_wy import wy_blocked_kernel, wy_kernel

BT = 64  # tokens per chunk (llama.cpp's and fla's)
# Launch settings: V tile and warps of the state recurrence (its programs: V tiles x rows x heads, each
# walking every chunk), of the output, and the WY kernel's warps (its forward substitution is serial:
# fewer warps, less synchronisation). The fastest of benchmarks/bench_delta_rule.py --sweep on an H100
# at 512, 4096 and 16384 tokens of the 27B shape (state_bv 64 does not fit shared memory).
# `*_stages`: software-pipelining depth of each kernel's loops (Triton's num_stages; deeper stages hold
# more tiles in shared memory, fewer programs fit a multiprocessor).
# `wy_solve`: T = (I + A)⁻¹ by rows ("rows": 63 serial steps on the 64 x 64 tile) or by 16 x 16 blocks
# ("blocks": `wy_blocked_kernel`).
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
    c = tl.full([], 0, tl.int32)  # a tensor: the loop carries it
    while c * BT < n:  # the chunks past the row's end leave the state as it is: not computed (nor read)
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
        c += 1
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
    n = tl.load(len_ptr + r)
    if c * BT >= n:  # a chunk past the row's end: its steps' outputs are no one's
        return
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


@kernel_op("hydra::chunk_gated_delta_rule")
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
    # Gated: rows of the flat batch no run covers (a PACKED graph's padding rows) are zeros.
    o = torch.zeros(z.shape[0], H * DV, dtype=z.dtype, device=dev) if gated else torch.empty(R, L, H, DV, **f32)
    final = torch.empty(R, H, DK, DV, **f32)
    ckpt = torch.empty(R, n_ckpt, H, DK, DV, **f32)
    BK = min(_pow2(DK), 64)
    shape = dict(H=H, HK=HK, DK=DK, DV=DV, BT=BT, PRECISION=precision)
    cfg = CONFIG
    BV = min(_pow2(DV), 64)
    blocks = cfg["wy_solve"] == "blocks"
    wy = wy_blocked_kernel if blocks else wy_kernel
    a = gc if blocks else torch.empty(R * H, NT, BT, BT, **f32)  # -A of each program of wy_kernel
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
