"""The CUDA path (bf16 weights, SDPA prefill, graph-captured decode) against the CPU float32 reference.

Runs only where torch sees a CUDA device; the tiny models make it quick.
"""

from __future__ import annotations

import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from hydra_console.engine.gguf_file import GGUFFile
from hydra_console.engine.model import ModelConfig, Stage, build_stage

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPT = [2, 17, 300, 45, 99, 512, 7, 8, 540, 33, 21, 5, 600, 64, 71, 12]


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.cpu().double() - ref.double()).norm() / ref.double().norm()).item()


def run(stage: Stage, tokens, slots, positions) -> torch.Tensor:
    h = stage.run_layers(stage.embed(torch.tensor(tokens)), torch.tensor(slots), torch.tensor(positions))
    return stage.logits(h)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3", "qwen35"])
def test_cuda_bf16_matches_cpu_float32(tiny_model, arch):
    g = GGUFFile(tiny_model(arch, n_layers=3))
    cpu = build_stage(g, device="cpu", dtype="float32", n_slots=3, n_ctx=64)
    gpu = build_stage(g, device="cuda", dtype="bfloat16", n_slots=3, n_ctx=64)
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
    assert (2, 1) in gpu.graphs.graphs  # the decode steps really went through a captured graph


def test_graph_replay_equals_eager_on_cuda(tiny_model):
    g = GGUFFile(tiny_model("gemma3"))
    graphed = build_stage(g, device="cuda", dtype="float32", n_slots=2, n_ctx=64)
    eager = build_stage(g, device="cuda", dtype="float32", n_slots=2, n_ctx=64)
    eager.graphs = None
    for stage in (graphed, eager):
        run(stage, PROMPT, [1] * len(PROMPT), list(range(len(PROMPT))))
    for i in range(12):  # past the synthetic window of 8
        a = run(graphed, [30 + i], [1], [len(PROMPT) + i])
        b = run(eager, [30 + i], [1], [len(PROMPT) + i])
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen35"])
def test_graph_verify_runs_and_short_batches_equal_eager_on_cuda(tiny_model, arch):
    """Verify batches (k + 1 tokens per slot) replay their own graphs; a batch smaller than its
    bucket after a full one leaves the rows it does not fill to the padding slot (they once ran the
    earlier batch's slots again: their KV rewritten, a recurrent state advanced)."""
    g = GGUFFile(tiny_model(arch, n_layers=3))
    graphed = build_stage(g, device="cuda", dtype="float32", n_slots=4, n_ctx=64)
    eager = build_stage(g, device="cuda", dtype="float32", n_slots=4, n_ctx=64)
    eager.graphs = None
    for stage in (graphed, eager):
        for slot in range(4):
            run(stage, PROMPT[slot:], [slot] * (len(PROMPT) - slot), list(range(len(PROMPT) - slot)))
    pos = [len(PROMPT) - s for s in range(4)]
    # 1 token per slot (decode), then 2 and 3 (verifies); each time 4 slots, then 3 in the same bucket of 4
    steps = [(1, [0, 1, 2, 3]), (1, [0, 1, 2]), (2, [0, 1, 2, 3]), (2, [1, 2, 3]), (3, [0, 1, 2, 3]), (3, [0, 2, 3])]
    for i, (m, slots) in enumerate(steps):
        tokens = [30 + i + t for s in slots for t in range(m)]
        rows = [s for s in slots for _ in range(m)]
        positions = [pos[s] + t for s in slots for t in range(m)]
        torch.testing.assert_close(
            run(graphed, tokens, rows, positions), run(eager, tokens, rows, positions), atol=1e-4, rtol=1e-4
        )
        for s in slots:
            pos[s] += m
    assert {(4, 1), (4, 2), (4, 3)} <= set(graphed.graphs.graphs)


