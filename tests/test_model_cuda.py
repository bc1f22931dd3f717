"""The CUDA path (bf16 weights, SDPA prefill, graph-captured decode) against the CPU float32 reference.

Runs only where torch sees a CUDA device; the tiny models make it quick.
"""

from __future__ import annotations

import pytest
import torch

from hydra_console.engine.gguf_file import GGUFFile
from hydra_console.engine.model import ModelConfig, Stage

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPT = [2, 17, 300, 45, 99, 512, 7, 8, 540, 33, 21, 5, 600, 64, 71, 12]


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.cpu().double() - ref.double()).norm() / ref.double().norm()).item()


def run(stage: Stage, tokens, slots, positions) -> torch.Tensor:
    h = stage.run_layers(stage.embed(torch.tensor(tokens)), torch.tensor(slots), torch.tensor(positions))
    return stage.logits(h)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_cuda_bf16_matches_cpu_float32(tiny_model, arch):
    g = GGUFFile(tiny_model(arch, n_layers=3))
    cfg = ModelConfig.from_gguf(g)
    cpu = Stage(cfg, g, device="cpu", dtype="float32", n_slots=3, n_ctx=64)
    gpu = Stage(cfg, g, device="cuda", dtype="bfloat16", n_slots=3, n_ctx=64)
    assert gpu.graphs is not None
    n = len(PROMPT)
    # prefill two slots, then three graph-replayed batched decode steps over both
    for slot, prompt in ((0, PROMPT), (2, PROMPT[:9])):
        ref = run(cpu, prompt, [slot] * len(prompt), list(range(len(prompt))))
        got = run(gpu, prompt, [slot] * len(prompt), list(range(len(prompt))))
        assert rel_err(got, ref) < 2e-2
    pos = [n, 9]
    for step in range(3):
        tokens = [40 + step, 50 + step]
        ref = run(cpu, tokens, [0, 2], pos)
        got = run(gpu, tokens, [0, 2], pos)
        assert rel_err(got, ref) < 2e-2, step
        picked = got.cpu().argmax(-1)  # random weights have near-ties: the pick must be near-best under fp32
        assert (ref.gather(1, picked[:, None])[:, 0] >= ref.max(-1).values - 0.1).all()
        pos = [p + 1 for p in pos]
    assert 2 in gpu.graphs.graphs  # the decode steps really went through a captured graph


def test_graph_replay_equals_eager_on_cuda(tiny_model):
    g = GGUFFile(tiny_model("gemma3"))
    cfg = ModelConfig.from_gguf(g)
    graphed = Stage(cfg, g, device="cuda", dtype="float32", n_slots=2, n_ctx=64)
    eager = Stage(cfg, g, device="cuda", dtype="float32", n_slots=2, n_ctx=64)
    eager.graphs = None
    for stage in (graphed, eager):
        run(stage, PROMPT, [1] * len(PROMPT), list(range(len(PROMPT))))
    for i in range(12):  # past the synthetic window of 8
        a = run(graphed, [30 + i], [1], [len(PROMPT) + i])
        b = run(eager, [30 + i], [1], [len(PROMPT) + i])
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_split_across_two_cuda_processes_equals_solo(tiny_model, tmp_path):
    """Head here on the GPU, a `hydra-engine peer --device cuda` process with the second half:
    prefill and graph-replayed decode logits equal the solo stage's bit for bit (the residual
    stream crosses the wire as raw float32)."""
    import types

    from rpc_workers import Worker, free_ports

    from hydra_console.engine.pipeline import Pipeline, build_pipeline

    path = tiny_model("llama", n_layers=4)
    g = GGUFFile(path)
    cfg = ModelConfig.from_gguf(g)
    port, rpc = free_ports(2)
    peer = Worker("peer", ["--model", str(path), "--device", "cuda"], tmp_path, port, rpc)
    try:
        peer.wait_ready()
        args = types.SimpleNamespace(peer=[peer.rpc_addr], split="2/2", device="cuda", dtype="bfloat16", peer_wait=30.0,
                                     fallback_solo=False, auth_token=None, max_frame=1 << 30)  # fmt: skip
        split = build_pipeline(args, g, cfg, n_slots=2, n_ctx=64)
        solo = Pipeline(Stage(cfg, g, device="cuda", dtype="bfloat16", n_slots=2, n_ctx=64))
        n = len(PROMPT)
        outs = []
        for pipe in (solo, split):
            logits = [pipe.forward(torch.tensor(PROMPT), torch.zeros(n, dtype=torch.long), torch.arange(n), torch.tensor([n - 1]))]
            for i in range(6):
                tok = logits[-1].argmax(-1)
                logits.append(pipe.forward(tok, torch.tensor([0]), torch.tensor([n + i]), torch.tensor([0])))
            outs.append(torch.stack([x.cpu() for x in logits]))
        split.stop()
        assert torch.equal(outs[0], outs[1])
        assert split.head.graphs.graphs and split.remotes[0].device.startswith("cuda")
    finally:
        peer.stop()
