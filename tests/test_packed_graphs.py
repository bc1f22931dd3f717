"""A recurrent stage's short mixed steps through `PackedGraphs` (one CUDA graph per token bucket, the
runs on the device only) against the same steps run eagerly through the torch forms: prompts of
several slots together, a prompt beside decoding slots, verifies of uneven lengths, runs from a
slot's state, rows padding a bucket, the slots' contexts in a shared pool (`--kv-unified`);
logits, recurrent states and their rollback checkpoints, and a rolled-back draft. On a GPU the
stage captures real graphs; on CPU the kernels run under Triton's interpreter and the graph is a
stand-in that runs the captured step again (a CUDA graph replays the same kernels)."""

from __future__ import annotations

import pytest
import torch
from kernel_device import KERNEL_DEVICE, needs_kernels
from stages import load

from hydra_console.engine.model import deltanet
from hydra_console.engine.model.graphs import PackedGraphs, packed_input
from hydra_console.engine.model.kv_blocks import KV_BLOCK

pytestmark = needs_kernels


class _Replayed:
    """A CUDA graph's stand-in where there is none: `replay` runs the captured step into its output."""

    def __init__(self, step, out):
        self.step, self.out = step, out

    def replay(self):
        self.out.copy_(self.step())


class _CpuCapture:
    def capture(self, step):
        out = step()
        return _Replayed(step, out), out


def test_packed_input_lays_out_rows_runs_and_padding():
    got = packed_input([(2, 7, 3), (0, 0, 2)], size=8, n_runs=4, pad_slot=3, n_ctx=100)
    assert got == [
        *(2, 2, 2, 0, 0, 3, 3, 3),  # rows' slots: the runs', then the padding slot's
        *(7, 8, 9, 0, 1, 100, 101, 102),  # positions: the padding rows' past the context
        *(2, 0, 3, 3),  # runs' slots: two empty runs on the padding slot
        *(3, 2, 0, 0),  # lengths
        *(0, 3, 5, 5),  # first rows
    ]


def test_packed_steps_equal_the_eager_torch_forms(tiny_model, monkeypatch):
    path = tiny_model("qwen35", n_layers=2)  # a Gated DeltaNet layer, then an attention layer
    ids = torch.randint(0, 600, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    steps = [  # (slot, first position, tokens) of each run; runs of one length would replay a decode graph
        [(0, 0, 11), (1, 0, 6)],  # two prompts together, 17 rows in a bucket of 32
        [(0, 11, 1), (2, 0, 9), (1, 6, 1)],  # a prompt beside two decoding slots
        [(0, 12, 4), (1, 7, 2), (2, 9, 1)],  # verifies of uneven lengths and a decode
        [(0, 14, 1), (1, 9, 2), (2, 10, 1)],  # slot 0's last 2 verified tokens rejected: from a checkpoint
    ]

    def run(packed: bool):
        monkeypatch.setattr(deltanet, "TRITON_PREFILL", packed)
        # The users' `--kv-unified` pool: the padding slot's positions land in the pool's scratch block.
        stage = load(path, n_slots=3, n_ctx=64, device=KERNEL_DEVICE, graph_padding=True, kv_pool=3 * KV_BLOCK)
        if packed and stage.graphs is None:
            stage.packed_graphs = PackedGraphs(stage, _CpuCapture())
        logits, states = [], []
        for runs in steps:
            tokens = [ids[(p0 + j + 5 * slot) % 40] for slot, p0, n in runs for j in range(n)]
            slots = [slot for slot, _, n in runs for _ in range(n)]
            positions = [p for _, p0, n in runs for p in range(p0, p0 + n)]
            h = stage.run_layers(stage.embed(torch.tensor(tokens)), torch.tensor(slots), torch.tensor(positions))
            logits.append(stage.logits(h).cpu())
            for net in stage.recurrent:  # each run's slot: its state, and the checkpoints its run made
                for slot, _, n in runs:
                    j = min(n, net.depth)
                    got = (net.ssm_state[slot], net.conv_state[slot], net.ssm_ckpt[slot, :j], net.conv_ckpt[slot, :j])
                    states += [t.to("cpu", copy=True) for t in got]  # not views: the next step writes them
        return logits, states, stage.steps

    logits, states, paths = run(True)
    want_logits, want_states, _ = run(False)
    assert paths["packed graph"] == len(steps), paths
    print(f"packed vs eager: max |dlogit| {max(float((a - b).abs().max()) for a, b in zip(logits, want_logits)):.2e}")
    for got, want in zip(logits, want_logits):
        torch.testing.assert_close(got, want, atol=3e-5, rtol=1e-5)
    for got, want in zip(states, want_states, strict=True):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("runs", [[(0, 0, 40)], [(0, 3300, 20), (1, 0, 2)]])
def test_steps_past_a_packed_graphs_limits_run_eagerly(tiny_model, runs):
    """More tokens than the largest bucket, or rows that would read long contexts one by one."""
    stage = load(tiny_model("qwen35", n_layers=2), n_slots=2, n_ctx=4096, device=KERNEL_DEVICE, graph_padding=True)
    graphs = PackedGraphs(stage, _CpuCapture())
    graphs.buckets = graphs.buckets[:2]  # 16 and 32 tokens
    h = torch.zeros(sum(n for *_, n in runs), stage.cfg.n_embd, device=KERNEL_DEVICE)
    assert graphs.run(h, runs) is None and not graphs.graphs