@pytest.mark.parametrize("arch,kv", [("llama", "auto"), ("gemma3", "q8_0")])
def test_prefill_graphs_equal_eager_on_cuda(tiny_model, arch, kv):
    """A prompt from position 0 replays its length bucket's graph (rows past the prompt are padding);
    its logits, and the decode steps after it, equal the eager path's (gemma3: sliding window of 8)."""
    g = GGUFFile(tiny_model(arch, n_layers=3, head_dim=32))
    graphed, eager = (
        build_stage(g, device="cuda", dtype="float32", n_slots=2, n_ctx=64, kv_types=(kv, kv)) for _ in range(2)
    )
    eager.graphs = eager.prefill_graphs = eager.head_graphs = None
    for n, slot in ((12, 0), (16, 1), (5, 0)):  # buckets 16, 16, 8
        prompt = PROMPT[:n]
        torch.testing.assert_close(
            run(graphed, prompt, [slot] * n, list(range(n))),
            run(eager, prompt, [slot] * n, list(range(n))),
            atol=1e-4,
            rtol=1e-4,
        )
        for i in range(3):
            torch.testing.assert_close(
                run(graphed, [30 + i], [slot], [n + i]), run(eager, [30 + i], [slot], [n + i]), atol=1e-4, rtol=1e-4
            )
    assert set(graphed.prefill_graphs.graphs) == {8, 16}


