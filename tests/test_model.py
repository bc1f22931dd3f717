"""The model on tiny synthetic files: every architecture, split stages, batching, windows, errors."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from stages import load, prefill

from hydra_console.contracts.footprint import model_tensors
from hydra_console.engine.errors import UserError
from hydra_console.engine.gguf_file import GGUFFile
from hydra_console.engine.model import ForwardBatch, ModelConfig, build_stage
from hydra_console.engine.model.layer import block

ARCHS = ["llama", "qwen2", "qwen3", "gemma3"]


PROMPT = [2, 17, 300, 45, 99, 512, 7, 8, 540, 33, 21, 5, 600, 64, 71, 12, 13, 14, 15, 16]


@pytest.mark.parametrize("arch", ARCHS)
def test_architecture_config(tiny_model, arch):
    cfg = ModelConfig.from_gguf(GGUFFile(tiny_model(arch)))
    assert cfg.rope_neox == (arch != "llama")
    assert cfg.qkv_bias == (arch == "qwen2")
    assert cfg.qk_norm == (arch in ("qwen3", "gemma3"))
    assert cfg.tied == (arch == "gemma3")
    assert (cfg.activation == "gelu_tanh") == (arch == "gemma3")
    assert cfg.embed_scale == (8.0 if arch == "gemma3" else 1.0)
    assert cfg.swa_layers == ((True, True) if arch == "gemma3" else (False, False))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_equals_token_by_token_decode(tiny_model, arch, dtype):
    stage = load(tiny_model(arch), dtype=dtype)
    full = prefill(stage, PROMPT)
    assert full.shape == (len(PROMPT), stage.cfg.n_vocab) and full.dtype == torch.float32
    assert torch.isfinite(full).all() and full.std() > 0.1
    stage.kv_clear(0)
    steps = [prefill(stage, [t], start=i) for i, t in enumerate(PROMPT)]
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == "float32" else dict(atol=0.15, rtol=0.05)
    torch.testing.assert_close(torch.cat(steps), full, **tol)


# Each device in its default compute dtype; CUDA where there is one (`pytest -o addopts=""` there).
DEVICES = [
    pytest.param("cpu", "float32", id="cpu"),
    pytest.param("cpu", "bfloat16", id="cpu-bf16"),
    pytest.param("cuda", "bfloat16", id="cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")),
]


@pytest.mark.parametrize("device,dtype", DEVICES)
@pytest.mark.parametrize("arch", ARCHS)
def test_split_stages_are_bit_identical_to_one_stage(tiny_model, arch, device, dtype):
    path = tiny_model(arch, n_layers=3)
    whole = load(path, device=device, dtype=dtype)
    first = load(path, layers=(0, 1), head=False, device=device, dtype=dtype)
    rest = load(path, layers=(1, 3), embed=False, device=device, dtype=dtype)
    tokens, slots, pos = torch.tensor(PROMPT), torch.zeros(len(PROMPT), dtype=torch.long), torch.arange(len(PROMPT))
    expected = whole.logits(whole.run_layers(whole.embed(tokens), slots, pos))
    got = rest.logits(rest.run_layers(first.run_layers(first.embed(tokens), slots, pos), slots, pos))
    assert torch.equal(got, expected)


@pytest.mark.parametrize("device,dtype", DEVICES)
def test_identical_sequences_in_one_batch_get_identical_logits(tiny_model, device, dtype):
    """Three slots, one prompt: prefilled in one forward, then decoded together; every row the
    same floats at every step (what identical greedy requests that share their steps rely on)."""
    stage = load(tiny_model("gemma3", n_layers=2), device=device, dtype=dtype, n_slots=3, n_ctx=64)
    n, slots = len(PROMPT), [0, 1, 2]
    h = stage.run_layers(
        stage.embed(torch.tensor(PROMPT * 3)), torch.tensor(slots).repeat_interleave(n), torch.arange(n).repeat(3)
    )
    logits = stage.logits(h[n - 1 :: n])
    for step in range(4):
        assert all(torch.equal(logits[i], logits[0]) for i in slots), step
        token = int(logits[0].argmax())
        h = stage.run_layers(stage.embed(torch.tensor([token] * 3)), torch.tensor(slots), torch.tensor([n + step] * 3))
        logits = stage.logits(h)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_batched_decode_equals_each_slot_alone(tiny_model, arch):
    path = tiny_model(arch)
    prompts = [PROMPT[:5], PROMPT[3:12], PROMPT[7:10]]
    batched, alone = load(path), load(path)
    for slot, p in enumerate(prompts):
        prefill(batched, p, slot=slot)
    next_tokens = [41, 42, 43]
    positions = [len(p) for p in prompts]
    h = batched.run_layers(batched.embed(torch.tensor(next_tokens)), torch.tensor([0, 1, 2]), torch.tensor(positions))
    got = batched.logits(h)
    for slot, p in enumerate(prompts):
        alone.kv_clear(0)
        want = prefill(alone, p + [next_tokens[slot]])[-1]
        torch.testing.assert_close(got[slot], want, atol=1e-4, rtol=1e-4)


def test_mixed_batch_prefill_chunk_and_decode(tiny_model):
    """One forward holding a prompt chunk of slot 1 and a decode token of slot 0 (continuous batching)."""
    path = tiny_model("qwen2")
    stage, ref = load(path), load(path)
    prefill(stage, PROMPT[:6], slot=0)
    prefill(stage, PROMPT[:4], slot=1)
    tokens = torch.tensor([PROMPT[6]] + PROMPT[4:9])
    slots = torch.tensor([0, 1, 1, 1, 1, 1])
    positions = torch.tensor([6, 4, 5, 6, 7, 8])
    got = stage.logits(stage.run_layers(stage.embed(tokens), slots, positions))
    want0 = prefill(ref, PROMPT[:7])[-1]
    ref.kv_clear(0)
    want1 = prefill(ref, PROMPT[:9])[4:]
    torch.testing.assert_close(got[0], want0, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[1:], want1, atol=1e-4, rtol=1e-4)
    # /status's count of how each pass ran: the mixed step said so, the prompts before it (no graphs on CPU) too
    assert stage.steps == {"eager: slots run different lengths": 1, "eager: no graphs": 2}


def test_rewritten_positions_roll_back_the_kv(tiny_model):
    stage = load(tiny_model("qwen3"))
    prefill(stage, PROMPT[:10])
    again = prefill(stage, [5, 6, 7], start=4)  # overwrite positions 4..6, as a rejected draft does
    stage2 = load(tiny_model("qwen3"))
    torch.testing.assert_close(again, prefill(stage2, PROMPT[:4] + [5, 6, 7])[4:], atol=1e-4, rtol=1e-4)


def test_sliding_window_limits_what_a_token_sees(tiny_model):
    """Two gemma3 window layers of 8: position p depends on tokens >= p - 14 only; llama sees everything."""
    a = PROMPT + [100, 101, 102, 103]
    b = [3, 4, 5, 6] + a[4:]
    p = len(a) - 1  # 23: first 4 tokens are outside its two-layer window reach (>= 9)
    gemma = load(tiny_model("gemma3"))
    la = prefill(gemma, a)[p]
    lb = prefill(gemma, b)[p]
    torch.testing.assert_close(la, lb, atol=1e-5, rtol=1e-5)
    llama = load(tiny_model("llama"))
    assert not torch.allclose(prefill(llama, a)[p], prefill(llama, b)[p], atol=1e-3)


def test_assign_rematerialises_layers(tiny_model):
    path = tiny_model("llama", n_layers=4)
    stage = load(path, layers=(0, 2), embed=False, head=False)
    stage.assign(2, 4)
    assert sorted(stage.layers) == [2, 3]
    fresh = load(path, layers=(2, 4), embed=False, head=False)
    h = torch.randn(5, 64)
    slots, pos = torch.zeros(5, dtype=torch.long), torch.arange(5)
    assert torch.equal(stage.run_layers(h, slots, pos), fresh.run_layers(h, slots, pos))
    with pytest.raises(UserError, match="outside"):
        stage.assign(3, 9)


def test_int8_weights_track_float32(tiny_model):
    """CPU int8 weights: two-term layers, one-term head whose top logits are recomputed exactly."""
    path = tiny_model("gemma3")
    exact = load(path, dtype="float32")
    fast = load(path, dtype="bfloat16", int8=True)
    assert fast.output.weight.dtype == torch.int8 and fast.layers[0].w_down.terms == 2
    e, f = prefill(exact, PROMPT), prefill(fast, PROMPT)
    assert torch.equal(e.argmax(-1), f.argmax(-1))
    top = e.topk(5).indices
    torch.testing.assert_close(f.gather(1, top), e.gather(1, top), atol=0.1, rtol=0.02)
    assert ((f - e).norm() / e.norm()).item() < 0.02


def test_errors_are_user_errors(tiny_model, tmp_path):
    stage = load(tiny_model("llama"), n_ctx=16)
    with pytest.raises(UserError, match="prompt too long"):
        prefill(stage, PROMPT)  # 20 tokens, context 16
    with pytest.raises(UserError, match="slot 7"):
        prefill(stage, [1, 2], slot=7)
    g = GGUFFile(tiny_model("llama"))
    del g.tensors["blk.1.ffn_up.weight"]
    with pytest.raises(UserError, match="blk.1.ffn_up.weight"):
        build_stage(g)

    w = gguf.GGUFWriter(str(tmp_path / "rwkv.gguf"), "rwkv6")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(UserError, match="unsupported model architecture 'rwkv6'"):
        ModelConfig.from_gguf(GGUFFile(tmp_path / "rwkv.gguf"))


def test_unsupported_quant_type_is_a_user_error(tmp_path):
    from hydra_console.engine.synth import write_synthetic

    path = write_synthetic(tmp_path / "tq.gguf", "llama", n_embd=256, n_ff=256, qtype="TQ1_0")
    with pytest.raises(UserError, match="TQ1_0"):
        load(path)


def test_graph_decode_path_matches_per_slot_attention(tiny_model):
    """The gathered, position-masked attention that CUDA graphs capture gives the per-run result."""
    path = tiny_model("gemma3")
    a, b = load(path), load(path)
    for stage in (a, b):
        prefill(stage, PROMPT[:12], slot=0)
        prefill(stage, PROMPT[:3], slot=2)
    h = a.embed(torch.tensor([7, 9]))
    slots, positions = torch.tensor([2, 0]), torch.tensor([3, 12])
    eager = a.run_layers(h, slots, positions)
    graphed = b.forward(h, ForwardBatch.batched(slots, positions, 1, b.n_ctx))
    torch.testing.assert_close(graphed, eager, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch, kinds", [("llama", 1), ("gemma3", 1), ("qwen35", 2)])
def test_the_compiled_region_is_traced_once_per_layer_kind(tiny_model, arch, kinds):
    """The decode graphs compile one layer (`layer.block`), not the stack: every layer of a kind
    reuses one trace (Qwen3.5: recurrent and attention; on CPU a window reaches the block only as
    its mask), so a bucket's warm-up traces one layer per kind."""
    from torch._dynamo.utils import counters

    path = tiny_model(arch, n_layers=4)
    stage, eager = load(path), load(path)  # a recurrent layer's step advances its state: one run each
    for s in (stage, eager):
        prefill(s, PROMPT[:12], slot=0)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(block, backend="eager", dynamic=False)
    h, slots, positions = stage.embed(torch.tensor([7])), torch.tensor([0]), torch.tensor([12])
    batch = ForwardBatch.batched(slots, positions, 1, stage.n_ctx)
    traced = stage.forward(h, batch, block=compiled)
    assert counters["stats"]["unique_graphs"] == kinds
    torch.testing.assert_close(traced, eager.forward(h, batch))


