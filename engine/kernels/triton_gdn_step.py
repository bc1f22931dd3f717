"""A Gated DeltaNet layer's step (decode: one token per slot; a speculative verify: k + 1) in two Triton
kernels: the torch custom op `hydra::gated_delta_step`, what `DeltaNet.step` (model/deltanet.py) runs
on CUDA between its input product and its output side.

The torch form runs ~8 ops over the whole float32 state [n_v_heads, dk, dv] for each token (3.1 MiB a
slot on the 27B), plus a python loop over the tokens for the conv window and a copy for each
checkpoint. Here:

- `_conv_step_kernel`, one program per (head, slot) (Q heads, K heads, V heads, then one for the
  gates): the causal depthwise conv1d over [the slot's conv window | its tokens], SiLU, L2 norms on
  Q and K, g = softplus(α + dt_bias) * ssm_a and β = sigmoid(β), as `triton_gdn_conv` does for
  prefill; and it writes the conv windows in place: the new one onto the slot's state row, checkpoint
  j (1 <= j <= min(m, depth): the window before token m - j) onto its checkpoint row.
- `_rule_step_kernel`, one program per (V tile, slot, V head): the state tile [dk, BV] loaded once
  into registers, the m tokens' recurrence on it,

      S = exp(g) S;   S += k ⊗ β (v - Sᵀk);   o = Sᵀq

  the checkpoints (the state before token t, j = m - t, where m - 1 - t < depth: what the torch form
  writes) and the final state written once.

Rows of `conv_rows` / `ssm_rows` (model/deltanet.py): slot s's state is row s, its checkpoint j is row
`ckpt_row + s * depth + j - 1`. A CUDA graph's padding slot (index >= n_slots) may fill several rows
of a batch: its programs compute outputs from its row and write no state at all (several programs
writing one row while others read it would race; nothing reads that row's contents, and the torch
form's checkpoints land on it only to be overwritten). No host values, static shapes: capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .custom_op import kernel_op

# The recurrence's launch: V columns per program and warps (flash-linear-attention's fused recurrent
# kernel: 8 columns, one warp: many small programs, enough of them to fill the GPU at one slot).
# benchmarks/bench_gdn_step.py --sweep times the alternatives.
CONFIG = {"bv": 8, "warps": 1}


@triton.jit
def _window(x_ptr, win_ptr, x_row, x_stride, c, c_ok, p, KW: tl.constexpr, BW: tl.constexpr):
    """The conv inputs before token p of the slot's run, [BW, channels] (rows >= KW - 1 are 0): input
    tau = p - (KW - 1) + w is the run's token tau, or (tau < 0) the slot's window's column KW - 1 + tau."""
    w = tl.arange(0, BW)
    tau = p - (KW - 1) + w
    use = (w < KW - 1)[:, None] & c_ok[None, :]
    run = tl.load(x_ptr + (x_row + tau)[:, None] * x_stride + c[None, :], mask=use & (tau >= 0)[:, None], other=0.0)
    held = tl.load(win_ptr + c[None, :] * (KW - 1) + (KW - 1 + tau)[:, None], mask=use & (tau < 0)[:, None], other=0.0)
    return run.to(tl.float32) + held


