"""Adaptive draft lengths (engine/spec/adaptive.py): the policy as a plain function of given
acceptances and costs, the probe schedule, the cost table's guesses; the synthetic writer's MTP
block that is right with a chosen probability; and end to end only invariants that no machine's
speed moves: exact greedy text, drafts stop when none is ever accepted, and go on when every one
is."""

from __future__ import annotations

import threading

import pytest
import torch
from stages import load

from hydra_console.engine.config import ModelSettings, SpecConfig
from hydra_console.engine.errors import UserError
from hydra_console.engine.gguf_file import GGUFFile
from hydra_console.engine.http.bodies import spec_override
from hydra_console.engine.metrics import Metrics
from hydra_console.engine.model import NextN
from hydra_console.engine.pipeline import Pipeline
from hydra_console.engine.serving.runtime import Engine
from hydra_console.engine.serving.sampling import SamplingParams
from hydra_console.engine.serving.sequence import Request
from hydra_console.engine.spec import DraftRequest, MtpDrafter, build_speculator
from hydra_console.engine.spec.adaptive import PROBE_EVERY, PROBE_MAX, AdaptiveDrafts, StepCosts, choose, gains
from hydra_console.engine.status import StatusDocument, speculative
from hydra_console.engine.synth import write_synthetic
from hydra_console.engine.text.tokenizer import Tokenizer

F32 = ModelSettings(None, "cpu", "float32", 128)


def linear(n: int, extra: int, per_token: float) -> list[float]:
    """A step of n + j tokens costs 1 + per_token * j plain steps."""
    return [1.0 + per_token * j for j in range(extra + 1)]


@pytest.mark.unit
def test_one_stream_drafts_what_pays_for_its_verify():
    assert gains([0.5, 0.5, 0.5], 3) == [0.5, 0.25, 0.125]
    cheap = linear(1, 3, 0.05)  # a verify of k + 1 costs little more than one step
    assert choose([[1.0] * 3], [3], cheap) == [3]
    assert choose([[0.9] * 3], [3], cheap) == [3]
    assert choose([[0.0] * 3], [3], cheap) == [0]
    # A verify as dear as k + 1 steps: no acceptance below 1 pays for it.
    assert choose([[0.9] * 3], [3], linear(1, 3, 1.0)) == [0]
    # In between: 0.3 pays for one token at 20 % a token (1.3 / 1.2 > 1), not for two (1.39 / 1.4 < 1.3 / 1.2).
    assert choose([[0.3] * 3], [3], linear(1, 3, 0.2)) == [1]
    assert choose([[0.6] * 3], [3], linear(1, 3, 0.2)) == [2]  # 1.96 / 1.4 beats 1.6 / 1.2 and 2.18 / 1.6
    # The cap holds whatever the gain.
    assert choose([[1.0] * 3], [2], cheap[:3]) == [2]
    # Per position: a slot whose second token is never right drafts one.
    assert choose([[0.9, 0.0, 0.9]], [3], cheap) == [1]


@pytest.mark.unit
def test_several_streams_share_the_steps_cost():
    """Four slots run one length K: it is drafted while the slots' summed gains pay for what K adds to
    everyone's step; a step whose cost grows with its tokens as plain steps do (compute bound) drafts
    nothing, so it never loses to no speculation."""
    acc = [[0.9] * 3, [0.9] * 3, [0.5] * 3, [0.0] * 3]  # K = 1, 2, 3 add 2.3, 4.17, 5.76 expected tokens
    assert choose(acc, [3] * 4, linear(4, 12, 0.01)) == [3] * 4
    assert choose(acc, [3] * 4, linear(4, 12, 0.1)) == [1] * 4  # 6.3 / 1.4 within 2 % of 8.17 / 1.8: the shorter run
    assert choose(acc, [3] * 4, linear(4, 12, 0.25)) == [0] * 4  # a token costs as a plain one (4 slots)
    # A slot's cap holds: it runs less, the others K.
    assert choose(acc, [3, 3, 1, 3], linear(4, 12, 0.01)) == [3, 3, 1, 3]
    flat_then_dear = [1.0] * 5 + [3.0] * 8  # e.g. a GPU whose next tile doubles the step: 4 extra tokens fit
    assert choose(acc, [3] * 4, flat_then_dear) == [1] * 4
    # Slots that never get a token right make K dearer for all: with three of them, none drafts.
    assert choose([[0.9] * 3] + [[0.0] * 3] * 3, [3] * 4, linear(4, 12, 0.1)) == [0] * 4