@pytest.mark.parametrize("draft_max, graphs", [(0, 3 + 3), (3, 5 + 6)])
def test_a_start_compiles_one_graph_per_layer_kind_and_shape(tiny_model, monkeypatch, draft_max, graphs):
    """What a GPU worker's start compiles (`DecodeGraphs.warm_up`: every batch bucket x run length of
    `graph_run_lengths`, 1 and draft max + 1 (shorter verifies are padded to it), `-np 4`: buckets 1,
    2, 4): an attention layer's graph depends on its row count only (5 of them with MTP's 3 drafts:
    1, 2, 4, 8, 16), a recurrent layer's on its slots and run length (6), never on the layer or the
    call. Counted on CPU with dynamo's eager backend (the CUDA path compiles the same region over the
    same shapes). Every run length 1..4 warmed up, as before, took 8 + 12."""
    from torch._dynamo.utils import counters

    from hydra_console.engine.model.graphs import batch_buckets, graph_run_lengths

    stage = load(tiny_model("qwen35", n_layers=4, nextn=True), n_slots=4)
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 64)  # as DecodeGraphs raises it
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(block, backend="eager", dynamic=False)
    for m in graph_run_lengths(1 + draft_max):
        for size in batch_buckets(stage.n_slots):
            slots, positions = torch.arange(size).repeat_interleave(m), torch.arange(m).repeat(size) + 8
            for _ in range(2):  # as a capture's warm-up: the second run compiles nothing
                stage.forward(
                    torch.randn(size * m, stage.cfg.n_embd),
                    ForwardBatch.batched(slots, positions, m, 512),
                    block=compiled,
                )
    assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.parametrize("kv", ["auto", "q8_0"])
