"""qwen35 (Qwen3.5: Gated DeltaNet + gated attention): agreement with llama.cpp, and the recurrent
state through split stages, batching, clearing and the checks that keep it from going stale."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import socket
import threading
from pathlib import Path

import pytest
import torch
from rpc_workers import complete, greedy, solo_and_split, wait_for
from stages import load, prefill

from hydra_console.engine.errors import UserError
from hydra_console.engine.gguf_file import GGUFFile
from hydra_console.engine.model import ROLLBACK, ForwardBatch, ModelConfig
from hydra_console.engine.model.deltanet import DeltaNet
from hydra_console.engine.synth import write_synthetic

REFERENCE = Path(__file__).resolve().parent / "data" / "reference" / "qwen35"
PROMPT = [5, 17, 300, 45, 99, 512, 7, 8, 540, 33, 21, 5, 600, 64, 71, 12, 13, 14, 15, 16]
# fp32 against llama.cpp's fp32 (refdump prints 5 decimals): measured 6.5e-6 on logits up to ~4.3.
F32_MAX_ABS = 5e-5
# Q4_K: llama.cpp's 8-bit activations move logits by up to 0.17 (measured; on the same weights
# dequantized to F32 it agrees with us to 7e-6), so top-1 must agree wherever its margin exceeds 0.4.
CONFIDENT_MARGIN = 0.4


@pytest.fixture(scope="module")
def reference_models(tmp_path_factory):
    """The reference files' synthetic models, rewritten from their recorded arguments."""
    spec = importlib.util.spec_from_file_location("make_reference", REFERENCE / "make_reference.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    root = tmp_path_factory.mktemp("qwen35-reference")
    return {name: write_synthetic(root / f"{name}.gguf", "qwen35", **shape) for name, shape in mod.MODELS.items()}


def compare(stage, ref) -> dict:
    ids = torch.tensor(ref["ids"])
    stage.kv_clear(0)
    logits = stage.logits(
        stage.run_layers(stage.embed(ids), torch.zeros(len(ids), dtype=torch.long), torch.arange(len(ids)))
    )
    top1 = [int(logits[r["pos"]].argmax()) == r["top"][0][0] for r in ref["top10"]]
    diffs = torch.tensor([[abs(float(logits[r["pos"], i]) - v) for i, v in r["top"]] for r in ref["top10"]])
    # Margin: llama.cpp's top-1 minus top-2 logit, where a near-tie could flip the argmax.
    margins = torch.tensor([r["top"][0][1] - r["top"][1][1] for r in ref["top10"]])
    confident = [t for t, m in zip(top1, margins.tolist()) if m > CONFIDENT_MARGIN]
    return {
        "top1": sum(top1) / len(top1),
        "top1_confident": sum(confident) / len(confident),
        "max_abs": float(diffs.max()),
        "mean_abs": float(diffs.mean()),
        "max_logit": max(abs(v) for r in ref["top10"] for _, v in r["top"]),
        "margin_min": float(margins.min()),
        "margin_p10": float(margins.quantile(0.1)),
    }


def greedy_ids(stage, ids, n) -> list[int]:
    """Prefill `ids`, then decode token by token (the single-step recurrence)."""
    stage.kv_clear(0)
    logits = prefill(stage, ids)
    out = [int(logits[-1].argmax())]
    while len(out) < n:
        out.append(int(prefill(stage, [out[-1]], start=len(ids) + len(out) - 1)[-1].argmax()))
    return out


CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"))


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("name", ["f32", "q4_k"])
def test_logits_agree_with_llama_cpp(reference_models, name, device):
    """On CUDA: chunked prefill, the graph-captured decode step, and Q4_K weights kept quantized."""
    ref = json.loads((REFERENCE / f"logits_{name}.json").read_text())
    path = reference_models[name]
    assert hashlib.sha256(path.read_bytes()).hexdigest() == ref["sha256"], (
        "synthetic model changed: regenerate (README.md)"
    )
    stage = load(path, n_slots=1, device=device)
    got = compare(stage, ref)
    print(name, device, {k: f"{v:.3g}" for k, v in got.items()})
    if name == "f32":
        assert got["top1"] == 1.0 and got["max_abs"] < F32_MAX_ABS, got
        assert greedy_ids(stage, ref["ids"], len(ref["greedy"])) == ref["greedy"]
    else:  # llama.cpp quantizes activations to 8 bits for K-quant products: flips where it is near a tie
        assert got["top1_confident"] == 1.0 and got["top1"] >= 0.95 and got["max_abs"] < 0.3, got


def test_config_and_layer_types(tiny_model):
    cfg = ModelConfig.from_gguf(GGUFFile(tiny_model("qwen35", n_layers=4, head_dim=32, n_rot=16)))
    assert cfg.recurrent_layers == (True, False, True, False)
    assert cfg.attn_gate and cfg.qk_norm and cfg.rope_neox and cfg.ffn_norm == "post_attention_norm"
    assert cfg.deltanet.conv_channels == 2 * 2 * 16 + 4 * 16
    # sections (2, 2, 2, 2): pairs 6 and 7 read the fourth (zero) text position
    assert cfg.rope_pair_moves == (True,) * 6 + (False,) * 2


def test_prefill_equals_token_by_token(tiny_model):
    stage = load(tiny_model("qwen35", n_layers=4))
    full = prefill(stage, PROMPT)
    steps = [prefill(stage, [t], start=i) for i, t in enumerate(PROMPT)]  # position 0 restarts the state
    torch.testing.assert_close(torch.cat(steps), full, atol=1e-5, rtol=1e-5)
    chunks = torch.cat(
        [prefill(stage, PROMPT[:7]), prefill(stage, PROMPT[7:15], start=7), prefill(stage, PROMPT[15:], start=15)]
    )
    torch.testing.assert_close(chunks, full, atol=1e-5, rtol=1e-5)


def test_split_stages_are_bit_identical_to_one_stage(tiny_model):
    path = tiny_model("qwen35", n_layers=4)
    whole = load(path)
    first = load(path, layers=(0, 1), head=False)
    rest = load(path, layers=(1, 4), embed=False)
    for start, chunk in ((0, PROMPT[:12]), (12, PROMPT[12:]), (20, [3])):
        tokens, slots, pos = (
            torch.tensor(chunk),
            torch.zeros(len(chunk), dtype=torch.long),
            torch.arange(start, start + len(chunk)),
        )
        expected = whole.logits(whole.run_layers(whole.embed(tokens), slots, pos))
        got = rest.logits(rest.run_layers(first.run_layers(first.embed(tokens), slots, pos), slots, pos))
        assert torch.equal(got, expected)


def test_batched_slots_equal_each_slot_alone(tiny_model):
    path = tiny_model("qwen35", n_layers=4)
    prompts = [PROMPT[:5], PROMPT[3:12], PROMPT[7:10]]
    batched, alone = load(path), load(path)
    for slot, p in enumerate(prompts):
        prefill(batched, p, slot=slot)
    # one forward: a decode token of slots 0 and 2, a 3-token chunk of slot 1
    tokens = torch.tensor([41, 42, 43, 44, 45])
    slots = torch.tensor([0, 1, 1, 1, 2])
    positions = torch.tensor([5, 9, 10, 11, 3])
    got = batched.logits(batched.run_layers(batched.embed(tokens), slots, positions))
    want = [
        prefill(alone, prompts[0] + [41])[-1:],
        prefill(alone, prompts[1] + [42, 43, 44])[-3:],
        prefill(alone, prompts[2] + [45])[-1:],
    ]
    torch.testing.assert_close(got, torch.cat(want), atol=1e-5, rtol=1e-5)


def test_the_graph_step_equals_the_eager_decode(tiny_model):
    """`DeltaNet.step` (what the CUDA decode graphs capture) against the eager runs of one token:
    the same outputs, states and checkpoints, so a rejected draft rolls back the same way after either."""
    path = tiny_model("qwen35", n_layers=4)
    eager, graphed = load(path), load(path)
    prompts = [PROMPT[:5], PROMPT[3:12], PROMPT[7:10]]
    for stage in (eager, graphed):
        for slot, p in enumerate(prompts):
            prefill(stage, p, slot=slot)
    slots, positions = torch.tensor([0, 2, 1]), torch.tensor([5, 3, 9])
    for step in range(3):
        tokens = torch.tensor([41 + step, 42 + step, 43 + step])
        want = eager.logits(eager.run_layers(eager.embed(tokens), slots, positions + step))
        h = graphed.forward(graphed.embed(tokens), ForwardBatch.batched(slots, positions + step, 1, graphed.n_ctx))
        torch.testing.assert_close(graphed.logits(h), want, atol=1e-5, rtol=1e-5)
    for a, b in zip(eager.recurrent, graphed.recurrent):
        for name in ("conv_state", "ssm_state", "conv_ckpt", "ssm_ckpt"):
            torch.testing.assert_close(
                getattr(b, name)[:3, :1] if "ckpt" in name else getattr(b, name)[:3],
                getattr(a, name)[:3, :1] if "ckpt" in name else getattr(a, name)[:3],
                atol=1e-5,
                rtol=1e-5,
            )


def test_the_graph_verify_step_equals_the_eager_runs(tiny_model):
    """`per_slot` tokens for each slot (a speculative verify, as the CUDA graphs capture it) against
    the eager runs: the same outputs, states and every checkpoint a rollback reads."""
    path = tiny_model("qwen35", n_layers=4)
    eager, graphed = load(path), load(path)
    for stage in (eager, graphed):
        prefill(stage, PROMPT[:6], slot=0)
        prefill(stage, PROMPT[2:13], slot=2)
    at = {0: 6, 2: 11}
    for m in (3, 2, 4):
        slots = torch.tensor([0] * m + [2] * m)
        positions = torch.tensor([at[s] + t for s in (0, 2) for t in range(m)])
        tokens = torch.arange(m * 2) + 40 + m
        want = eager.logits(eager.run_layers(eager.embed(tokens), slots, positions))
        h = graphed.forward(graphed.embed(tokens), ForwardBatch.batched(slots, positions, m, graphed.n_ctx))
        torch.testing.assert_close(graphed.logits(h), want, atol=1e-5, rtol=1e-5)
        for a, b in zip(eager.recurrent, graphed.recurrent):
            for name in ("conv_state", "ssm_state"):
                torch.testing.assert_close(getattr(b, name)[[0, 2]], getattr(a, name)[[0, 2]], atol=1e-5, rtol=1e-5)
            for name in ("conv_ckpt", "ssm_ckpt"):
                torch.testing.assert_close(
                    getattr(b, name)[[0, 2], :m], getattr(a, name)[[0, 2], :m], atol=1e-5, rtol=1e-5
                )
        at = {s: at[s] + m for s in at}


def test_the_padding_slot_holds_one_state_row_and_touches_no_slot(tiny_model):
    """A CUDA stage's graphs run unused rows on the padding slot (row n_slots): its checkpoints land
    on its own state row, so it costs one row of state, not depth + 1, and a verify step with
    padding rows leaves every real slot's state and checkpoints as a step without them."""
    stage = load(tiny_model("qwen35", n_layers=4))
    il = next(il for il, layer in stage.layers.items() if layer.deltanet is not None)
    plain = stage.layers[il].deltanet
    padded = DeltaNet(stage.cfg, stage.weights, f"blk.{il}.", stage.n_slots, plain.depth, True)
    n, depth = stage.n_slots, plain.depth
    assert padded.ssm_rows.shape[0] == n * (depth + 1) + 1 and plain.ssm_rows.shape[0] == n * (depth + 1)
    for net in (plain, padded):
        torch.manual_seed(0)
        net.conv_state[:n] = torch.randn_like(net.conv_state[:n])
        net.ssm_state[:n] = torch.randn_like(net.ssm_state[:n]) * 0.1
    m = 3
    x = torch.randn(2 * m, stage.cfg.n_embd)
    want = plain.step(x, torch.tensor([0] * m + [1] * m), per_slot=m)
    pad_x = torch.cat([x[:m], torch.randn(m, stage.cfg.n_embd), x[m:]])
    got = padded.step(pad_x, torch.tensor([0] * m + [n] * m + [1] * m), per_slot=m)
    # (a product over 3m rows may round unlike one over 2m: equal to float32 noise, not bits)
    torch.testing.assert_close(torch.cat([got[:m], got[2 * m :]]), want, atol=1e-5, rtol=1e-5)
    for name in ("conv_state", "ssm_state", "conv_ckpt", "ssm_ckpt"):
        torch.testing.assert_close(getattr(padded, name)[:n], getattr(plain, name)[:n], atol=1e-5, rtol=1e-5)


def test_kv_clear_resets_the_recurrent_state(tiny_model):
    stage = load(tiny_model("qwen35", n_layers=4))
    first = prefill(stage, PROMPT)
    stage.kv_clear(0)
    assert all(
        float(net.ssm_state[0].abs().sum()) == 0 and float(net.conv_state[0].abs().sum()) == 0
        for net in stage.recurrent
    )
    torch.testing.assert_close(prefill(stage, PROMPT), first, atol=0, rtol=0)


def test_rejected_positions_restore_the_state_from_checkpoints(tiny_model):
    """A verify batch of 5 whose last 3 are rejected, then the correction: as if never drafted."""
    path = tiny_model("qwen35", n_layers=4)
    stage, ref = load(path), load(path)
    prefill(stage, PROMPT[:10])
    prefill(stage, [50, 51, 52, 53, 54], start=10)
    again = prefill(stage, [60, 61], start=12)
    torch.testing.assert_close(again, prefill(ref, PROMPT[:10] + [50, 51, 60, 61])[12:], atol=1e-5, rtol=1e-5)
    prefill(stage, [70], start=13)  # one back after a 2-token run
    with pytest.raises(ValueError, match="cannot skip, nor roll back further than 1"):
        prefill(stage, [5], start=12)  # beyond the last run
    with pytest.raises(ValueError, match="cannot skip"):
        prefill(stage, [5], start=16)  # a gap
    prefill(stage, [5], start=14)  # the continuation still works
    prefill(stage, PROMPT[:12])
    with pytest.raises(ValueError, match=f"further than {ROLLBACK}"):
        prefill(stage, [5], start=12 - ROLLBACK - 1)


def test_reassigning_layers_requires_a_replay(tiny_model):
    path = tiny_model("qwen35", n_layers=4)
    stage = load(path, layers=(0, 2), head=False)
    h0 = stage.embed(torch.tensor(PROMPT))
    stage.run_layers(h0, torch.zeros(len(PROMPT), dtype=torch.long), torch.arange(len(PROMPT)))
    stage.assign(0, 3)  # a new layer with no state: the slot must be replayed from position 0
    with pytest.raises(ValueError, match="cannot skip"):
        stage.run_layers(stage.embed(torch.tensor([4])), torch.tensor([0]), torch.tensor([len(PROMPT)]))


def test_moe_variant_is_named_as_not_supported(tmp_path):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "moe.gguf"), "qwen35moe")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UserError, match="qwen35moe.*not supported yet"):
        ModelConfig.from_gguf(GGUFFile(tmp_path / "moe.gguf"))


