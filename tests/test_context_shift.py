"""llama-server's context shift (`--context-shift`): the arithmetic of what a full slot keeps, the
KV shift itself on real stages (float32, CPU), and a real head generating past a tiny context.

What proves the shifted KV right: K is cached after RoPE, so a shift must turn each moved K back by
the shift's distance with its layer's RoPE base. With one layer, K and V depend only on each token
and its position, so the shifted cache must equal a fresh prefill of the kept tokens at their new
positions, and so must the logits after it (to float noise). With more layers the moved tokens'
states saw the discarded ones (as in llama.cpp: a shift is an approximation there), so each
layer's K is checked against RoPE's rotation written out independently here, per layer base.
"""

from __future__ import annotations

import queue

import httpx
import numpy as np
import pytest
import torch
from rpc_workers import head, peer, running
from stages import load, prefill

from hydra_console.engine.config import SpecConfig
from hydra_console.engine.gguf_file import GGUFFile
from hydra_console.engine.model import build_stage
from hydra_console.engine.pipeline import Pipeline
from hydra_console.engine.serving.context_shift import ContextShift
from hydra_console.engine.serving.runtime import Engine
from hydra_console.engine.serving.sampling_params import SamplingParams
from hydra_console.engine.serving.sequence import Event, Request, Sequence
from hydra_console.engine.spec import Speculator
from hydra_console.engine.text.tokenizer import Tokenizer

N_CTX = 64
PROMPT = "the quick brown fox jumps over the lazy dog"


# ---- what a full slot keeps (llama-server's pre_decode) ------------------------------------------


def _full(n_prompt: int, n_past: int, **req) -> Sequence:
    seq = Sequence(Request(list(range(1, n_prompt + 1)), **req), 0)
    seq.n_past = n_past
    return seq


@pytest.mark.unit
def test_plan_is_llama_servers_arithmetic():
    # test_ctx_shift_enabled's numbers: a 256-token slot full at 255, the BOS kept, half of the rest dropped
    assert ContextShift().plan(_full(226, 255), 256) == (1, 127)
    assert ContextShift(n_keep=10).plan(_full(226, 255), 256) == (11, 122)
    assert ContextShift(add_bos=False).plan(_full(226, 255), 256) == (0, 127)
    # -1 keeps the whole prompt (llama-server adds the BOS on top); the request's n_keep wins
    assert ContextShift().plan(_full(40, 63, n_keep=-1), 64) == (41, 11)
    assert ContextShift(n_keep=-1).plan(_full(40, 63, n_keep=2), 64) == (3, 30)
    # at most n_ctx - 4 kept; n_discard asked for, clamped so that one token stays after the kept ones
    assert ContextShift(n_keep=100).plan(_full(50, 63), 64) == (60, 1)
    assert ContextShift().plan(_full(10, 63, n_discard=5), 64) == (1, 5)
    assert ContextShift().plan(_full(10, 63, n_discard=500), 64) == (1, 61)


# ---- the KV shift on a stage ---------------------------------------------------------------------