@triton.jit
def _conv_step_kernel(
    x_ptr,
    slot_ptr,
    rows_ptr,
    w_ptr,
    dtb_ptr,
    a_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    b_ptr,
    x_stride,
    n_slots,
    ckpt_row,
    eps,
    M: tl.constexpr,
    DEPTH: tl.constexpr,
    HK: tl.constexpr,
    DK: tl.constexpr,
    HV: tl.constexpr,
    DV: tl.constexpr,
    NCK: tl.constexpr,
    KW: tl.constexpr,
    BM: tl.constexpr,
    BD: tl.constexpr,
    BW: tl.constexpr,
    BH: tl.constexpr,
):
    head = tl.program_id(0)  # Q heads, K heads, V heads, then the gates
    bi = tl.program_id(1)
    slot = tl.load(slot_ptr + bi * M).to(tl.int64)  # rows are slot-major
    t = tl.arange(0, BM)
    ok = t < M
    x_row = bi * M  # the slot's first token in the flat batch
    C: tl.constexpr = 2 * HK * DK + HV * DV
    if head < 2 * HK + HV:
        d = tl.arange(0, BD)
        qk = head < 2 * HK
        c = tl.where(qk, head * DK, 2 * HK * DK + (head - 2 * HK) * DV) + d
        c_ok = d < tl.where(qk, DK, DV)
        state_at = slot * C * (KW - 1)  # the slot's conv window, [C, KW - 1]
        acc = tl.zeros([BM, BD], dtype=tl.float32)
        for j in tl.static_range(KW):
            tau = t - (KW - 1) + j  # the input this tap reads: the run's own, or the window's before it
            m = ok[:, None] & c_ok[None, :]
            xr = tl.load(
                x_ptr + (x_row + tau)[:, None] * x_stride + c[None, :], mask=m & (tau >= 0)[:, None], other=0.0
            )
            xs = tl.load(
                rows_ptr + state_at + c[None, :].to(tl.int64) * (KW - 1) + (KW - 1 + tau)[:, None],
                mask=m & (tau < 0)[:, None],
                other=0.0,
            )
            wj = tl.load(w_ptr + c * KW + j, mask=c_ok, other=0.0)
            acc += (xr.to(tl.float32) + xs) * wj[None, :]
        y = acc * tl.sigmoid(acc)  # SiLU
        if head < 2 * HK:
            y = y * tl.rsqrt(tl.sum(y * y, 1) + eps)[:, None]
            put = ok[:, None] & c_ok[None, :]
            if head < HK:
                tl.store(q_ptr + ((bi * M + t) * HK + head)[:, None] * DK + d[None, :], y, mask=put)
            else:
                tl.store(k_ptr + ((bi * M + t) * HK + head - HK)[:, None] * DK + d[None, :], y, mask=put)
        else:
            rows = (bi * M + t) * HV + (head - 2 * HK)
            tl.store(v_ptr + rows[:, None] * DV + d[None, :], y, mask=ok[:, None] & c_ok[None, :])
        # The windows: checkpoint j before token M - j, then the new state (j = 0), once every read of
        # the state row is done. The padding slot writes none.
        w = tl.arange(0, BW)
        at = c[None, :] * (KW - 1) + w[:, None]
        real = (tl.zeros([BD], tl.int64) + slot) < n_slots  # a block: the interpreter's & takes no scalar
        put = (w < KW - 1)[:, None] & (c_ok & real)[None, :]
        for jj in tl.static_range(NCK):
            win = _window(x_ptr, rows_ptr + state_at, x_row, x_stride, c, c_ok, M - NCK + jj, KW, BW)
            tl.store(rows_ptr + (ckpt_row + slot * DEPTH + NCK - jj - 1) * C * (KW - 1) + at, win, mask=put)
        win = _window(x_ptr, rows_ptr + state_at, x_row, x_stride, c, c_ok, M, KW, BW)
        tl.debug_barrier()
        tl.store(rows_ptr + state_at + at, win, mask=put)
    else:  # names of their own: Triton's compiler merges a name both branches assign, and their shapes differ
        h = tl.arange(0, BH)
        h_ok = h < HV
        gm = ok[:, None] & h_ok[None, :]
        gat = (x_row + t)[:, None] * x_stride + C + HV * DV + h[None, :]
        beta = tl.load(x_ptr + gat, mask=gm, other=0.0).to(tl.float32)
        alpha = tl.load(x_ptr + gat + HV, mask=gm, other=0.0).to(tl.float32)
        z = alpha + tl.load(dtb_ptr + h, mask=h_ok, other=0.0)[None, :]
        soft = tl.where(z > 20.0, z, tl.log(1.0 + tl.exp(tl.minimum(z, 20.0))))  # torch's softplus
        g = soft * tl.load(a_ptr + h, mask=h_ok, other=0.0)[None, :]
        grows = bi * M + t
        tl.store(g_ptr + grows[:, None] * HV + h[None, :], g, mask=gm)
        tl.store(b_ptr + grows[:, None] * HV + h[None, :], tl.sigmoid(beta), mask=gm)


@triton.jit
def _rule_step_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    b_ptr,
    slot_ptr,
    rows_ptr,
    o_ptr,
    n_slots,
    ckpt_row,
    M: tl.constexpr,
    DEPTH: tl.constexpr,
    HK: tl.constexpr,
    DK: tl.constexpr,
    HV: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
):
    vb = tl.program_id(0)
    bh = tl.program_id(1)
    bi = bh // HV
    h = bh % HV
    hk = h % HK  # V head h reads Q/K head h % n_k_heads (ggml's repeat tiles)
    slot = tl.load(slot_ptr + bi * M).to(tl.int64)
    d = tl.arange(0, BK)
    e = vb * BV + tl.arange(0, BV)
    d_ok = d < DK
    e_ok = e < DV
    de = d_ok[:, None] & e_ok[None, :]
    real = (tl.zeros([BV], tl.int64) + slot) < n_slots  # a block: the interpreter's & takes no scalar
    put = d_ok[:, None] & (e_ok & real)[None, :]  # the padding slot writes no state
    SZ: tl.constexpr = HV * DK * DV  # one row of ssm_rows
    at = h * DK * DV + d[:, None] * DV + e[None, :]  # this tile in a row
    state = tl.load(rows_ptr + slot * SZ + at, mask=de, other=0.0)
    for t in tl.static_range(M):
        if M - 1 - t < DEPTH:  # checkpoint j = M - t: the state before token t
            tl.store(rows_ptr + (ckpt_row + slot * DEPTH + (M - t - 1)) * SZ + at, state, mask=put)
        row = bi * M + t
        q = tl.load(q_ptr + (row * HK + hk) * DK + d, mask=d_ok, other=0.0)
        k = tl.load(k_ptr + (row * HK + hk) * DK + d, mask=d_ok, other=0.0)
        v = tl.load(v_ptr + (row * HV + h) * DV + e, mask=e_ok, other=0.0)
        g = tl.load(g_ptr + row * HV + h)
        beta = tl.load(b_ptr + row * HV + h)
        state = state * tl.exp(g)
        delta = (v - tl.sum(state * k[:, None], 0)) * beta
        state = state + k[:, None] * delta[None, :]
        tl.store(o_ptr + (row * HV + h) * DV + e, tl.sum(state * q[:, None], 0), mask=e_ok)
    tl.debug_barrier()
    tl.store(rows_ptr + slot * SZ + at, state, mask=put)