def test_speculation_on_qwen35_is_greedy_token_for_token(tiny_model):
    """ngram drafts (capped at ROLLBACK) verified with slots batched give exactly plain greedy."""
    from hydra_console.engine.config import ModelSettings, SpecConfig
    from hydra_console.engine.pipeline import Pipeline
    from hydra_console.engine.serving.runtime import Engine
    from hydra_console.engine.serving.sampling_params import SamplingParams
    from hydra_console.engine.serving.sequence import Request
    from hydra_console.engine.spec import build_speculator
    from hydra_console.engine.text.tokenizer import Tokenizer

    path = tiny_model("qwen35", n_layers=4)
    g, tok = GGUFFile(path), Tokenizer.from_gguf(GGUFFile(path))
    prompts = [tok.encode(p) for p in ("hello world hello world hello", "a b a b a b a", "the cat the cat the")]

    def outputs(spec_type):
        spec = build_speculator(
            SpecConfig(type=spec_type, n_max=8), None, g, ModelSettings(None, "cpu", "float32", 128), 3
        )
        eng = Engine(Pipeline(load(path, n_slots=3, n_ctx=128)), tok, 3, 128, speculator=spec).start()
        results = {}

        def one(i, p):
            ids = []
            for ev in eng.generate(
                Request(p, SamplingParams(temperature=0.0), max_tokens=30, ignore_eos=True), timeout=120
            ):
                ids += [t.id for t in ev.tokens]
            results[i] = ids

        try:
            threads = [threading.Thread(target=one, args=(i, p)) for i, p in enumerate(prompts)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=120)
            return [results[i] for i in range(len(prompts))], eng.spec_stats, spec.max_draft
        finally:
            eng.stop()

    plain, _, _ = outputs("off")
    speculative, stats, max_draft = outputs("ngram")
    assert max_draft == ROLLBACK
    assert speculative == plain
    assert stats.draft_tokens > 0 and stats.accepted < stats.draft_tokens  # some drafts were rejected