def test_prefill_graph_path_matches_the_eager_prompt(tiny_model, kv):
    """What the CUDA prefill graphs capture: one slot's prompt padded to its bucket, with no host
    values (sliding window from positions on the device), gives the eager rows, and the KV it leaves
    (padding rows written past the prompt) continues the same decode."""
    path = tiny_model("gemma3", head_dim=32)  # a sliding window of 8: the 12-token prompt needs the mask
    a, b = load(path, n_ctx=32, kv_types=(kv, kv)), load(path, n_ctx=32, kv_types=(kv, kv))
    n, size = 12, 16
    eager = a.run_layers(a.embed(torch.tensor(PROMPT[:n])), torch.ones(n, dtype=torch.long), torch.arange(n))
    h = b.embed(torch.tensor(PROMPT[:size]))
    graphed = b.forward(h, ForwardBatch.fresh(torch.ones(size, dtype=torch.long), torch.arange(size)))
    torch.testing.assert_close(graphed[:n], eager, atol=1e-5, rtol=1e-5)
    b.recurrent_progress.ran([(1, 0, n)])  # what run_layers notes after the graphs ran the prompt
    for i, t in enumerate([7, 9, 11]):
        step = [
            stage.logits(stage.run_layers(stage.embed(torch.tensor([t])), torch.tensor([1]), torch.tensor([n + i])))
            for stage in (a, b)
        ]
        torch.testing.assert_close(step[1], step[0], atol=1e-5, rtol=1e-5)