@kernel_op("hydra::gated_delta_step", mutates_args=("conv_rows", "ssm_rows"))
def gated_delta_step(
    proj: torch.Tensor,
    slots: torch.Tensor,
    conv_rows: torch.Tensor,
    ssm_rows: torch.Tensor,
    conv_w: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_a: torch.Tensor,
    per_slot: int,
    n_slots: int,
    ckpt_row: int,
    depth: int,
    n_k_heads: int,
    eps: float,
) -> torch.Tensor:
    """proj [B * per_slot, P] (the layer's input product, any float dtype; each row Q|K|V conv input,
    z, β, α), slots [B * per_slot] (slot-major: per_slot rows of each slot), conv_rows [rows, C,
    conv_kernel - 1] and ssm_rows [rows, n_v_heads, dk, dv] float32 (states, then checkpoints from
    row ckpt_row: slot s's j-th at ckpt_row + s * depth + j - 1), conv_w [C, conv_kernel], dt_bias,
    ssm_a [n_v_heads] -> Sᵀq per token [B * per_slot, n_v_heads, dv] float32 (unscaled); advances each
    slot's conv and SSM state by its tokens and writes the checkpoints, in place."""
    T = proj.shape[0]
    B, M = T // per_slot, per_slot
    _, C, KW1 = conv_rows.shape
    _, HV, DK, DV = ssm_rows.shape
    HK = n_k_heads
    if C != 2 * HK * DK + HV * DV or proj.shape[1] < C + HV * DV + 2 * HV or proj.stride(1) != 1:
        raise ValueError("proj / conv_rows / ssm_rows do not match the heads")
    if not (
        conv_rows.is_contiguous() and ssm_rows.is_contiguous() and conv_rows.dtype == ssm_rows.dtype == torch.float32
    ):
        raise ValueError("conv_rows and ssm_rows must be contiguous float32")
    dev = proj.device
    f32 = dict(dtype=torch.float32, device=dev)
    q = torch.empty(T, HK, DK, **f32)
    k = torch.empty(T, HK, DK, **f32)
    v = torch.empty(T, HV, DV, **f32)
    g = torch.empty(T, HV, **f32)
    b = torch.empty(T, HV, **f32)
    o = torch.empty(T, HV, DV, **f32)
    slots = slots.to(device=dev, dtype=torch.int64).contiguous()
    heads = dict(M=M, DEPTH=depth, HK=HK, DK=DK, HV=HV, DV=DV)
    _conv_step_kernel[(2 * HK + HV + 1, B)](
        *(proj, slots, conv_rows, conv_w.float().contiguous(), dt_bias.float().contiguous()),
        *(ssm_a.float().contiguous(), q, k, v, g, b, proj.stride(0), n_slots, ckpt_row, eps),
        **heads,
        NCK=min(M, depth),
        KW=KW1 + 1,
        BM=max(2, triton.next_power_of_2(M)),
        BD=max(16, triton.next_power_of_2(max(DK, DV))),
        BW=max(2, triton.next_power_of_2(KW1)),
        BH=max(16, triton.next_power_of_2(HV)),
        num_warps=4,
    )
    BV = min(CONFIG["bv"], triton.next_power_of_2(DV))
    _rule_step_kernel[(triton.cdiv(DV, BV), B * HV)](
        *(q, k, v, g, b, slots, ssm_rows, o, n_slots, ckpt_row),
        **heads,
        BK=max(16, triton.next_power_of_2(DK)),
        BV=BV,
        num_warps=CONFIG["warps"],
    )
    return o


@gated_delta_step.register_fake
def _(proj, slots, conv_rows, ssm_rows, conv_w, dt_bias, ssm_a, per_slot, n_slots, ckpt_row, depth, n_k_heads, eps):
    return proj.new_empty(proj.shape[0], ssm_rows.shape[1], ssm_rows.shape[3], dtype=torch.float32)
