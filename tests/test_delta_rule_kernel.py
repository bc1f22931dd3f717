"""The Triton chunked gated delta rule (`hydra::chunk_gated_delta_rule`, qwen35's prefill on CUDA)
against the token-by-token recurrence of model/deltanet.py: outputs, final states and the rollback
checkpoints, over several chunk counts, a partial last chunk, runs of different lengths padded
together, a non-zero incoming state and V heads sharing Q/K heads; and a synthetic qwen35 whose
prefill goes through the kernel against the same model through the torch forms. On CPU it runs under
Triton's interpreter (TRITON_INTERPRET=1, tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch
from kernel_device import KERNEL_DEVICE, needs_kernels
from stages import load

from hydra_console.engine.model import ROLLBACK, deltanet

pytestmark = needs_kernels


def token_by_token(q, k, v, g, b, state, lengths, n_ckpt):
    """DeltaNet's recurrence (its `_delta_rule` loop), steps past a row's length held (g = 0, β = 0):
    (Sᵀq per step, final state, the states 1..n_ckpt steps before each row's end)."""
    R, L, H, _ = v.shape
    rep = H // k.shape[2]
    q, k = q.repeat(1, 1, rep, 1), k.repeat(1, 1, rep, 1)  # V head h reads Q/K head h % n_k_heads
    on = (torch.arange(L)[None, :] < lengths[:, None])[..., None]
    g, b = g * on, b * on
    out, states = torch.empty(R, L, H, v.shape[3]), [state]
    for t in range(L):
        state = state * torch.exp(g[:, t, :, None, None])
        kv = (k[:, t, :, None, :] @ state).squeeze(-2)
        delta = (v[:, t] - kv) * b[:, t, :, None]
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        out[:, t] = (q[:, t, :, None, :] @ state).squeeze(-2)
        states.append(state)
    every = torch.stack(states, 1)  # [R, L + 1, ...]: the state after step t at t + 1
    at = (lengths[:, None] - torch.arange(n_ckpt)[None, :] - 1).clamp(min=0)  # before the row: incoming
    return out, state, every[torch.arange(R)[:, None], at]


def inputs(R, L, H, HK, dk, dv, lengths, seed=0):
    """Random q, k (L2-normed, as DeltaNet's), v, gates as DeltaNet computes them, a non-zero state;
    steps past each row's length are poison the kernel must not read."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(R, L, HK, dk, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(R, L, HK, dk, generator=gen), dim=-1)
    v = torch.randn(R, L, H, dv, generator=gen)
    g = torch.nn.functional.softplus(torch.randn(R, L, H, generator=gen)) * -torch.rand(H, generator=gen).exp()
    b = torch.sigmoid(torch.randn(R, L, H, generator=gen))
    state = 0.5 * torch.randn(R, H, dk, dv, generator=gen)
    lengths = torch.tensor(lengths)
    past = torch.arange(L)[None, :] >= lengths[:, None]
    for x, poison in ((q, 1e4), (k, 1e4), (v, 1e4), (g, 80.0), (b, 1e4)):
        x[past] = poison
    return q, k, v, g, b, state, lengths


@pytest.mark.unit
@pytest.mark.parametrize(
    "R, L, H, HK, dk, dv, lengths",
    [
        (1, 64, 2, 2, 16, 16, [64]),  # one whole chunk
        (2, 150, 4, 2, 32, 16, [150, 97]),  # 3 chunks, the last partial; a shorter row padded; GQA
        (1, 130, 2, 1, 16, 32, [130]),  # 3 chunks, 2 steps in the last; two V heads on one Q/K head
    ],
)
def test_kernel_equals_the_token_by_token_recurrence(R, L, H, HK, dk, dv, lengths):
    from hydra_console.engine.kernels.triton_delta_rule import chunk_gated_delta_rule

    args = inputs(R, L, H, HK, dk, dv, lengths)
    want_o, want_state, want_ckpt = token_by_token(*args, ROLLBACK)
    dev = [x.to(KERNEL_DEVICE) for x in args]
    o, state, ckpt = (x.cpu() for x in chunk_gated_delta_rule(*dev, ROLLBACK, "ieee"))
    valid = torch.arange(L)[None, :] < args[-1][:, None]
    torch.testing.assert_close(o[valid], want_o[valid], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(state, want_state, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(ckpt, want_ckpt, atol=2e-5, rtol=1e-5)


@pytest.mark.unit
def test_the_blocked_solve_equals_the_token_by_token_recurrence(monkeypatch):
    """`CONFIG["wy_solve"] = "blocks"` (T = (I + A)⁻¹ by 16 x 16 blocks): a partial second chunk, GQA."""
    from hydra_console.engine.kernels import triton_delta_rule

    monkeypatch.setitem(triton_delta_rule.CONFIG, "wy_solve", "blocks")
    args = inputs(1, 100, 2, 1, 16, 16, [100])
    want_o, want_state, want_ckpt = token_by_token(*args, ROLLBACK)
    o, state, ckpt = (
        x.cpu()
        for x in triton_delta_rule.chunk_gated_delta_rule(*[x.to(KERNEL_DEVICE) for x in args], ROLLBACK, "ieee")
    )
    torch.testing.assert_close(o, want_o, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(state, want_state, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(ckpt, want_ckpt, atol=2e-5, rtol=1e-5)


@pytest.mark.unit
def test_a_short_row_checkpoints_its_incoming_state():
    """Rows shorter than the checkpoints reach: those before their first step are the incoming state."""
    from hydra_console.engine.kernels.triton_delta_rule import chunk_gated_delta_rule

    args = inputs(2, 20, 2, 1, 16, 16, [20, 3])
    _, want_state, want_ckpt = token_by_token(*args, ROLLBACK)
    _, state, ckpt = chunk_gated_delta_rule(*[x.to(KERNEL_DEVICE) for x in args], ROLLBACK, "ieee")
    torch.testing.assert_close(state.cpu(), want_state, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(ckpt.cpu(), want_ckpt, atol=2e-5, rtol=1e-5)


def test_qwen35_prefill_through_the_kernels_equals_the_torch_forms(tiny_model, monkeypatch):
    """A tiny qwen35 (one Gated DeltaNet layer, 4 V heads on 2 Q/K heads), with the kernels forced on
    (under the interpreter on CPU) against them off: two long runs padded together (every run long:
    the conv + gates kernel, then the chunked rule's), one long run going on from its slot's state,
    a long run beside a short one, then one token each (on the kernels every run of an eager batch
    takes the chunked form); then short prompts, one token each again; logits, states and
    checkpoints."""
    path = tiny_model("qwen35", n_layers=2)
    ids = torch.randint(0, 600, (100,), generator=torch.Generator().manual_seed(1)).tolist()
    batches = [  # (tokens, slots, positions)
        (ids + ids[:80], [0] * 100 + [1] * 80, [*range(100), *range(80)]),
        (ids[:70], [1] * 70, [*range(80, 150)]),  # from a conv and SSM state
        (ids[:70] + ids[:3], [0] * 70 + [2] * 3, [*range(100, 170), *range(3)]),
        ([5, 6, 7], [0, 1, 2], [170, 150, 3]),
        # short prompts (the chunked kernels below a chunk): 9 and 6 tokens from their slots' states,
        # then 12 alone (the conv + gates kernel's shortest runs are longer than its windows)
        (ids[:9] + ids[:6], [0] * 9 + [1] * 6, [*range(171, 180), *range(151, 157)]),
        (ids[20:32], [2] * 12, [*range(4, 16)]),
        ([8, 9, 10], [0, 1, 2], [180, 157, 16]),
    ]

    def forward(kernel: bool):
        monkeypatch.setattr(deltanet, "TRITON_PREFILL", kernel)
        stage = load(path, n_slots=3, device=KERNEL_DEVICE)
        logits = []
        for batch in batches:
            tokens, slots, positions = (torch.tensor(x, device=KERNEL_DEVICE) for x in batch)
            logits.append(stage.logits(stage.run_layers(stage.embed(tokens), slots, positions)).cpu())
        # The last batch ran one token a slot: checkpoint 1 is its runs' (the others are no one's).
        states = [(n.ssm_state, n.ssm_ckpt[:, :1], n.conv_state, n.conv_ckpt[:, :1]) for n in stage.recurrent]
        return logits, [[x.cpu() for x in layer] for layer in states]

    logits, states = forward(True)
    want_logits, want_states = forward(False)
    print(
        f"kernels vs torch forms: max |dlogit| {max(float((a - b).abs().max()) for a, b in zip(logits, want_logits)):.2e}"
    )
    for got, want in zip(logits, want_logits):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    for got, want in zip(states, want_states):
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)