def test_converted_weights_cache_is_reused_and_repaired(tiny_model, tmp_path, monkeypatch):
    from hydra_console.engine.model import weights

    monkeypatch.setattr(weights, "_CACHE_MIN_FILE_BYTES", 0)
    path = tiny_model("qwen3")
    first = prefill(load(path, dtype="bfloat16", int8=True, cache_dir=tmp_path), PROMPT)
    files = sorted(tmp_path.rglob("*.pt"))
    assert len(files) == 2 * 4 + 1  # 4 products per layer, 2 layers, the head
    files[0].write_bytes(b"not a tensor file")
    again = prefill(load(path, dtype="bfloat16", int8=True, cache_dir=tmp_path), PROMPT)
    assert torch.equal(first, again)
    assert files[0].stat().st_size > 100  # the damaged entry was rebuilt


def test_default_cache_dir_follows_the_environment(tmp_path):
    from hydra_console.engine.config import default_cache_dir

    assert default_cache_dir({"HYDRA_CACHE_DIR": str(tmp_path)}) == tmp_path
    assert default_cache_dir({"HYDRA_CACHE_DIR": "off"}) is None
    assert default_cache_dir({}) == Path.home() / ".cache" / "hydra-console" / "prepared"


def test_token_out_of_range_is_a_user_error(tiny_model):
    stage = load(tiny_model("llama"))
    with pytest.raises(UserError, match="token id out of range"):
        stage.embed(torch.tensor([1, stage.cfg.n_vocab]))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "Q4_K_M", "Q5_K", "Q6_K"])
def test_weights_kept_quantized_compute_what_the_dense_ones_do(tiny_model, qtype):
    """The GPU's quantized-weight path (here through the kernels' CPU reference) against the same
    weights expanded: same logits to float32 rounding, and the weights take their GGUF bytes."""
    g = GGUFFile(tiny_model("llama", n_embd=256, n_head=4, n_head_kv=2, n_ff=512, qtype=qtype))
    dense = build_stage(g, device="cpu", dtype="float32", int8=False, quantized=False, n_slots=1, n_ctx=16)
    quant = build_stage(g, device="cpu", dtype="float32", int8=False, quantized=True, n_slots=1, n_ctx=16)
    tokens, slots, pos = torch.tensor([1, 4, 2, 7, 3]), torch.zeros(5, dtype=torch.long), torch.arange(5)
    want = dense.logits(dense.run_layers(dense.embed(tokens), slots, pos))
    got = quant.logits(quant.run_layers(quant.embed(tokens), slots, pos))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert quant.weight_bytes < dense.weight_bytes / 3 and not quant.weights.expanded
    # What a peer checks against free memory before LOAD_STAGE: the held bytes, not bfloat16's.
    tensors = model_tensors(g.metadata, g.tensors)
    held = sum(tensors.layer_weights(il, "quantized", "float32") for il in range(tensors.n_layers))
    assert held < sum(tensors.layer_weights(il, "dense", "float32") for il in range(tensors.n_layers)) / 3