def _tokens(stage, n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, stage.cfg.n_vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("arch,pooled", [("gemma3", False), ("llama", False), ("qwen2", False), ("llama", True)])
def test_one_layer_shift_is_a_fresh_prefill_of_the_kept_tokens(tiny_model, arch, pooled):
    """One layer: after the shift, decoding goes on exactly as if the kept tokens had been prefilled
    at their new positions (gemma3: its sliding window masks by the new positions; a --kv-unified
    pool: the moved positions cross from the slot's second block into its first). Moving K without
    turning it back is far off: the test can fail."""
    n_ctx = 256
    stage = load(tiny_model(arch, n_layers=1), n_slots=3, n_ctx=n_ctx, kv_pool=3 * n_ctx if pooled else None)
    x, after = _tokens(stage, 180), _tokens(stage, 3, seed=1)
    keep, discard = 4, 88
    kept = x[:keep] + x[keep + discard :]

    def decode_after(slot: int) -> torch.Tensor:
        return torch.cat([prefill(stage, [t], slot, len(kept) + i) for i, t in enumerate(after)])

    fresh = prefill(stage, kept + after, slot=2)[len(kept) :]
    prefill(stage, x, slot=0)
    stage.kv_shift(0, keep, discard, len(x))
    torch.testing.assert_close(decode_after(0), fresh, atol=2e-4, rtol=1e-4)

    prefill(stage, x, slot=1)
    for layer in stage.layers.values():  # the same move, K left as it was
        layer.kv.move(1, keep + discard, len(x), -discard, lambda k: k)
    assert (decode_after(1) - fresh).abs().max() > 1e-2


def _rope_back(k: np.ndarray, delta: int, base: float, scale: float, n_rot: int, neox: bool) -> np.ndarray:
    """RoPE's rotation of k [..., head_dim] by `delta` positions, written out in float64."""
    theta = base ** (-np.arange(0, n_rot, 2) / n_rot) * delta / scale
    cos, sin = np.cos(theta), np.sin(theta)
    out = k.copy()
    a, b = (slice(0, n_rot // 2), slice(n_rot // 2, n_rot)) if neox else (slice(0, n_rot, 2), slice(1, n_rot, 2))
    out[..., a] = k[..., a] * cos - k[..., b] * sin
    out[..., b] = k[..., b] * cos + k[..., a] * sin
    return out


@pytest.mark.parametrize("arch,n_layers", [("gemma3", 6), ("llama", 2)])
def test_each_layer_turns_k_back_by_its_own_rope(tiny_model, arch, n_layers):
    """Every layer (gemma3: five window layers on RoPE base 10k, a global one on 1M): the kept
    positions are untouched, the moved V is the old V, the moved K is the old K rotated back by the
    shift's distance with that layer's base."""
    stage = load(tiny_model(arch, n_layers=n_layers), n_slots=1, n_ctx=N_CTX)
    cfg, x, keep, discard = stage.cfg, _tokens(stage, 50), 5, 22
    prefill(stage, x)
    before = {
        il: [t.double().numpy().copy() for t in layer.kv.read_run(0, 0, len(x))] for il, layer in stage.layers.items()
    }
    stage.kv_shift(0, keep, discard, len(x))
    bases = set()
    for il, layer in stage.layers.items():
        k_old, v_old = before[il]
        k_new, v_new = (t.double().numpy() for t in layer.kv.read_run(0, 0, len(x) - discard))
        np.testing.assert_array_equal(k_new[:, :keep], k_old[:, :keep])
        np.testing.assert_array_equal(v_new[:, keep:], v_old[:, keep + discard :])
        base, scale = (cfg.rope_base_swa, 1.0) if layer.window else (cfg.rope_base, cfg.rope_scale)
        bases.add(base)
        want = _rope_back(k_old[:, keep + discard :], -discard, base, scale, cfg.n_rot, cfg.rope_neox)
        np.testing.assert_allclose(k_new[:, keep:], want, atol=1e-5)
    assert len(bases) == (2 if arch == "gemma3" else 1)


def test_a_recurrent_stage_refuses_to_shift(tiny_model):
    stage = load(tiny_model("qwen35", n_layers=2), n_slots=1, n_ctx=N_CTX)
    prefill(stage, _tokens(stage, 20))
    with pytest.raises(ValueError, match="recurrent"):
        stage.kv_shift(0, 1, 8, 20)


def _engine_outputs(path, spec: SpecConfig, draft: bool = False, overlap: bool = False) -> tuple[list[list[int]], int]:
    """Greedy tokens of two requests decoding side by side through four shifts of a 64-token slot,
    and how many drafted tokens were accepted."""
    g = GGUFFile(path)
    tok = Tokenizer.from_gguf(g)

    def pipeline() -> Pipeline:
        return Pipeline(build_stage(g, device="cpu", dtype="float32", n_slots=2, n_ctx=N_CTX))

    speculator = Speculator(spec, pipeline() if draft else None)
    eng = Engine(
        pipeline(), tok, 2, N_CTX, speculator=speculator, overlap=overlap, context_shift=ContextShift()
    ).start()
    try:
        done: list[queue.Queue] = [queue.Queue(), queue.Queue()]
        reqs = [
            Request(tok.encode(p), SamplingParams(temperature=0.0), max_tokens=160, ignore_eos=True, sink=q.put)
            for p, q in zip([PROMPT, "hello world hello world"], done)
        ]
        eng.submit_together(reqs)
        outputs, accepted = [], 0
        for q in done:
            ids, ev = [], Event()
            while ev.finish_reason is None:
                ev = q.get(timeout=120)
                ids += [t.id for t in ev.tokens]
            assert ev.finish_reason == "length" and ev.truncated and len(ids) == 160
            outputs.append(ids)
            accepted += ev.timings["draft_n_accepted"]
        return outputs, accepted
    finally:
        eng.stop()


def test_overlap_and_speculative_decoding_through_shifts_are_plain_greedy(tiny_model):
    """With overlap a shift waits for the step in flight (its input moves); n-gram and draft-model
    speculation cap their drafts at the slot's end and go on after each shift (the draft model
    re-feeds its own cache from the kept tokens): greedy tokens as plain decoding's."""
    path = tiny_model("llama", bigram=True)
    plain, _ = _engine_outputs(path, SpecConfig())
    assert _engine_outputs(path, SpecConfig(), overlap=True)[0] == plain
    for spec, draft in ((SpecConfig("ngram", n_max=4), False), (SpecConfig("draft", n_max=3, p_min=0.0), True)):
        ids, accepted = _engine_outputs(path, spec, draft)
        assert ids == plain and accepted > 50, spec


# ---- a real head -----------------------------------------------------------------------------------


def _replay(prompt: list[int], generated: list[int], n_ctx: int, keep: int) -> tuple[list[int], int, list[int]]:
    """llama-server's shifts over a generation, from its arithmetic: the slot's tokens right after
    the first shift (the last of them the next step's input), how many tokens had been generated
    then, and the tokens the slot's KV holds at the end."""
    tokens, n_past, first = [*prompt, generated[0]], len(prompt), None
    for i, t in enumerate(generated[1:], 1):
        if n_past + 1 >= n_ctx:
            discard = (n_past - keep) // 2
            del tokens[keep : keep + discard]
            n_past -= discard
            first = first or (list(tokens), i)
        n_past += 1
        tokens.append(t)
    return first[0], first[1], tokens[:n_past]


@pytest.fixture(scope="module")
def shifting(tiny_model, tmp_path_factory):
    """A head with --context-shift on a one-layer model in float32 (its shifted KV is exact), one slot."""
    model = tiny_model("llama", n_layers=1)
    logs = tmp_path_factory.mktemp("ctx-shift")
    w = head(model, logs, (), "--context-shift", "--dtype", "float32", "--temp", "0", parallel=1, ctx=N_CTX)
    with running(w):
        yield w, Tokenizer.from_gguf(GGUFFile(model))


def _complete(w, body: dict) -> dict:
    r = httpx.post(f"{w.url}/completion", json={"return_tokens": True, "n_probs": 3, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _logprobs(body: dict) -> list[list[float]]:
    return [[t["logprob"] for t in p["top_logprobs"]] for p in body["completion_probabilities"]]


@pytest.mark.parametrize("n_keep", [None, 3])
def test_generation_goes_on_past_the_context_as_a_fresh_prefill_would(shifting, n_keep):
    """n_predict 150 in a 64-token slot: every token comes (three shifts), `truncated`; the tokens
    after the first shift, and their top logprobs, are those of a request whose prompt is the
    shifted tokens, computed from scratch. Then the slot's prompt cache is the shifted tokens: a
    request extending them reuses all of them and answers as without the cache."""
    w, tok = shifting
    ids = tok.encode(PROMPT)
    keep = (n_keep or 0) + 1  # + the BOS
    body = _complete(w, {"prompt": PROMPT, "n_predict": 150, **({"n_keep": n_keep} if n_keep is not None else {})})
    assert body["timings"]["predicted_n"] == 150 and body["tokens_predicted"] == 150
    assert body["timings"]["prompt_n"] + body["timings"]["cache_n"] == len(ids)
    assert body["truncated"] is True and body["stop_type"] == "limit"
    assert body["generation_settings"]["n_keep"] == (n_keep or 0)

    shifted, n_before, cached = _replay(ids, body["tokens"], N_CTX, keep)
    extended = [*cached, *ids[1:4]]  # first: the next request takes the one slot and its cache
    reused = _complete(w, {"prompt": extended, "n_predict": 4})
    assert reused["timings"]["cache_n"] == len(cached)
    fresh = _complete(w, {"prompt": extended, "n_predict": 4, "cache_prompt": False})
    assert reused["tokens"] == fresh["tokens"]
    np.testing.assert_allclose(_logprobs(reused), _logprobs(fresh), atol=1e-4)

    until_next = N_CTX - len(shifted)  # tokens generated before the second shift
    ref = _complete(w, {"prompt": shifted, "n_predict": until_next, "cache_prompt": False})
    assert body["tokens"][n_before : n_before + until_next] == ref["tokens"]
    np.testing.assert_allclose(_logprobs(body)[n_before : n_before + until_next], _logprobs(ref), atol=1e-4)


def test_n_predict_minus_one_runs_on_until_the_client_leaves(shifting):
    """Unbounded with context shift (llama-server's n_predict -1): the stream passes the context
    twice over; closing it ends the request and frees the slot. A prompt that fills the slot is
    still refused (400, llama-server's words)."""
    w, tok = shifting
    n = 0
    body = {"prompt": PROMPT, "n_predict": -1, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{w.url}/completion", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                n += 1
                if n > 2 * N_CTX:
                    break
    assert n > 2 * N_CTX
    assert _complete(w, {"prompt": PROMPT, "n_predict": 2})["tokens_predicted"] == 2
    r = httpx.post(f"{w.url}/completion", json={"prompt": tok.decode(_many(tok)), "n_predict": 4}, timeout=60)
    assert r.status_code == 400 and "exceeds the available context size" in r.json()["error"]["message"]


def _many(tok) -> list[int]:
    ids = tok.encode(PROMPT, add_special=False)
    return (ids * N_CTX)[:N_CTX]


def test_without_context_shift_generation_ends_at_the_context(tiny_model, tmp_path):
    """Off (the default): n_predict -1 stops where the slot is full, `truncated`, stop_type limit;
    a shorter generation is not truncated."""
    w = head(tiny_model("llama", n_layers=1), tmp_path, (), "--temp", "0", parallel=1, ctx=N_CTX)
    with running(w):
        n_prompt = len(Tokenizer.from_gguf(GGUFFile(tiny_model("llama", n_layers=1))).encode(PROMPT))
        body = _complete(w, {"prompt": PROMPT, "n_predict": -1, "ignore_eos": True})
        assert body["tokens_predicted"] == N_CTX - n_prompt
        assert body["truncated"] is True and body["stop_type"] == "limit"
        body = _complete(w, {"prompt": PROMPT, "n_predict": 8, "ignore_eos": True})
        assert body["tokens_predicted"] == 8 and body["truncated"] is False


def test_context_shift_is_refused_for_a_recurrent_model(tiny_model, tmp_path):
    """A recurrent state cannot drop tokens (llama.cpp turns the flag off there; here the head says
    why and exits 2, before any peer is waited for)."""
    w = head(tiny_model("qwen35", n_layers=2), tmp_path, (), "--context-shift", "--peer", "127.0.0.1:9")
    try:
        assert w.proc.wait(timeout=120) == 2
        assert "qwen35's recurrent layers cannot drop tokens" in w.log()
    finally:
        w.stop()


def test_a_split_shifts_as_solo_bit_for_bit(tiny_model, tmp_path):
    """Head + peer (KV_SHIFT on the peer's layers) through three shifts: the same tokens and logprobs
    as a solo head, to the bit (float32: a split equals solo)."""
    model = tiny_model("llama", n_layers=2)
    flags = ("--context-shift", "--dtype", "float32", "--temp", "0")
    p = peer(model, tmp_path, "--dtype", "float32")
    heads = [
        head(model, tmp_path, (), *flags, parallel=1, ctx=N_CTX),
        head(model, tmp_path, [p], *flags, parallel=1, ctx=N_CTX),
    ]
    try:
        for w in (p, *heads):
            w.wait_ready()
        solo, split = (_complete(w, {"prompt": PROMPT, "n_predict": 150, "cache_prompt": False}) for w in heads)
        assert split["truncated"] and split["tokens_predicted"] == 150
        assert split["tokens"] == solo["tokens"] and _logprobs(split) == _logprobs(solo)
        assert heads[1].status()["stages"][1]["layers"] == [1, 2]
    finally:
        for w in (*heads, p):
            w.stop()
