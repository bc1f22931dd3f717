"""The Triton step kernels (`hydra::gated_delta_step`, DeltaNet.step on CUDA) against the torch form
of `DeltaNet.step`: outputs, the new conv and SSM states and every checkpoint, for 1..4 tokens per slot
(decode, verifies), checkpoint depths 1..3, several head shapes, batches where a CUDA graph's padding
slot fills several rows. On CPU it runs under Triton's interpreter (TRITON_INTERPRET=1,
tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch
from kernel_device import KERNEL_DEVICE, needs_kernels
from stages import load

from hydra_console.engine.model import ForwardBatch, deltanet
from hydra_console.engine.model.deltanet import DeltaNet
from hydra_console.engine.model.layer import block

pytestmark = needs_kernels
N_SLOTS = 3


def step_both_ways(path, monkeypatch, m: int, depth: int, slots: list[int], seed: int = 0):
    """One DeltaNet layer (with the padding slot's row) stepped through the torch form and through
    the kernels from the same random states and checkpoints: [(output, conv_rows, ssm_rows)] of each."""
    stage = load(path, n_slots=N_SLOTS, device=KERNEL_DEVICE)
    il = next(il for il, layer in stage.layers.items() if layer.deltanet is not None)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(len(slots) * m, stage.cfg.n_embd, generator=gen).to(KERNEL_DEVICE)
    rows = torch.tensor([s for s in slots for _ in range(m)], device=KERNEL_DEVICE)
    conv, ssm = None, None
    results = []
    for kernel in (False, True):
        monkeypatch.setattr(deltanet, "TRITON_PREFILL", kernel)
        net = DeltaNet(stage.cfg, stage.weights, f"blk.{il}.", N_SLOTS, depth, True)
        if conv is None:
            conv = torch.randn(net.conv_rows.shape, generator=gen).to(KERNEL_DEVICE)
            ssm = (0.3 * torch.randn(net.ssm_rows.shape, generator=gen)).to(KERNEL_DEVICE)
        net.conv_rows.copy_(conv)
        net.ssm_rows.copy_(ssm)
        out = net.step(x, rows, per_slot=m)
        results.append((out.cpu(), net.conv_rows.cpu(), net.ssm_rows.cpu()))
    return results, conv.cpu(), ssm.cpu()


HEADS = [(2, 4, 16), (1, 3, 16), (2, 2, 32)]  # Q/K heads, V heads, head dims
# Every shape at every depth on a GPU; under the interpreter (~25 s a case) each shape and each depth once.
STEP_CASES = [(h, d) for h in HEADS for d in (1, 2, 3)] if KERNEL_DEVICE == "cuda" else list(zip(HEADS, (1, 2, 3)))


@pytest.mark.parametrize("heads,depth", STEP_CASES)
def test_the_step_kernels_equal_the_torch_step(tiny_model, monkeypatch, heads, depth):
    """Every m = 1..4 tokens per slot, slots out of order and the padding slot (row N_SLOTS) repeated
    between them: the real slots' outputs, states and checkpoints as the torch form's; the padding
    slot's rows are written by neither the kernels nor any real slot."""
    hk, hv, dim = heads
    path = tiny_model("qwen35", n_layers=2, ssm_groups=hk, ssm_v_heads=hv, ssm_state=dim)
    slots = [2, N_SLOTS, 0, N_SLOTS]
    real = torch.tensor([s < N_SLOTS for s in slots])
    for m in range(1, 5):
        ((want, want_conv, want_ssm), (got, got_conv, got_ssm)), conv, ssm = step_both_ways(
            path, monkeypatch, m, depth, slots, seed=m
        )
        keep = real.repeat_interleave(m)
        torch.testing.assert_close(got[keep], want[keep], atol=1e-5, rtol=1e-5)
        others = torch.arange(got_conv.shape[0]) != N_SLOTS  # every row but the padding slot's
        torch.testing.assert_close(got_conv[others], want_conv[others], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got_ssm[others], want_ssm[others], atol=1e-5, rtol=1e-5)
        assert torch.equal(got_conv[N_SLOTS], conv[N_SLOTS]) and torch.equal(got_ssm[N_SLOTS], ssm[N_SLOTS])
        assert torch.isfinite(got[~keep]).all()
        # the step moved the real slots' states and wrote min(m, depth) checkpoints of each
        assert not torch.equal(got_ssm[0], ssm[0]) and not torch.equal(got_conv[2], conv[2])
        first = N_SLOTS + 1
        for s in range(N_SLOTS):
            for j in range(1, depth + 1):
                row = first + s * depth + j - 1
                touched = s in slots and j <= m
                assert torch.equal(got_ssm[row], ssm[row]) != touched, (m, depth, s, j)


def test_a_step_after_a_prefill_through_the_stage(tiny_model, monkeypatch):
    """A whole tiny qwen35 stage: a prompt in each of two slots, then a 4-token verify of both through
    the batched (graph) path, kernels on against off: logits, states and checkpoints."""
    path = tiny_model("qwen35", n_layers=4)
    ids = torch.randint(0, 600, (24,), generator=torch.Generator().manual_seed(3)).tolist()

    def run(kernel: bool):
        monkeypatch.setattr(deltanet, "TRITON_PREFILL", kernel)
        stage = load(path, n_slots=2, device=KERNEL_DEVICE)
        dev = KERNEL_DEVICE
        for slot in (0, 1):
            n = 10 + 4 * slot
            stage.run_layers(
                stage.embed(torch.tensor(ids[:n], device=dev)),
                torch.full((n,), slot, device=dev),
                torch.arange(n, device=dev),
            )
        tokens = torch.tensor(ids[10:14] + ids[14:18], device=dev)
        slots = torch.tensor([0] * 4 + [1] * 4, device=dev)
        positions = torch.tensor([*range(10, 14), *range(14, 18)], device=dev)
        h = stage.embed(tokens).to(dev, torch.float32)
        h = stage.forward(h, ForwardBatch.batched(slots, positions, 4, stage.n_ctx))
        states = [x.cpu() for net in stage.recurrent for x in (net.conv_rows, net.ssm_rows)]
        return stage.logits(h).cpu(), states

    logits, states = run(True)
    want_logits, want_states = run(False)
    torch.testing.assert_close(logits, want_logits, atol=2e-5, rtol=1e-5)
    for got, want in zip(states, want_states):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_the_step_kernels_stay_whole_in_the_compiled_block(tiny_model, monkeypatch):
    """The decode graphs torch.compile one layer (`layer.block`): the custom op, which writes the
    states in place, traces into one graph (fullgraph) and, functionalised as inductor would (aot_eager),
    advances the states as the eager kernels do."""
    monkeypatch.setattr(deltanet, "TRITON_PREFILL", True)
    path = tiny_model("qwen35", n_layers=4)
    dev = KERNEL_DEVICE
    stage, eager = load(path, device=dev), load(path, device=dev)
    ids = torch.arange(12, device=dev)
    for s in (stage, eager):
        s.run_layers(s.embed(ids + 5), torch.zeros(12, dtype=torch.long), ids)
    torch._dynamo.reset()
    compiled = torch.compile(block, backend="aot_eager", dynamic=False, fullgraph=True)
    h = stage.embed(torch.tensor([7, 8], device=dev)).to(dev, torch.float32)
    slots, positions = torch.tensor([0, 0], device=dev), torch.tensor([12, 13], device=dev)
    batch = ForwardBatch.batched(slots, positions, 2, stage.n_ctx)
    traced = stage.forward(h, batch, block=compiled)
    torch.testing.assert_close(traced, eager.forward(h, batch), atol=1e-6, rtol=1e-6)
    for a, b in zip(stage.recurrent, eager.recurrent):
        torch.testing.assert_close(a.ssm_rows, b.ssm_rows, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(a.conv_rows, b.conv_rows, atol=1e-6, rtol=1e-6)