@pytest.mark.unit
def test_a_padded_verify_costs_its_whole_run():
    """Where verifies are padded to 3 drafted tokens (the GPU's graphs replay runs of 1 and 4), a
    slot's first draft token costs the step of 3 more, the next two nothing more: 0.3 no longer pays
    for one token at 20 % a token (1.3 / 1.6 < 1), and a slot that drafts at all drafts what its
    padded run holds when the tokens are likely."""
    padded = lambda k: 3 if k else 0  # noqa: E731
    assert choose([[0.3] * 3], [3], linear(1, 3, 0.2)) == [1]
    assert choose([[0.3] * 3], [3], linear(1, 3, 0.2), padded) == [0]
    assert choose([[0.9] * 3], [3], linear(1, 3, 0.2), padded) == [3]
    # Two slots, K = 1: each slot's draft costs its padded run (cost index 6), not one token each.
    acc = [[0.6, 0.0, 0.0], [0.6, 0.0, 0.0]]
    assert choose(acc, [3, 3], linear(2, 6, 0.1)) == [1, 1]
    assert choose(acc, [3, 3], linear(2, 6, 0.1), padded) == [0, 0]


@pytest.mark.unit
def test_unmeasured_costs_are_guessed_so_both_ends_get_tried():
    costs = StepCosts()
    assert costs.curve(1, 3) == [1.0] * 4  # nothing known: the most tokens look free, so they are tried
    costs.record(1, 4, 2.0)
    assert costs.curve(1, 3) == [0.5, 1.0, 1.5, 2.0]  # below: scaled down, so plain decode gets tried
    costs.record(1, 1, 1.0)
    assert costs.curve(1, 3) == pytest.approx([1.0, 4 / 3, 5 / 3, 2.0])  # between: interpolated
    assert costs.curve(2, 2) == [1.0] * 3  # per number of slots
    for _ in range(64):  # the 4-token cell goes stale: guessed from the 1-token one again (flat: tried)
        costs.record(1, 1, 1.0)
    assert costs.curve(1, 3) == [1.0] * 4


@pytest.mark.unit
def test_the_slots_at_zero_probe_together_and_back_off():
    pol = AdaptiveDrafts(3)
    pol.start(0)
    for _ in range(3):  # every draft rejected: k falls to 0 (one token costs 1.5 steps)
        pol.costs.record(1, 1, 1.0)
        for t in (2, 3, 4):
            pol.costs.record(1, t, 1.0 + 0.5 * (t - 1))
        (k,) = pol.plan([0], [3])
        if k:
            pol.record(0, k, 0)
    assert pol.plan([0], [3]) == [0]
    ks = [pol.plan([0], [3])[0] for _ in range(PROBE_EVERY - 2)]
    assert ks[-1] == 1 and sum(ks) == 1  # the probe after PROBE_EVERY steps at 0
    pol.record(0, 1, 0)  # it failed: the next waits twice as long, for a new request too
    pol.start(1)
    for t in range(2, 9):
        pol.costs.record(2, t, 1.0 + 0.5 * (t - 2))
    ks = [pol.plan([0, 1], [3, 3]) for _ in range(2 * PROBE_EVERY)]
    assert ks.index([1, 1]) == 2 * PROBE_EVERY - 1 and sum(map(sum, ks)) == 2  # both slots probe, at once
    pol.record(0, 1, 0)
    pol.record(1, 1, 1)  # one was right: that slot's acceptance rises, not enough for drafts to pay
    assert pol.slots[1].p[0] > pol.slots[0].p[0]
    assert pol.plan([0, 1], [3, 3]) == [0, 0] and pol.wait == 4 * PROBE_EVERY  # a right probe alone: still longer
    pol.release(1)
    for _ in range(10):  # probes as often as can be, each one right
        pol.wait = 1
        (k,) = pol.plan([0], [3])
        assert k >= 1
        pol.record(0, k, k)
    pol.wait = PROBE_MAX
    assert pol.plan([0], [3])[0] >= 1  # its acceptance rose: drafts are back, no probe needed
    assert pol.wait == PROBE_EVERY  # and the next time they stop, the first probe comes soon
    snap = pol.snapshot()
    assert snap[0]["slot"] == 0 and len(snap[0]["acceptance"]) == 3


@pytest.mark.unit
def test_the_flag_and_the_request_field():
    assert SpecConfig("mtp").adapts and not SpecConfig("ngram").adapts
    assert not SpecConfig("mtp", adaptive=False).adapts and SpecConfig("ngram", adaptive=True).adapts
    assert spec_override(SpecConfig("mtp"), {"speculative": {"adaptive": False}}).adaptive is False
    with pytest.raises(UserError, match="adaptive"):
        spec_override(SpecConfig("mtp"), {"speculative": {"adaptive": "yes"}})


