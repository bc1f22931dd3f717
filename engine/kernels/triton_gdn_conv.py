"""The front of a Gated DeltaNet layer over long runs (qwen35's prefill) in one Triton kernel: the
torch custom op `hydra::gdn_conv_gates`.

From the layer's input product (model/deltanet.py: per token the conv input Q|K|V, the output gate z,
β and α, in this order) it computes, per run, what the gated delta rule reads:

- the causal depthwise conv1d over [the slot's conv state | the run] (`conv_kernel` taps) and SiLU,
- Q and K heads L2-normalised (x / sqrt(sum(x²) + eps), llama.cpp's build_gdn_l2_norm),
- g = softplus(α + dt_bias) * ssm_a and β = sigmoid(β),

written as runs padded to one length [R, L, ...] (steps past a run's length are zeros), in float32,
without the intermediate tensors of the torch form (the conv input gathered, the taps summed, SiLU,
the norms, the gates: a pass over the whole activation each). One program per (tile of BT tokens,
head, run): a head's channels are the unit the L2 norm needs; one more program per tile makes the
gates.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .custom_op import kernel_op


@triton.jit
def _conv_gates_kernel(
    x_ptr,
    cs_ptr,
    w_ptr,
    dtb_ptr,
    a_ptr,
    start_ptr,
    len_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    b_ptr,
    x_stride,
    L,
    eps,
    HK: tl.constexpr,
    DK: tl.constexpr,
    HV: tl.constexpr,
    DV: tl.constexpr,
    KW: tl.constexpr,
    BT: tl.constexpr,
    BD: tl.constexpr,
    BH: tl.constexpr,
):
    tb = tl.program_id(0)
    head = tl.program_id(1)  # Q heads, K heads, V heads, then the gates
    r = tl.program_id(2)
    n = tl.load(len_ptr + r)
    start = tl.load(start_ptr + r).to(tl.int64)
    t = tb * BT + tl.arange(0, BT)
    ok = t < n
    in_l = t < L
    C: tl.constexpr = 2 * HK * DK + HV * DV
    if head < 2 * HK + HV:
        d = tl.arange(0, BD)
        qk = head < 2 * HK
        c = tl.where(qk, head * DK, 2 * HK * DK + (head - 2 * HK) * DV) + d
        c_ok = d < tl.where(qk, DK, DV)
        acc = tl.zeros([BT, BD], dtype=tl.float32)
        for j in tl.static_range(KW):
            tau = t - (KW - 1) + j  # the input this tap reads: the run's own, or the conv state's before it
            run = ok & (tau >= 0)
            xr = tl.load(
                x_ptr + (start + tau)[:, None] * x_stride + c[None, :], mask=run[:, None] & c_ok[None, :], other=0.0
            )
            st = ok & (tau < 0)
            xs = tl.load(
                cs_ptr + (r * C + c[None, :]).to(tl.int64) * (KW - 1) + (KW - 1 + tau)[:, None],
                mask=st[:, None] & c_ok[None, :],
                other=0.0,
            )
            wj = tl.load(w_ptr + c * KW + j, mask=c_ok, other=0.0)
            acc += (xr.to(tl.float32) + xs) * wj[None, :]
        y = acc * tl.sigmoid(acc)  # SiLU
        y = tl.where(ok[:, None], y, 0.0)
        if head < HK:
            y = y * tl.rsqrt(tl.sum(y * y, 1) + eps)[:, None]
            rows = ((r * L + t) * HK + head).to(tl.int64)
            tl.store(q_ptr + rows[:, None] * DK + d[None, :], y, mask=in_l[:, None] & c_ok[None, :])
        elif head < 2 * HK:
            y = y * tl.rsqrt(tl.sum(y * y, 1) + eps)[:, None]
            rows = ((r * L + t) * HK + (head - HK)).to(tl.int64)
            tl.store(k_ptr + rows[:, None] * DK + d[None, :], y, mask=in_l[:, None] & c_ok[None, :])
        else:
            rows = ((r * L + t) * HV + (head - 2 * HK)).to(tl.int64)
            tl.store(v_ptr + rows[:, None] * DV + d[None, :], y, mask=in_l[:, None] & c_ok[None, :])
    else:
        h = tl.arange(0, BH)
        h_ok = h < HV
        m = ok[:, None] & h_ok[None, :]
        at = (start + t)[:, None] * x_stride + C + HV * DV + h[None, :]
        beta = tl.load(x_ptr + at, mask=m, other=0.0).to(tl.float32)
        alpha = tl.load(x_ptr + at + HV, mask=m, other=0.0).to(tl.float32)
        z = alpha + tl.load(dtb_ptr + h, mask=h_ok, other=0.0)[None, :]
        soft = tl.where(z > 20.0, z, tl.log(1.0 + tl.exp(tl.minimum(z, 20.0))))  # torch's softplus
        g = tl.where(m, soft * tl.load(a_ptr + h, mask=h_ok, other=0.0)[None, :], 0.0)
        b = tl.where(m, tl.sigmoid(beta), 0.0)
        rows = (r * L + t).to(tl.int64)
        tl.store(g_ptr + rows[:, None] * HV + h[None, :], g, mask=in_l[:, None] & h_ok[None, :])
        tl.store(b_ptr + rows[:, None] * HV + h[None, :], b, mask=in_l[:, None] & h_ok[None, :])


@kernel_op("hydra::gdn_conv_gates")
def gdn_conv_gates(
    proj: torch.Tensor,
    conv_state: torch.Tensor,
    conv_w: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_a: torch.Tensor,
    starts: torch.Tensor,
    lengths: torch.Tensor,
    L: int,
    n_k_heads: int,
    head_k_dim: int,
    n_v_heads: int,
    head_v_dim: int,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """proj [T, P] (the layer's input product, any float dtype; each row Q|K|V conv input, z, β, α),
    conv_state [R, C, conv_kernel - 1] float32 (each run's slot's), conv_w [C, conv_kernel], dt_bias,
    ssm_a [n_v_heads]; runs r of lengths[r] tokens from row starts[r] -> padded to L steps, float32:
    (q, k [R, L, n_k_heads, head_k_dim] L2-normed, v [R, L, n_v_heads, head_v_dim], g, β [R, L, n_v_heads])."""
    R, C, KW1 = conv_state.shape
    HK, DK, HV, DV = n_k_heads, head_k_dim, n_v_heads, head_v_dim
    if C != 2 * HK * DK + HV * DV or proj.shape[1] < C + HV * DV + 2 * HV or proj.stride(1) != 1:
        raise ValueError("proj / conv_state do not match the heads")
    dev = proj.device
    f32 = dict(dtype=torch.float32, device=dev)
    q = torch.empty(R, L, HK, DK, **f32)
    k = torch.empty(R, L, HK, DK, **f32)
    v = torch.empty(R, L, HV, DV, **f32)
    g = torch.empty(R, L, HV, **f32)
    b = torch.empty(R, L, HV, **f32)
    BT = 32
    _conv_gates_kernel[(triton.cdiv(L, BT), 2 * HK + HV + 1, R)](
        proj,
        conv_state.float().contiguous(),
        conv_w.float().contiguous(),
        dt_bias.float().contiguous(),
        ssm_a.float().contiguous(),
        starts.to(device=dev, dtype=torch.int64).contiguous(),
        lengths.to(device=dev, dtype=torch.int32).contiguous(),
        q,
        k,
        v,
        g,
        b,
        proj.stride(0),
        L,
        eps,
        HK=HK,
        DK=DK,
        HV=HV,
        DV=DV,
        KW=KW1 + 1,
        BT=BT,
        BD=max(16, triton.next_power_of_2(max(DK, DV))),
        BH=max(16, triton.next_power_of_2(HV)),
        num_warps=4,
    )
    return q, k, v, g, b


@gdn_conv_gates.register_fake
def _(proj, conv_state, conv_w, dt_bias, ssm_a, starts, lengths, L, n_k_heads, head_k_dim, n_v_heads, head_v_dim, eps):
    R = conv_state.shape[0]
    new = proj.new_empty
    return (
        new(R, L, n_k_heads, head_k_dim, dtype=torch.float32),
        new(R, L, n_k_heads, head_k_dim, dtype=torch.float32),
        new(R, L, n_v_heads, head_v_dim, dtype=torch.float32),
        new(R, L, n_v_heads, dtype=torch.float32),
        new(R, L, n_v_heads, dtype=torch.float32),
    )