def test_a_recurrent_draft_model_is_refused(tiny_model):
    from hydra_console.engine.config import ModelSettings, SpecConfig
    from hydra_console.engine.spec import build_speculator

    path = str(tiny_model("qwen35", n_layers=2))
    with pytest.raises(UserError, match="recurrent model \\(qwen35\\) cannot draft"):
        build_speculator(SpecConfig(type="draft"), path, GGUFFile(path), ModelSettings(None, "cpu", "float32", 64), 1)


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    """A solo head and a head + one peer holding half of a qwen35 model (real processes), in float32:
    a re-split rebuilds the state in prefill form, which in 16 bits differs in the last bits from the
    token-by-token state it replaces (enough to flip a near-tie of a random model much later)."""
    model = tiny_model("qwen35", n_layers=4)
    logs = tmp_path_factory.mktemp("qwen35-split-logs")
    with solo_and_split(model, logs, "--split", "2/2") as workers:
        yield workers


def test_split_across_processes_and_live_resplit_equal_solo(cluster):
    """The peer holds its layers' recurrent state; a live re-split rebuilds it by replay from 0."""
    from hydra_console.contracts.rpc import Op, Status
    from hydra_console.engine.rpc import wire
    from hydra_console.engine.rpc.wire import SocketReader

    w, solo = cluster["head"], cluster["solo"]
    for prompt in ("hello world", "the quick brown fox"):
        assert greedy(w, prompt) == greedy(solo, prompt)
    result = {}
    t = threading.Thread(
        target=lambda: result.setdefault("r", complete(w, "once upon a time", 60, timeout=120, cache_prompt=False))
    )
    t.start()
    try:
        wait_for(lambda: any((s["n_decoded"] or 0) > 3 for s in w.status()["slots"]), 60, "decoding to start")
        with socket.create_connection(("127.0.0.1", w.rpc_port), timeout=30) as s:
            s.sendall(wire.pack_control_request(Op.CONFIGURE, json.dumps({"split": "1/3"}).encode()))
            resp = wire.read_control_response(SocketReader(s), 1 << 20)
        assert resp.status == Status.OK, resp.meta
        assert resp.meta["rebuilt_tokens"] > 3
    finally:
        t.join(timeout=120)
    r = result["r"]
    assert r.status_code == 200, r.text
    want = complete(solo, "once upon a time", 60, cache_prompt=False).json()["choices"][0]["text"]
    assert r.json()["choices"][0]["text"] == want
    assert greedy(w, "hello world") == greedy(solo, "hello world")