@pytest.mark.parametrize("arch", ["llama", "gemma3"])  # gemma3: the final soft-cap
def test_head_graphs_equal_the_eager_head(tiny_model, arch):
    """The output head replayed from its row bucket's graph (rows past the batch are padding) gives
    the eager head's logits; more rows than the largest bucket run eagerly."""
    g = GGUFFile(tiny_model(arch, n_layers=2))
    stage = build_stage(g, device="cuda", dtype="bfloat16", n_slots=3, n_ctx=64)
    h = torch.randn(5, stage.cfg.n_embd, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    for rows in (1, 2, 3):
        torch.testing.assert_close(
            stage.logits(h[:rows]), stage.project(stage.final_norm(h[:rows])), atol=2e-3, rtol=2e-3
        )
    assert set(stage.head_graphs.graphs) == {1, 2, 3} and stage.head_graphs.run(h) is None


@pytest.fixture
def cuda_peer(tiny_model, tmp_path):
    """A `hydra-engine peer --device cuda` process on this GPU and the model it serves. Graphs without
    torch.compile on both sides and in the solo stage: the split is compared like with like (compiled
    kernels are fused per layer range, so a different range may round differently)."""
    from rpc_workers import Worker, free_ports

    path = tiny_model("llama", n_layers=4)
    port, rpc = free_ports(2)
    peer = Worker("peer", ["--model", str(path), "--device", "cuda", "--no-compile"], tmp_path, port, rpc)
    try:
        peer.wait_ready()
        yield peer, path
    finally:
        peer.stop()


def split_pipeline(peer, path, cuda_ipc: bool = True):
    from hydra_console.engine.config import HeadConfig, ModelSettings, RpcSettings
    from hydra_console.engine.workers.head_pipeline import build_pipeline

    g = GGUFFile(path)
    cfg = HeadConfig(
        ModelSettings(str(path), "cuda", "bfloat16", 64, compile=False),
        RpcSettings(cuda_ipc=cuda_ipc),
        parallel=2,
        peers=(peer.rpc_addr,),
        split="2/2",
        peer_wait=30.0,
    )
    return build_pipeline(cfg, g, ModelConfig.from_gguf(g))


def solo_pipeline(path):
    from hydra_console.engine.pipeline import Pipeline

    g = GGUFFile(path)
    return Pipeline(build_stage(g, device="cuda", dtype="bfloat16", n_slots=2, n_ctx=64))


def greedy_logits(pipe, steps: int = 6) -> torch.Tensor:
    """Prefill PROMPT in slot 0, then `steps` graph-replayed decode steps fed from the device."""
    n = len(PROMPT)
    logits = [
        pipe.forward(torch.tensor(PROMPT), torch.zeros(n, dtype=torch.long), torch.arange(n), torch.tensor([n - 1]))
    ]
    for i in range(steps):
        tok = logits[-1].argmax(-1)
        logits.append(pipe.forward(tok, torch.tensor([0]), torch.tensor([n + i]), torch.tensor([0])))
    return torch.stack([x.cpu() for x in logits])


@pytest.mark.parametrize("transport, rows", [("socket", None), ("cuda-ipc", None), ("cuda-ipc", 4)])
def test_split_across_two_cuda_processes_equals_solo(cuda_peer, monkeypatch, transport, rows):
    """Head here on the GPU, the second half in a peer process on the same GPU: prefill and
    graph-replayed decode logits equal the solo stage's bit for bit, whether the residual stream
    crosses as raw float32 in the frames (HYDRA_CUDA_IPC=0) or stays on the GPU (CUDA IPC; with
    4-row buffers the 16-token prefill takes the frames and the decode steps the channel, and the
    head waits for the peer on the host, as it does for long batches)."""
    from hydra_console.engine.rpc import cuda_ipc, peer_ipc

    peer, path = cuda_peer
    if rows:
        monkeypatch.setattr(peer_ipc, "IPC_TOKENS", rows)
        monkeypatch.setattr(cuda_ipc, "HOST_WAIT_ROWS", 1)
    split, solo = split_pipeline(peer, path, cuda_ipc=transport != "socket"), solo_pipeline(path)
    try:
        remote = split.remotes[0]
        assert remote.transport == transport and remote.status().transport == transport
        logits = greedy_logits(split)
        assert torch.equal(greedy_logits(solo), logits)
        # The decode steps' tokens stayed on the GPU; the KV-rebuild history still has them all.
        split.history.flush()
        fed = torch.cat([torch.tensor(PROMPT), logits[:-1, 0].argmax(-1)])
        assert torch.equal(split.history.tokens(0, 0, len(fed)), fed)
        # A decode step's frame carries the hidden state (float32) only on the socket path.
        sent_before = remote.bytes_sent
        split.forward(torch.tensor([5]), torch.tensor([1]), torch.tensor([0]), torch.tensor([0]))
        assert (remote.bytes_sent - sent_before > 4 * split.cfg.n_embd) == (transport == "socket")
        assert split.local.graphs.graphs and remote.device.startswith("cuda")
    finally:
        split.stop()


def test_cuda_ipc_peer_killed_mid_decode_fails_fast_and_recovers(cuda_peer):
    """kill -9 of a peer that shares the GPU through CUDA IPC: with no --peer-grace (streams pausing
    for it to come back) the next step fails within 2 s (PeerUnavailable), the head's GPU stream is
    not left waiting on the dead peer's event, and
    a restarted peer is re-attached with a fresh channel that gives the solo logits again."""
    import threading
    import time

    from rpc_workers import wait_for

    from hydra_console.engine.rpc.client import PeerUnavailable

    peer, path = cuda_peer
    split, solo = split_pipeline(peer, path), solo_pipeline(path)
    try:
        remote = split.remotes[0]
        assert remote.transport == "cuda-ipc"
        split.recovery.grace = 0.0
        greedy_logits(split, steps=3)
        peer.kill9()
        t0 = time.monotonic()
        with pytest.raises(PeerUnavailable):
            for _ in range(100):
                greedy_logits(split, steps=3)
        assert time.monotonic() - t0 < 2.0
        synced = threading.Event()
        threading.Thread(target=lambda: (torch.cuda.synchronize(), synced.set()), daemon=True).start()
        assert synced.wait(10), "the head's GPU work hangs after the peer died"
        peer.start()
        peer.wait_ready()
        wait_for(lambda: remote.state == "up", 30, "the head to re-attach the restarted peer")
        assert remote.transport == "cuda-ipc"
        assert not remote._retired  # the dead peer's mapping was dropped once our stream was idle
        for slot in range(2):
            split.clear_slot(slot)
        assert torch.equal(greedy_logits(solo), greedy_logits(split))
    finally:
        split.stop()


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q4_K_M"])
def test_weights_stay_quantized_and_agree_with_bf16(tiny_model, qtype):
    """GGUF-quantized weights stay quantized on the GPU (kernels), and top-1 agrees with the same
    weights expanded to bfloat16 wherever that is decisive, prefill and graph-replayed decode."""
    g = GGUFFile(
        tiny_model("llama", n_layers=2, n_embd=512, n_head=8, n_head_kv=4, n_ff=1024, qtype=qtype, vocab_size=2048)
    )
    opts = dict(device="cuda", dtype="bfloat16", n_slots=2, n_ctx=320)
    quant, dense = build_stage(g, quantized=True, **opts), build_stage(g, quantized=False, **opts)
    # Held at the file's bits per weight (the widest type of a mix), not at bf16's 16.
    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType["Q6_K" if qtype == "Q4_K_M" else qtype]]
    assert (
        quant.weight_bytes < dense.weight_bytes * (type_size / block / 2 * 1.05 + 0.05) and not quant.weights.expanded
    )
    prompt = torch.randint(0, 2048, (256,), generator=torch.Generator().manual_seed(1)).tolist()
    q_rows = [run(quant, prompt, [0] * 256, list(range(256)))]
    d_rows = [run(dense, prompt, [0] * 256, list(range(256)))]
    token = q_rows[0][-1].argmax().item()
    for i in range(32):
        q_rows.append(run(quant, [token], [0], [256 + i]))
        d_rows.append(run(dense, [token], [0], [256 + i]))
        token = q_rows[-1][-1].argmax().item()
    q, d = torch.cat(q_rows).cpu(), torch.cat(d_rows).cpu()
    err = rel_err(q, d)
    # Random weights leave near-ties that bfloat16 rounding flips either way: top-1 must agree (the
    # issue's 0.99) wherever the dense lead over the runner-up is 4x the typical error, and that must
    # be most positions. Measured 0.996-1.0 (one flip in 288 positions on Q6_K and Q4_K_M).
    top2 = d.topk(2, dim=-1).values
    decisive = (top2[:, 0] - top2[:, 1]) > 4 * err * d.pow(2).mean(-1).sqrt()
    agree = (q.argmax(-1) == d.argmax(-1))[decisive].float().mean().item()
    print(
        f"{qtype}: top-1 agreement {agree:.4f} on {decisive.float().mean().item():.1%} decisive positions, "
        f"rel err {err:.2e}, weights {quant.weight_bytes / 2**20:.1f} MiB vs bf16 {dense.weight_bytes / 2**20:.1f} MiB"
    )
    assert err < 2e-2 and decisive.float().mean() >= 0.8 and agree >= 0.99 and (1, 1) in quant.graphs.graphs


def test_staging_moves_every_slice_whole_while_the_device_works():
    """A load's slices through the two page-locked buffers (`device.Staging`): more slices than
    buffers, of several sizes, each queued while the device still works on the ones before (a
    product per slice), arrive byte for byte; a slice larger than the buffers takes the plain path."""
    from hydra_console.engine.device import Staging

    staging = Staging(torch.device("cuda"), 1 << 20)
    gen = torch.Generator().manual_seed(0)
    slices = [
        torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
        for n in (1 << 20, 777, 1 << 19, 5, 1 << 20, 3 << 20)
    ]
    busy = torch.randn(2048, 2048, device="cuda")
    moved = []
    for s in slices:
        moved.append(staging.to_device(s))
        busy = busy @ busy / 2048  # the device's queue stays ahead of the host
    for s, m in zip(slices, moved):
        assert m.device.type == "cuda" and torch.equal(m.cpu(), s)
