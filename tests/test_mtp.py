"""MTP drafting (qwen35's NextN block): agreement with llama.cpp's MTP graph, greedy with MTP equal to
greedy without it (solo and split across real processes), acceptance counted on a model whose MTP
block provably predicts the trunk's next token, and the block's KV in the accounting."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import threading
from pathlib import Path

import pytest
import torch
from rpc_workers import MTP_EVERY_STEP, complete, peer, running, solo_and_split
from stages import load

from hydra_console.engine.config import ModelSettings, SpecConfig
from hydra_console.engine.errors import UserError
from hydra_console.engine.gguf_file import GGUFFile
from hydra_console.engine.model import ROLLBACK, ModelConfig, NextN
from hydra_console.engine.pipeline import Pipeline
from hydra_console.engine.rpc.client import RemoteStage
from hydra_console.engine.serving.runtime import Engine
from hydra_console.engine.serving.sampling_params import Sampler, SamplingParams
from hydra_console.engine.serving.sequence import Request
from hydra_console.engine.spec import (
    Draft,
    DraftRequest,
    MtpDrafter,
    Speculator,
    build_speculator,
    check_speculative,
)
from hydra_console.engine.synth import write_synthetic
from hydra_console.engine.text.tokenizer import Tokenizer

REFERENCE = Path(__file__).resolve().parent / "data" / "reference" / "qwen35"
F32_MAX_ABS = 5e-5  # as test_qwen35: refdump-style dumpers print 5 decimals
F32 = ModelSettings(None, "cpu", "float32", 128)
PROMPTS = ("hello world hello world hello", "a b a b a b a", "the cat sat on the")


def trunk_hidden(stage, ids: list[int]) -> torch.Tensor:
    """The trunk's normed last hidden states (llama.cpp's h_nextn) of `ids` run in slot 0 from position 0."""
    n = len(ids)
    return stage.final_norm(
        stage.run_layers(stage.embed(torch.tensor(ids)), torch.zeros(n, dtype=torch.long), torch.arange(n))
    )


def test_mtp_logits_and_draft_chain_agree_with_llama_cpp(tmp_path):
    """Fixture from mtpdump.cpp (README.md): llama.cpp's MTP logits at every prompt position (token p
    with the trunk's h of p - 1), then its greedy chain of draft steps fed the block's own h."""
    spec = importlib.util.spec_from_file_location("make_reference", REFERENCE / "make_reference.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    ref = json.loads((REFERENCE / "mtp_f32.json").read_text())
    path = write_synthetic(tmp_path / "mtp.gguf", "qwen35", **mod.MTP_MODEL)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == ref["sha256"], (
        "synthetic model changed: regenerate (README.md)"
    )
    stage = load(path, n_slots=1)
    nextn = NextN(stage)
    ids, n = ref["ids"], len(ref["ids"])
    h = trunk_hidden(stage, ids)
    assert int(stage.project(h[-1:]).argmax()) == ref["target_next"]
    h_prev = torch.cat([torch.zeros(1, h.shape[1]), h[:-1]])
    logits = nextn.logits(nextn.run(torch.tensor(ids), h_prev, torch.zeros(n, dtype=torch.long), torch.arange(n)))
    rows = ref["top10"]
    top1 = sum(int(logits[r["pos"]].argmax()) == r["top"][0][0] for r in rows) / len(rows)
    diffs = torch.tensor([[abs(float(logits[r["pos"], i]) - v) for i, v in r["top"]] for r in rows])
    margins = torch.tensor([r["top"][0][1] - r["top"][1][1] for r in rows])
    print(
        f"MTP top-1 {top1:.3f}, max |dlogit| {float(diffs.max()):.2e} on llama.cpp's top-10; "
        f"margin min {float(margins.min()):.3g} p10 {float(margins.quantile(0.1)):.3g} median {float(margins.median()):.3g}"
    )
    assert top1 == 1.0 and float(diffs.max()) < F32_MAX_ABS
    # The chain, step by step against llama.cpp's logits, then through the drafter itself.
    tok, hh = ref["target_next"], h[-1:]
    for step, r in enumerate(ref["drafts"]):
        hh = nextn.run(torch.tensor([tok]), hh, torch.zeros(1, dtype=torch.long), torch.tensor([n + step]))
        lg = nextn.logits(hh)[0]
        assert max(abs(float(lg[i]) - v) for i, v in r["top"]) < F32_MAX_ABS
        tok = int(lg.argmax())
    stage.kv_clear(0)
    drafter = MtpDrafter(NextN(stage), p_min=0.0)
    drafter.observe(torch.tensor(ids), torch.zeros(n, dtype=torch.long), torch.arange(n), trunk_hidden(stage, ids))
    draft = drafter.draft_batch([DraftRequest(0, ids + [ref["target_next"]], len(ref["drafts"]))])[0]
    assert draft.tokens == [r["top"][0][0] for r in ref["drafts"]]


def _engine_outputs(
    path,
    spec_type: str,
    p_min: float,
    n_slots: int = 3,
    max_tokens: int = 30,
    device: str = "cpu",
    prompts=PROMPTS,
    adaptive: bool | None = None,
    run_lengths: tuple[int, ...] | None = None,
    costs: dict | None = None,
    n_max: int = 3,
    peer: str | None = None,
    **stage_kw,
):
    """Greedy outputs of `prompts` (texts or token ids) submitted together (slots batched), and the
    acceptance counters; `stage_kw` for the stage (`load`'s float32 unless it says otherwise).
    `adaptive` False drafts n-max every step (the acceptance tests count what fixed drafts get).
    `run_lengths`: the head stage's as if its graphs replayed only those (verifies padded to them);
    `costs` gets the adaptive policy's step costs by (slots, tokens verified). `peer`: the RPC address
    of a peer worker that runs the second half of the layers (the head here runs the first half)."""
    g = GGUFFile(path)
    tok = Tokenizer.from_gguf(g)
    n_layers = ModelConfig.from_gguf(g).n_layers
    layers = (0, n_layers // 2 if peer else n_layers)
    stage = load(path, layers=layers, n_slots=n_slots, n_ctx=128, device=device, **stage_kw)
    if run_lengths is not None:
        stage.graph_run_lengths = run_lengths
    cfg = SpecConfig(type=spec_type, n_max=n_max, p_min=p_min, adaptive=adaptive)
    spec = build_speculator(cfg, None, g, F32, n_slots, head=stage)
    pipeline = Pipeline(stage)
    if peer:
        rest = (layers[1], n_layers)
        remote = RemoteStage(peer, rest, g=g, dtype=torch.float32, n_slots=n_slots, n_ctx=128, max_run=1 + n_max)
        remote.attach()
        pipeline = Pipeline(stage, [remote], ranges=[layers, rest])
    eng = Engine(pipeline, tok, n_slots, 128, speculator=spec).start()
    results = {}

    def one(i, prompt):
        ids = []
        ids_in = prompt if isinstance(prompt, list) else tok.encode(prompt)
        req = Request(ids_in, SamplingParams(temperature=0.0), max_tokens=max_tokens, ignore_eos=True)
        for ev in eng.generate(req, timeout=120):
            ids += [t.id for t in ev.tokens]
        results[i] = ids

    try:
        threads = [threading.Thread(target=one, args=(i, p)) for i, p in enumerate(prompts)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=180)
        return [results[i] for i in range(len(prompts))], eng.spec_stats.snapshot(spec.config)
    finally:
        eng.stop()
        for r in pipeline.remotes:
            r.close()
        if costs is not None:
            costs.update(spec.adaptive.costs.table())


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")),
    ],
)
def test_greedy_with_mtp_equals_greedy_without(tiny_model, device):
    """Random weights: most drafts are rejected (p-min 0 drafts every step), so the recurrent state and
    the block's KV go through many rollbacks, with three slots batched; the tokens do not change.
    On CUDA the plain run decodes through the captured graphs, the MTP run through verify batches."""
    path = tiny_model("qwen35", n_layers=4, nextn=True)
    plain, _ = _engine_outputs(path, "off", 0.75, device=device)
    with_mtp, stats = _engine_outputs(path, "mtp", 0.0, device=device)
    assert with_mtp == plain
    assert stats.type == "mtp" and stats.draft_tokens > 0 and stats.accepted < stats.draft_tokens


def test_verifies_padded_to_the_graphs_run_length_change_no_token_and_no_counter(tiny_model):
    """A GPU stage replays verifies of draft max + 1 tokens only: shorter drafts (p-min cuts them
    here) run with filler rows up to that length. Forced on CPU through the stage's
    `graph_run_lengths`: the text is plain greedy's, the acceptance counters those of the unpadded
    run (filler is never drafted nor accepted), and every step verified 1 or 4 tokens per slot (the
    step costs' keys), where the unpadded run verified 2 and 3 too. The adaptive run (k per slot
    varies) pads as well."""
    path = tiny_model("qwen35", n_layers=4, nextn=True)
    plain, _ = _engine_outputs(path, "off", 0.75)
    unpadded_costs, padded_costs = {}, {}
    unpadded, want = _engine_outputs(path, "mtp", 0.2, adaptive=False, costs=unpadded_costs)
    padded, got = _engine_outputs(path, "mtp", 0.2, adaptive=False, run_lengths=(1, 4), costs=padded_costs)
    assert padded == unpadded == plain
    assert got.drafts == want.drafts and got.draft_tokens == want.draft_tokens and got.accepted == want.accepted
    assert got.accepted_per_pos == want.accepted_per_pos
    assert 0 < got.draft_tokens < 2 * got.drafts  # mostly one-token drafts: the padded path ran
    assert any((t - n) % 3 for n, t in unpadded_costs)
    assert all((t - n) % 3 == 0 for n, t in padded_costs) and any(t > n for n, t in padded_costs)
    adaptive, stats = _engine_outputs(path, "mtp", 0.0, run_lengths=(1, 4))
    assert adaptive == plain and stats.draft_tokens > 0


def test_padded_verifies_through_a_split_equal_solo(tiny_model, tmp_path):
    """The peer (a real worker process) runs the head's padded rows as they come: the split's text
    with padded MTP verifies is solo plain greedy's, and its counters those of the solo padded run."""
    path = tiny_model("qwen35", n_layers=4, nextn=True)
    plain, _ = _engine_outputs(path, "off", 0.75)
    solo, want = _engine_outputs(path, "mtp", 0.2, adaptive=False, run_lengths=(1, 4))
    costs = {}
    with running(peer(path, tmp_path, "--dtype", "float32")) as p:
        split, got = _engine_outputs(path, "mtp", 0.2, adaptive=False, run_lengths=(1, 4), peer=p.rpc_addr, costs=costs)
    assert split == solo == plain
    assert all((t - n) % 3 == 0 for n, t in costs) and any(t > n for n, t in costs)
    assert (got.drafts, got.draft_tokens, got.accepted) == (want.drafts, want.draft_tokens, want.accepted)


def test_padded_verifies_count_only_the_drafted_tokens_as_accepted(tiny_model):
    """The bigram model's block drafts the trunk's own continuation: with draft max 2 on graphs that
    replay verifies of 4 (as a request's smaller n-max on a server warmed up for 3), every draft is
    padded and every drafted token is accepted, no filler ever."""
    path = tiny_model("qwen35", n_layers=4, nextn=True, bigram=True)
    plain, _ = _engine_outputs(path, "off", 0.75)
    costs = {}
    padded, stats = _engine_outputs(path, "mtp", 0.0, adaptive=False, n_max=2, run_lengths=(1, 4), costs=costs)
    assert padded == plain
    # Drafts of 2 (of 1 where max_tokens ends them): all accepted, no filler among them.
    assert stats.drafts > 0 and stats.draft_tokens <= 2 * stats.drafts and stats.accepted == stats.draft_tokens
    assert stats.accepted_per_pos[1] > 0 and len(stats.accepted_per_pos) == 2
    assert all((t - n) % 3 == 0 for n, t in costs) and any(t > n for n, t in costs)


@pytest.mark.parametrize("qtype", ["F32", "Q5_K_M"])
def test_mtp_drafts_are_accepted_on_a_model_whose_block_predicts_the_next_token(tiny_model, qtype):
    """`bigram`: the trunk's logits depend on the current token only and the NextN block passes the
    token's embedding through, so each draft is the trunk's own greedy continuation: acceptance must
    be (near) total, and the output still that of plain greedy. Also in the users' K-quant mix (the
    writer once drew its identity `eh_proj` as random blocks there: acceptance 0 on the 27B file)."""
    shape = dict(n_embd=256, n_ff=512, head_dim=64, ssm_state=64, ssm_groups=2, ssm_v_heads=4) if qtype != "F32" else {}
    path = tiny_model("qwen35", n_layers=4, nextn=True, bigram=True, qtype=qtype, **shape)
    plain, _ = _engine_outputs(path, "off", 0.75)
    with_mtp, stats = _engine_outputs(path, "mtp", 0.0, adaptive=False)
    print("bigram MTP:", stats)
    assert with_mtp == plain
    assert stats.drafts > 0 and stats.acceptance > 0.9 and stats.mean_accepted_len > 3.5
    assert stats.accepted_per_pos[0] >= 0.9 * stats.drafts


def test_the_block_predicts_the_trunks_token_in_bfloat16_and_every_draft_is_accepted(tiny_model):
    """Issue 37: on the bigram file llama.cpp's draft-mtp accepts every draft; Hydra lost the first
    token of 7 drafts in 73 on a GPU. There the block's h' is norm(eh_proj([norm(e); ..])) =
    norm(norm(e)) and the trunk's h is norm(e): equal, unless eh_proj's input is first rounded to the
    16-bit compute dtype. It was: a quarter of h's components one bfloat16 step off, which flips the
    top token where the top two logits (nearly) tie, and in bfloat16 logits (a GPU's output head,
    and this stage's) they often tie exactly. Checked over the whole vocabulary, then through the
    engine (greedy, n-max 3, p-min 0) from prompts that lead to the trunk's closest calls."""
    path = tiny_model("qwen35", n_layers=2, nextn=True, bigram=True, vocab_size=4096)
    bf16 = dict(dtype="bfloat16", int8=False)  # dense bfloat16 weights: bfloat16 logits, as on a GPU
    stage = load(path, n_slots=1, n_ctx=4160, **bf16)
    n = stage.cfg.n_vocab
    ids, zeros = torch.arange(n), torch.zeros(n, dtype=torch.long)
    logits = stage.project(stage.final_norm(stage.run_layers(stage.embed(ids), zeros, ids)))
    trunk = logits.argmax(-1)
    nextn = NextN(stage)
    block = nextn.logits(nextn.run(ids, torch.zeros(n, stage.cfg.n_embd), zeros, ids)).argmax(-1)
    assert (block != trunk).nonzero().flatten().tolist() == []
    # Each prompt ends in a token p whose trunk token x = trunk[p] has the closest top two logits:
    # the first draft after the prompt is the block's token after x.
    top2 = logits.topk(2).values
    margin = (top2[:, 0] - top2[:, 1]).tolist()
    before = {x: p for p, x in enumerate(trunk.tolist())}
    prompts = [[7, before[x]] for x in sorted(before, key=lambda x: margin[x])[:4]]
    plain, _ = _engine_outputs(path, "off", 0.75, n_slots=4, max_tokens=48, prompts=prompts, **bf16)
    with_mtp, stats = _engine_outputs(
        path, "mtp", 0.0, n_slots=4, max_tokens=48, prompts=prompts, adaptive=False, **bf16
    )
    print("bigram MTP, bfloat16:", stats)
    assert with_mtp == plain
    assert stats.drafts >= 40 and stats.accepted == stats.draft_tokens
    assert stats.accepted_per_pos[0] == stats.drafts


def test_greedy_drafts_of_several_slots_chain_on_the_device_and_stop_at_their_own_k_and_p_min(tiny_model):
    """Slots drafting together (one chain for all, each step's argmax fed on without a host round
    trip) get the drafts each would get alone: cut at their own k, and empty under a p-min no
    probability reaches."""
    path = tiny_model("qwen35", n_layers=4, nextn=True)
    stage = load(path, n_slots=2, n_ctx=128)
    prompts = [[5, 17, 300, 45, 99], [7, 8, 9]]
    drafter = MtpDrafter(NextN(stage), p_min=0.0)
    for slot, ids in enumerate(prompts):
        slots, positions = torch.full((len(ids),), slot, dtype=torch.long), torch.arange(len(ids))
        hidden = stage.final_norm(stage.run_layers(stage.embed(torch.tensor(ids)), slots, positions))
        drafter.observe(torch.tensor(ids), slots, positions, hidden)
    alone = [drafter.draft_batch([DraftRequest(s, prompts[s], 3)])[0].tokens for s in (0, 1)]
    assert all(len(d) == 3 for d in alone)
    both = drafter.draft_batch([DraftRequest(0, prompts[0], 3), DraftRequest(1, prompts[1], 1)])
    assert [d.tokens for d in both] == [alone[0], alone[1][:1]]
    picky = drafter.draft_batch([DraftRequest(0, prompts[0], 3, p_min=1.01), DraftRequest(1, prompts[1], 2)])
    assert [d.tokens for d in picky] == [[], alone[1][:2]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_draft_chains_graph_drafts_what_the_eager_chain_drafts(tiny_model):
    """On a GPU the greedy chain replays from a graph per batch bucket and k (`nextn_graphs`): the
    same operations on the same kernels as the eager chain, so the same drafts, and the block's KV
    left as the eager steps leave it (the second chain drafts from it)."""
    path = tiny_model("qwen35", n_layers=4, nextn=True)
    drafts = []
    for graphed in (True, False):
        stage = load(path, n_slots=4, n_ctx=128, device="cuda", dtype="bfloat16")
        drafter = MtpDrafter(NextN(stage), p_min=0.0)
        assert drafter.graphs is not None
        if not graphed:
            drafter.graphs = None
        prompts = [[5, 17, 300, 45, 99], [7, 8, 9], [11, 12]]
        for slot, ids in enumerate(prompts):
            slots, positions = torch.full((len(ids),), slot, dtype=torch.long), torch.arange(len(ids))
            hidden = stage.final_norm(stage.run_layers(stage.embed(torch.tensor(ids)), slots, positions))
            drafter.observe(torch.tensor(ids), slots, positions, hidden)
        first = [d.tokens for d in drafter.draft_batch([DraftRequest(s, p, 3) for s, p in enumerate(prompts)])]
        again = [d.tokens for d in drafter.draft_batch([DraftRequest(0, prompts[0] + first[0][:1], 2)])]
        drafts.append((first, again))
        if graphed:
            # buckets 4 and 1 were captured and replayed; p-min 0: the chains take no top-k
            assert set(drafter.graphs.graphs) == {(4, 3, 0), (1, 2, 0)}
    assert drafts[0] == drafts[1]


def test_sampled_requests_draft_through_their_own_sampler(tiny_model):
    """temperature > 0: the block's draft is drawn from the request's sampler and verified by rejection
    sampling; on the bigram model the two distributions are the same, so drafts are accepted."""
    path = tiny_model("qwen35", n_layers=4, nextn=True, bigram=True)
    g = GGUFFile(path)
    stage = load(path, n_slots=1, n_ctx=128)
    spec = build_speculator(SpecConfig(type="mtp", n_max=3, p_min=0.0), None, g, F32, 1, head=stage)
    eng = Engine(Pipeline(stage), Tokenizer.from_gguf(g), 1, 128, speculator=spec).start()
    try:
        req = Request([5, 17, 300], SamplingParams(temperature=0.8, seed=3), max_tokens=30, ignore_eos=True)
        n = sum(len(ev.tokens) for ev in eng.generate(req, timeout=120))
    finally:
        eng.stop()
    stats = eng.spec_stats
    assert n == 30 and stats.drafts > 0 and stats.accepted >= 0.9 * stats.draft_tokens


def test_a_draft_of_the_greedy_continuation_is_accepted_fully(tiny_model):
    """Verification: a 3-token draft that is exactly the model's greedy continuation yields 4 tokens."""
    path = tiny_model("qwen35", n_layers=4, nextn=True)
    stage = load(path, n_slots=1, n_ctx=128)
    pipe, prompt = Pipeline(stage), [5, 17, 300, 45, 99, 512, 7]
    zeros = lambda n: torch.zeros(n, dtype=torch.long)  # noqa: E731
    n = len(prompt)
    cont = [int(pipe.forward(torch.tensor(prompt), zeros(n), torch.arange(n), torch.tensor([n - 1]))[0].argmax())]
    for i in range(4):
        cont.append(int(pipe.forward(torch.tensor(cont[-1:]), zeros(1), torch.tensor([n + i]), zeros(1))[0].argmax()))
    stage.kv_clear(0)
    pipe.forward(torch.tensor(prompt), zeros(n), torch.arange(n), torch.tensor([n - 1]))
    rows = pipe.forward(torch.tensor(cont[:4]), zeros(4), torch.arange(n, n + 4), torch.arange(4))  # c0 + draft c1..c3
    spec = Speculator(SpecConfig(type="ngram"))
    emitted = spec.verify(rows, Draft(cont[1:4]), Sampler(SamplingParams(temperature=0.0)), prompt + cont[:1])
    assert emitted == cont[1:5]
    assert spec.stats.accepted == 3 and spec.stats.accepted_per_pos == [1, 1, 1]


def test_mtp_needs_the_nextn_block_and_counts_its_kv(tiny_model):
    plain = GGUFFile(tiny_model("qwen35", n_layers=2))
    with pytest.raises(UserError, match="qwen35 GGUF has no MTP block"):
        check_speculative(SpecConfig(type="mtp"), None, plain)
    with pytest.raises(UserError, match="speculative type 'mtp' is not available"):
        Speculator(SpecConfig(type="ngram")).request_config(SpecConfig(type="mtp"))
    path = tiny_model("qwen35", n_layers=2, nextn=True)
    stage = load(path, n_slots=2, n_ctx=64)
    spec = build_speculator(SpecConfig(type="mtp"), None, GGUFFile(path), F32, 2, head=stage)
    cfg = stage.cfg
    assert spec.drafter_kv_bytes == 2 * 2 * cfg.n_head_kv * 64 * cfg.head_dim * 4  # K and V, 2 slots, fp32
    assert spec.stats.snapshot(spec.config, spec.drafter_kv_bytes).kv_bytes == spec.drafter_kv_bytes
    assert spec.max_draft == 4 and spec.request_config(SpecConfig(type="mtp")).type == "mtp"
    # The head's accounting: one DeltaNet layer's conv + SSM state and its ROLLBACK checkpoints
    # (j = 1..4 tokens back) beside one attention layer's KV.
    net, attn_kv = stage.recurrent[0], 2 * 2 * cfg.n_head_kv * 64 * cfg.head_dim * 4
    per_state = net.conv_state.nbytes + net.ssm_state.nbytes
    assert stage.state_bytes == (1 + ROLLBACK) * per_state and stage.kv_bytes == stage.state_bytes + attn_kv


@pytest.fixture(scope="module")
def split_mtp(tiny_model, tmp_path_factory):
    """Real processes: a solo head without speculation, and a head running MTP with a peer holding
    half of the trunk (float32)."""
    model = tiny_model("qwen35", n_layers=4, nextn=True)
    logs = tmp_path_factory.mktemp("mtp-split-logs")
    with solo_and_split(model, logs, "--split", "2/2", *MTP_EVERY_STEP) as workers:
        yield workers


def test_mtp_on_a_split_pipeline_equals_solo_greedy(split_mtp):
    w, solo = split_mtp["head"], split_mtp["solo"]
    for prompt in ("hello world", "the quick brown fox"):
        got = complete(w, prompt, 24, temperature=0.0, cache_prompt=False).json()["choices"][0]["text"]
        want = complete(solo, prompt, 24, temperature=0.0, cache_prompt=False).json()["choices"][0]["text"]
        assert got == want
    status = w.status()
    spec = status["speculative"]
    assert spec["type"] == "mtp" and spec["draft_tokens"] > 0 and spec["acceptance"] is not None
    assert spec["kv_bytes"] > 0 and status["stages"][0]["kv_bytes"] > 0
    assert split_mtp["peer"].status()["stages"][0]["kv_bytes"] > 0  # the peer's KV and DeltaNet state