def test_chunked_prefill_equals_the_token_by_token_recurrence(tiny_model, monkeypatch):
    """Two runs long enough for the chunked form (one padded) and a short one (stepped apart) against
    the same batch stepped token by token throughout."""
    from hydra_console.engine.model import deltanet

    path = tiny_model("qwen35", n_layers=4)
    ids = torch.randint(0, 600, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    tokens = torch.tensor(ids + ids[:150] + ids[:3])
    slots = torch.tensor([0] * 300 + [1] * 150 + [2] * 3)
    positions = torch.cat([torch.arange(300), torch.arange(150), torch.arange(3)])

    def forward():
        stage = load(path, n_slots=3)
        out = stage.logits(stage.run_layers(stage.embed(tokens), slots, positions))
        return out, [(net.ssm_state.clone(), net.ssm_ckpt.clone()) for net in stage.recurrent]

    chunked, chunked_states = forward()
    monkeypatch.setattr(deltanet, "CHUNK", 1 << 20)  # no run is that long: token by token throughout
    stepped, stepped_states = forward()
    err = float((chunked - stepped).abs().max())
    print(f"chunked vs token by token: max |dlogit| {err:.2e}")
    torch.testing.assert_close(chunked, stepped, atol=2e-5, rtol=1e-5)
    for (a, ca), (b, cb) in zip(chunked_states, stepped_states):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(ca, cb, atol=2e-5, rtol=1e-5)


def test_a_nextn_block_is_not_part_of_the_trunk(tiny_model):
    """With the MTP block (block_count 5, nextn_predict_layers 1) the trunk is the same 4 layers;
    llama.cpp loads both files and gives them identical logits too."""
    plain, with_mtp = tiny_model("qwen35", n_layers=4), tiny_model("qwen35", n_layers=4, nextn=True)
    g = GGUFFile(with_mtp)
    assert "blk.4.nextn.eh_proj.weight" in g.tensors and ModelConfig.from_gguf(g).n_layers == 4
    assert torch.equal(prefill(load(with_mtp), PROMPT), prefill(load(plain), PROMPT))


def test_tokenizer_pre_type_qwen35_matches_llama_cpp(tiny_model):
    """Ids from llama.cpp: `printf '<text>' | /work/llama-cpp/bin/tok <synthetic qwen35>.gguf 0`."""
    from hydra_console.engine.text.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(GGUFFile(tiny_model("qwen35")))
    assert tok.pre == "qwen35"
    text = "caf\u00e9 cafe\u0301 na\u00efve r\u00e9sum\u00e9 x\u0308y 123 hello  world\n"
    llama_cpp = "66 64 69 127 102 302 64 69 68 136 223 274 64 127 107 304 220 81 127 102 82 305 127 102 220 87 136 230 88 220 16 17 18 522 220 435 198"
    assert tok.encode(text) == [int(i) for i in llama_cpp.split()]


def test_bfloat16_with_int8_weights_tracks_float32(tiny_model):
    """The CPU default (bfloat16 compute, int8 weights): recurrent state stays float32, so the
    logits follow float32 closely over a long prompt (chunked prefill + decode)."""
    path = tiny_model("qwen35", n_layers=4)
    ids = torch.randint(0, 600, (150,), generator=torch.Generator().manual_seed(2)).tolist()
    exact, fast = load(path), load(path, dtype="bfloat16")
    assert fast.int8
    want = torch.cat([prefill(exact, ids), prefill(exact, [7], start=150)])
    got = torch.cat([prefill(fast, ids), prefill(fast, [7], start=150)])
    agree = float((got.argmax(-1) == want.argmax(-1)).float().mean())
    err = float((got - want).abs().max())
    print(f"bfloat16/int8 vs float32: top-1 {agree:.3f}, max |dlogit| {err:.3f}")
    assert agree >= 0.95 and err < 0.2  # measured 0.980 and 0.069


def test_slot_state_moves_with_the_recurrent_state(tiny_model):
    from hydra_console.contracts.slot_state import SlotStateError
    from hydra_console.engine import slot_state

    path = tiny_model("qwen35", n_layers=4)
    fp = GGUFFile(path).fingerprint
    a, b = load(path, n_slots=3), load(path, n_slots=3)
    nxt = int(prefill(a, PROMPT, slot=0)[-1].argmax())
    blob = bytes(slot_state.save(a, 0, PROMPT, fp))
    assert slot_state.restore(b, 2, slot_state.Reader(blob), fp) == PROMPT
    assert torch.equal(prefill(a, [nxt], slot=0, start=len(PROMPT)), prefill(b, [nxt], slot=2, start=len(PROMPT)))
    with pytest.raises(SlotStateError, match="recurrent state covers 21 tokens, not the 20"):
        bytes(slot_state.save(a, 0, PROMPT, fp))


def test_prompt_cache_reuses_only_a_whole_cached_sequence(tiny_model):
    """A recurrent slot cannot be cut back to a shorter prefix: a prompt that extends everything the
    slot holds continues it; one that diverges inside it starts from position 0. Same tokens either way."""
    from hydra_console.engine.pipeline import Pipeline
    from hydra_console.engine.serving.runtime import Engine
    from hydra_console.engine.serving.sampling_params import SamplingParams
    from hydra_console.engine.serving.sequence import Request
    from hydra_console.engine.text.tokenizer import Tokenizer

    path = tiny_model("qwen35", n_layers=4)
    tok = Tokenizer.from_gguf(GGUFFile(path))
    eng = Engine(Pipeline(load(path, n_slots=1, n_ctx=128)), tok, 1, 128).start()

    def gen(prompt, **kw):
        ids, final = [], None
        for ev in eng.generate(
            Request(prompt, SamplingParams(temperature=0.0), max_tokens=6, ignore_eos=True, **kw), timeout=60
        ):
            ids += [t.id for t in ev.tokens]
            final = ev
        return ids, final.timings["cache_n"]

    try:
        prompt = tok.encode("the quick brown fox and more words")
        first, _ = gen(prompt, cache_prompt=False)
        extended = prompt + first + tok.encode(" hello")
        cont, cache_n = gen(extended)
        assert cache_n == len(prompt) + len(first) - 1  # all the slot held: the last answer token was never forwarded
        diverged, cache_n2 = gen(prompt[:4] + tok.encode(" world"))
        assert cache_n2 == 0
        fresh = Engine(Pipeline(load(path, n_slots=1, n_ctx=128)), tok, 1, 128).start()
        try:
            for p, got in ((extended, cont), (prompt[:4] + tok.encode(" world"), diverged)):
                ids = []
                for ev in fresh.generate(
                    Request(p, SamplingParams(temperature=0.0), max_tokens=6, ignore_eos=True, cache_prompt=False),
                    timeout=60,
                ):
                    ids += [t.id for t in ev.tokens]
                assert ids == got
        finally:
            fresh.stop()
    finally:
        eng.stop()