@pytest.mark.parametrize("accuracy", [0.3, 0.6, 0.9])
def test_the_writer_makes_an_mtp_block_right_with_the_asked_probability(tmp_path, accuracy):
    """Over the whole vocabulary the block's pick equals the trunk's in the asked share of tokens;
    and fixed 1-token drafts through the engine are accepted at about that rate."""
    path = write_synthetic(
        tmp_path / "m.gguf", "qwen35", n_layers=2, nextn=True, bigram=True, mtp_accuracy=accuracy, vocab_size=2048
    )
    stage = load(path, n_slots=1, n_ctx=2112)
    n = stage.cfg.n_vocab
    ids, zeros = torch.arange(n), torch.zeros(n, dtype=torch.long)
    trunk = stage.project(stage.final_norm(stage.run_layers(stage.embed(ids), zeros, ids))).argmax(-1)
    nextn = NextN(stage)
    block = nextn.logits(nextn.run(ids, torch.zeros(n, stage.cfg.n_embd), zeros, ids)).argmax(-1)
    assert float((block == trunk).float().mean()) == pytest.approx(accuracy, abs=0.05)
    prompts = [[5 + 97 * i, 11 + 31 * i] for i in range(8)]
    _, stats, _ = run(path, prompts, SpecConfig("mtp", n_max=1, p_min=0.0, adaptive=False), max_tokens=40)
    print(f"asked {accuracy}: block right on {float((block == trunk).float().mean()):.3f} of the vocabulary, {stats}")
    assert stats.acceptance == pytest.approx(accuracy, abs=0.15)


def run(path, prompts, spec: SpecConfig, max_tokens: int = 48, n_slots: int = 4, watch=None, cost=None):
    """Greedy outputs of `prompts` submitted together, the acceptance counters, and what `watch(engine)`
    saw after each event. `cost(n, tokens)`: what a step of n slots verifying `tokens` costs the
    adaptive policy, in place of the time it took here (a shared CI box's timings are noise)."""
    g = GGUFFile(path)
    stage = load(path, n_slots=n_slots, n_ctx=256)
    speculator = build_speculator(spec, None, g, F32, n_slots, head=stage)
    if cost is not None:
        adaptive = speculator.adaptive
        adaptive.timed = lambda n, tokens, _seconds: AdaptiveDrafts.timed(adaptive, n, tokens, cost(n, tokens))
    eng = Engine(Pipeline(stage), Tokenizer.from_gguf(g), n_slots, 256, speculator=speculator).start()
    results, seen = {}, []

    def one(i, prompt):
        req = Request(prompt, SamplingParams(temperature=0.0), max_tokens=max_tokens, ignore_eos=True)
        ids = []
        for ev in eng.generate(req, timeout=120):
            ids += [t.id for t in ev.tokens]
            if watch is not None:
                seen.append(watch(eng))
        results[i] = ids

    try:
        for batch in range(0, len(prompts), n_slots):
            threads = [threading.Thread(target=one, args=(i, prompts[i])) for i in range(batch, batch + n_slots)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=180)
        return [results[i] for i in range(len(prompts))], eng.spec_stats.snapshot(spec), seen
    finally:
        eng.stop()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("adaptive")
    return {
        a: write_synthetic(root / f"m{a}.gguf", "qwen35", n_layers=2, nextn=True, bigram=True, mtp_accuracy=a)
        for a in (0.0, 0.5, 1.0)
    }


def scrape(eng) -> str:
    """The worker's /metrics text for this engine."""
    doc = StatusDocument("head", "127.0.0.1", 0)
    doc.engine = eng
    return Metrics(doc).render().decode()


def test_adaptive_greedy_equals_plain_greedy(models):
    prompts = [[5, 17], [300, 12], [45, 99], [7, 512]]
    plain, _, _ = run(models[0.5], prompts, SpecConfig())
    adaptive, stats, texts = run(models[0.5], prompts, SpecConfig("mtp", p_min=0.0), watch=scrape)
    fixed, _, _ = run(models[0.5], prompts, SpecConfig("mtp", p_min=0.0, adaptive=False))
    assert adaptive == plain == fixed
    assert stats.drafts > 0 and stats.adaptive and stats.type == "mtp"
    assert any('hydra_spec_slot_draft_k{slot="3"}' in t and "hydra_spec_slot_acceptance{" in t for t in texts)


