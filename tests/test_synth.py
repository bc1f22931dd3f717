"""The synthetic-model writer: every architecture and weight type reads back with our reader, dequantizer and tokenizer."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from stages import load

from hydra_console.engine.gguf_file import GGUFFile
from hydra_console.engine.quant import dequantize
from hydra_console.engine.synth import write_synthetic
from hydra_console.engine.text.tokenizer import Tokenizer


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_architecture_metadata_and_tensors(tiny_model, arch):
    g = GGUFFile(tiny_model(arch))
    assert g.architecture == arch
    assert g.metadata[f"{arch}.block_count"] == 2
    assert g.tensors["blk.1.attn_k.weight"].shape == (2 * 16, 64)
    assert ("output.weight" in g.tensors) == (arch != "gemma3")
    assert ("blk.0.attn_q.bias" in g.tensors) == (arch == "qwen2")
    assert ("blk.0.attn_q_norm.weight" in g.tensors) == (arch in ("qwen3", "gemma3"))
    assert ("blk.0.post_ffw_norm.weight" in g.tensors) == (arch == "gemma3")
    tok = Tokenizer.from_gguf(g)
    text = "hello world, the quick brown fox jumps"
    assert tok.decode(tok.encode(text, add_special=False)) == text
    assert tok.eos_id in tok.eog_ids


def test_gemma3_has_window_and_chat_tokens(tiny_model):
    g = GGUFFile(tiny_model("gemma3"))
    assert g.metadata["gemma3.attention.sliding_window"] == 8
    tok = Tokenizer.from_gguf(g)
    ids = tok.encode("<start_of_turn>user\nhi<end_of_turn>")
    assert ids[1] == g.metadata["tokenizer.ggml.tokens"].index("<start_of_turn>")


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q8_0", "Q4_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"])
def test_weight_types_are_scaled_random_weights(tmp_path, qtype):
    shape = dict(n_embd=256, n_ff=256) if qtype.endswith("_K") else {}
    g = GGUFFile(write_synthetic(tmp_path / "m.gguf", "llama", qtype=qtype, **shape))
    t = g.tensors["blk.0.ffn_up.weight"]
    assert t.ggml_type.name == qtype
    w = dequantize(g.raw(t.name), t.ggml_type, t.shape)
    n_embd = t.shape[1]
    assert abs(float(w.std()) * np.sqrt(n_embd) - 1.0) < 0.3  # std ~ 1/sqrt(fan_in)
    assert g.tensors["blk.0.attn_norm.weight"].ggml_type.name == "F32"


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_quantized_weights_have_zero_mean(tmp_path, qtype):
    # A biased weight makes every position's argmax the same token, so logit agreement tests pass trivially.
    g = GGUFFile(write_synthetic(tmp_path / "m.gguf", "llama", qtype=qtype, n_embd=256, n_ff=512))
    for name in ("output.weight", "blk.0.ffn_down.weight"):
        t = g.tensors[name]
        w = dequantize(g.raw(t.name), t.ggml_type, t.shape)
        assert abs(float(w.mean())) < 0.02 * float(w.std()), name
        # Row means too: a per-row bias would still shift every logit of one token.
        assert float(w.mean(dim=1).abs().max()) < 0.5 * float(w.std()), name


def test_vocab_size_pads_and_bad_shapes_are_refused(tmp_path):
    g = GGUFFile(write_synthetic(tmp_path / "big.gguf", "llama", vocab_size=5000))
    assert len(g.metadata["tokenizer.ggml.tokens"]) == 5000
    assert g.tensors["token_embd.weight"].shape == (5000, 64)
    with pytest.raises(ValueError, match="block size"):
        write_synthetic(tmp_path / "bad.gguf", "llama", qtype="Q4_K")
    with pytest.raises(ValueError, match="unsupported architecture"):
        write_synthetic(tmp_path / "bad.gguf", "mamba")


@pytest.mark.parametrize("qtype", ["F32", "Q5_K_M"])
def test_header_only_file_has_the_full_files_metadata_and_tensor_table(tmp_path, qtype):
    """`header_only`: the same metadata and tensor table (names, types, shapes, offsets) and the
    same size as the file with weights, its data a hole that reads as zeros."""
    shape = dict(n_layers=4, n_embd=256, n_ff=512, n_head=4, n_head_kv=2, ssm_state=64, nextn=True, bigram=True)
    full = GGUFFile(write_synthetic(tmp_path / "full.gguf", "qwen35", qtype=qtype, **shape))
    head = GGUFFile(write_synthetic(tmp_path / "head.gguf", "qwen35", qtype=qtype, header_only=True, **shape))
    assert head.fingerprint == full.fingerprint  # the identity guard's: header and tensor table
    assert head.metadata.keys() == full.metadata.keys()
    table = {n: (t.ggml_type, t.shape, t.offset, t.nbytes) for n, t in full.tensors.items()}
    assert {n: (t.ggml_type, t.shape, t.offset, t.nbytes) for n, t in head.tensors.items()} == table
    assert (tmp_path / "head.gguf").stat().st_size == (tmp_path / "full.gguf").stat().st_size
    assert not head.raw("blk.0.ffn_up.weight").any()


def test_logit_scale_peaks_the_bigram_trunk_and_keeps_its_argmax(tiny_model, tmp_path):
    """A `bigram` trunk's next token depends on the token alone; `logit_scale` spreads its logits so
    that sampling at temperature 0.7 mostly picks the argmax (what sampled speculation's acceptance
    follows), and the argmax (greedy text, greedy drafts) stays that of the unscaled file."""

    def trunk(path):
        stage = load(path, n_slots=1, n_ctx=1024)
        ids = torch.arange(stage.cfg.n_vocab)
        zeros = torch.zeros_like(ids)
        return stage.project(stage.final_norm(stage.run_layers(stage.embed(ids), zeros, ids)))

    shape = dict(n_layers=2, nextn=True, bigram=True)
    flat, peaked = trunk(tiny_model("qwen35", **shape)), trunk(tiny_model("qwen35", **shape, logit_scale=4.0))
    assert torch.equal(flat.argmax(-1), peaked.argmax(-1))
    top = [float(torch.softmax(x / 0.7, -1).amax(-1).mean()) for x in (flat, peaked)]
    assert top[0] < 0.15 and 0.45 < top[1] < 0.8, top
    with pytest.raises(ValueError, match="untied output head"):
        write_synthetic(tmp_path / "g.gguf", "gemma3", logit_scale=2.0)