def test_no_acceptance_drafts_stop_and_full_acceptance_keeps_n_max(models):
    """Every draft rejected: after a few, the slots draft only their probes (k 0 in /status's per-slot
    part). Every draft right: the slots draft n-max. Both at given step costs, not this machine's."""
    prompts = [[5, 17], [300, 12]]
    ks = lambda eng: [s.k for s in speculative(eng).slots]  # noqa: E731  (what /status shows)
    # A CPU's costs: each token a verify adds costs a quarter of a plain step of the batch. The policy
    # acts on what it measures; measured here, a loaded CI box's noise decided (78 drafts at acceptance 0
    # in one clean-clone run: a 2-token step measured no dearer than a plain one).
    cpu_like = lambda n, tokens: 1.0 + 0.25 * (tokens - n)  # noqa: E731
    mtp = SpecConfig("mtp", p_min=0.0)
    _, none, seen = run(models[0.0], prompts, mtp, max_tokens=96, n_slots=2, watch=ks, cost=cpu_like)
    print("acceptance 0:", none)
    assert none.accepted == 0 and none.drafts <= 2 * (6 + 96 // PROBE_EVERY)
    late = [k for ks_ in seen[len(seen) // 2 :] for k in ks_]
    assert late and late.count(0) >= 0.8 * len(late)
    _, full, seen = run(models[1.0], prompts, mtp, max_tokens=96, n_slots=2, watch=ks, cost=cpu_like)
    print("acceptance 1:", full)
    late = [k for ks_ in seen[len(seen) // 2 :] for k in ks_]  # n-max (3) while the requests have room for it
    assert full.acceptance == 1.0 and late and late.count(3) >= 0.8 * len(late), late


def test_a_resting_slot_catches_up_the_blocks_kv(tiny_model):
    """A slot at k = 0 skips the MTP block's run on its steps; before its next draft the block runs over
    the rows it skipped, so its KV and its drafts are those of a slot that followed every step
    (random weights: the block's attention reads that KV)."""
    path = tiny_model("qwen35", n_layers=4, nextn=True)
    stage = load(path, n_slots=2, n_ctx=128)
    ids = [5, 17, 300, 45, 99, 512, 7, 8, 9, 10, 11, 12]
    n = len(ids)
    at = lambda *xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
    h = stage.final_norm(
        stage.run_layers(stage.embed(torch.tensor(ids)), torch.zeros(n, dtype=torch.long), torch.arange(n))
    )
    mtp = MtpDrafter(NextN(stage), p_min=0.0)
    for slot, resting in ((0, False), (1, True)):
        mtp.observe(torch.tensor(ids[:4]), torch.full((4,), slot), torch.arange(4), h[:4])  # the prompt
        mtp.rest(slot, resting)
        for p in range(4, n):
            mtp.observe(at(ids[p]), at(slot), at(p), h[p : p + 1])
        mtp.rest(slot, False)
    kv = [mtp.state_out(s, n) for s in (0, 1)]  # state_out catches a resting slot up first
    assert kv[0].keys() == kv[1].keys() and len(kv[0]) > 1
    for name in kv[0]:
        torch.testing.assert_close(kv[1][name], kv[0][name], atol=1e-5, rtol=1e-4)
    drafts = mtp.draft_batch([DraftRequest(0, ids, 3), DraftRequest(1, ids, 3)])
    assert drafts[0].tokens == drafts[1].tokens and len(drafts[0]) == 3


def test_overlapped_plain_steps_are_timed(tiny_model):
    """A GPU engine overlaps plain decode steps (the next launches before the host reads the last): back
    to back, the time between two launches is what a step costs, and the policy's cost curve must
    hold it (unmeasured, plain decode was guessed a quarter of a 4-token verify, and drafts that
    paid were refused). Overlap forced on this CPU: the same engine code."""
    path = tiny_model("llama", n_layers=2)
    g = GGUFFile(path)
    stage = load(path, n_slots=1, n_ctx=128)
    eng = Engine(Pipeline(stage), Tokenizer.from_gguf(g), 1, 128, overlap=True).start()
    try:
        req = Request([5, 17, 300], SamplingParams(temperature=0.0), max_tokens=16, ignore_eos=True)
        assert sum(len(ev.tokens) for ev in eng.generate(req, timeout=120)) == 16
    finally:
        eng.stop()
    assert eng.stats.overlapped > 0
    assert eng.spec.adaptive.costs.table().get((1, 1), 0) > 0
