"""Speculative decoding in the Engine on real models: greedy output equals non-speculative greedy
token for token (n-gram and draft-model drafters, slots batched, the default model), the draft
model drafter itself, and rejection sampling through the real Speculator and Sampler."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest
import torch

from hydra_console.engine.config import ModelSettings
from hydra_console.engine.errors import UserError
from hydra_console.engine.gguf_file import GGUFFile
from hydra_console.engine.model import build_stage
from hydra_console.engine.pipeline import Pipeline
from hydra_console.engine.serving.runtime import Engine, Request
from hydra_console.engine.serving.sampling import Rows, distribution
from hydra_console.engine.serving.sampling_params import Sampler, SamplingParams
from hydra_console.engine.spec import (
    Draft,
    DraftModelDrafter,
    DraftRequest,
    SpecConfig,
    Speculator,
    build_speculator,
    check_same_vocab,
)
from hydra_console.engine.text.tokenizer import Tokenizer

N_SLOTS, N_CTX = 3, 192
PROMPTS = ["the quick brown fox", "hello world hello world", "a b c d e f", "night and day and night"]
GREEDY = SamplingParams(temperature=0.0)


def _pipeline(path, n_slots=N_SLOTS, dtype="float32") -> Pipeline:
    # Deterministic: a token's floats do not depend on its batch (a verify's k + 1 rows against one step's
    # one), so a seeded draw near a tie cannot part the texts (a loaded suite run's once did, seed 3).
    stage = build_stage(GGUFFile(path), device="cpu", dtype=dtype, n_slots=n_slots, n_ctx=N_CTX, deterministic=True)
    return Pipeline(stage)


@pytest.fixture(scope="module")
def target(tiny_model):
    path = tiny_model("llama")
    return path, Tokenizer.from_gguf(GGUFFile(path))


@pytest.fixture(scope="module")
def plain_outputs(target):
    """Non-speculative greedy continuations, one request at a time."""
    path, tok = target
    eng = Engine(_pipeline(path), tok, N_SLOTS, N_CTX).start()
    try:
        return [_run(eng, tok.encode(p), None)[0] for p in PROMPTS]
    finally:
        eng.stop()


def _run(eng: Engine, prompt: list[int], spec: SpecConfig | None, params=GREEDY, n=40):
    ids, final = [], None
    for ev in eng.generate(Request(prompt, params, max_tokens=n, ignore_eos=True, spec=spec), timeout=60):
        ids += [t.id for t in ev.tokens]
        final = ev
    return ids, final.timings


def _run_concurrently(eng: Engine, prompts: list[list[int]], spec=None) -> list:
    results: dict[int, tuple] = {}
    threads = [
        threading.Thread(target=lambda i=i, p=p: results.__setitem__(i, _run(eng, p, spec)))
        for i, p in enumerate(prompts)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return [results[i] for i in range(len(prompts))]


def _speculative_engine(target, draft_path=None, **cfg) -> Engine:
    path, tok = target
    draft = _pipeline(draft_path) if draft_path else None
    return Engine(_pipeline(path), tok, N_SLOTS, N_CTX, speculator=Speculator(SpecConfig(**cfg), draft)).start()


def test_ngram_speculation_is_greedy_token_for_token_with_slots_batched(target, plain_outputs):
    _, tok = target
    eng = _speculative_engine(target, type="ngram", n_max=4)
    try:
        results = _run_concurrently(eng, [tok.encode(p) for p in PROMPTS])
        assert [ids for ids, _ in results] == plain_outputs
        assert sum(t["draft_n"] for _, t in results) > 0
        assert eng.spec_stats.draft_tokens == sum(t["draft_n"] for _, t in results)
        assert eng.spec_stats.accepted == sum(t["draft_n_accepted"] for _, t in results)
    finally:
        eng.stop()


def test_draft_model_speculation_is_greedy_token_for_token(target, tiny_model, plain_outputs):
    """A different random model drafts (mostly rejected), and the target drafting for itself
    (all accepted): both give exactly the plain greedy output, with slots batched."""
    _, tok = target
    for draft_path, p_min in ((tiny_model("llama", seed=7, n_layers=1), 0.0), (target[0], 0.0)):
        eng = _speculative_engine(target, draft_path, type="draft", n_max=3, p_min=p_min)
        try:
            results = _run_concurrently(eng, [tok.encode(p) for p in PROMPTS])
            assert [ids for ids, _ in results] == plain_outputs
            drafted = sum(t["draft_n"] for _, t in results)
            accepted = sum(t["draft_n_accepted"] for _, t in results)
            assert drafted > 0
            if draft_path == target[0]:
                assert accepted == drafted
            # tokens per verify forward: 1 + accepted / drafts
            assert eng.spec_stats.snapshot().mean_accepted_len == pytest.approx(1 + accepted / eng.spec_stats.drafts)
        finally:
            eng.stop()


def test_per_request_override_turns_speculation_on_and_off(target, plain_outputs):
    _, tok = target
    eng = _speculative_engine(target, type="off")
    try:
        ids, t = _run(eng, tok.encode(PROMPTS[1]), SpecConfig("ngram", n_max=5))
        assert ids == plain_outputs[1] and t["draft_n"] > 0
        ids, t = _run(eng, tok.encode(PROMPTS[1]), None)
        assert ids == plain_outputs[1] and t["draft_n"] == 0
    finally:
        eng.stop()


def test_sampled_speculation_is_seed_reproducible_and_logprobs_line_up(target):
    """temperature > 0 with a draft model's q: same seed, same output; each emitted token's
    logprob comes from its own verified row."""
    path, tok = target
    eng = _speculative_engine(target, path, type="draft", n_max=3, p_min=0.0)
    params = SamplingParams(temperature=0.9, top_k=40, seed=123, logprobs=1)
    try:
        outs = []
        for _ in range(2):
            # Without the prompt cache: a reused prefix changes the batch shapes and so the last bits.
            req = Request(tok.encode(PROMPTS[0]), params, max_tokens=24, ignore_eos=True, cache_prompt=False)
            events = list(eng.generate(req, timeout=60))
            outs.append([(t.id, t.logprob.logprob) for ev in events for t in ev.tokens])
        assert outs[0] == outs[1] and len(outs[0]) == 24
        assert events[-1].timings["draft_n"] > 0
        assert all(lp is not None and lp <= 0 for _, lp in outs[0])
    finally:
        eng.stop()


def _assert_each_seed_gives_the_plain_text(plain: Engine, spec: Engine, prompt: list[int], seeds: int, n: int):
    """At temperature 1, each seed's text through `spec` is the one it gives through `plain`, and
    `spec` drafted at all."""
    drafted = 0
    for seed in range(seeds):
        params = SamplingParams(temperature=1.0, seed=seed)
        want, _ = _run(plain, prompt, None, params, n=n)
        got, timings = _run(spec, prompt, None, params, n=n)
        assert got == want, seed
        drafted += timings["draft_n"]
    assert drafted > 0


def test_seeded_sampling_with_n_gram_drafts_gives_the_plain_text(target):
    """temperature > 0 with a deterministic drafter: each verified row draws the target's token with
    its own seeded randomness and the draft is kept while it matches (llama.cpp's sample-and-match),
    so the text is token for token the one the same seed gives without speculation."""
    path, tok = target
    prompt = tok.encode(PROMPTS[1])
    plain = Engine(_pipeline(path), tok, N_SLOTS, N_CTX).start()
    spec = _speculative_engine(target, type="ngram", n_max=4)
    try:
        # rejection sampling's redraw parted from the plain text on 2 of these seeds
        _assert_each_seed_gives_the_plain_text(plain, spec, prompt, seeds=6, n=40)
    finally:
        plain.stop()
        spec.stop()


def test_greedy_draft_sampling_keeps_a_seeds_text(target):
    """`--spec-draft-sampling greedy` (llama-server's default): at temperature > 0 the draft model
    drafts its argmax and the target's own seeded draw checks it, so each seed gives the plain text
    (sampled drafts, verified by rejection sampling, part from it)."""
    path, tok = target
    prompt = tok.encode(PROMPTS[0])
    plain = Engine(_pipeline(path), tok, N_SLOTS, N_CTX).start()
    greedy = _speculative_engine(target, path, type="draft", n_max=3, p_min=0.0, probabilistic=False)
    try:
        _assert_each_seed_gives_the_plain_text(plain, greedy, prompt, seeds=4, n=24)
    finally:
        plain.stop()
        greedy.stop()


def test_draft_model_drafter_follows_its_model_and_rolls_back(target):
    path, tok = target
    pipe = _pipeline(path, n_slots=2)
    drafter = DraftModelDrafter(pipe, p_min=0.0)
    prompt = tok.encode(PROMPTS[0])
    eng = Engine(_pipeline(path, n_slots=1), tok, 1, N_CTX).start()
    try:
        greedy, _ = _run(eng, prompt, None, n=8)
    finally:
        eng.stop()
    drafter.start(0, prompt)
    assert drafter.draft(0, prompt, 4) == greedy[:4]
    # The history moved on by two tokens (as after a partial accept): the drafter reuses its cache.
    assert drafter.draft(0, prompt + greedy[:2], 3) == greedy[2:5]
    # A history that diverges from what was cached (a rejected draft): drafts follow the new history.
    other = prompt + [greedy[0], (greedy[1] + 1) % tok.vocab_size]
    fresh = DraftModelDrafter(_pipeline(path, n_slots=1), p_min=0.0)
    assert drafter.draft(0, other, 3) == fresh.draft(0, other, 3)
    # Two slots in one batch draft the same as each alone.
    both = drafter.draft_batch([DraftRequest(0, prompt, 3), DraftRequest(1, other, 3)])
    assert [d.tokens for d in both] == [greedy[:3], fresh.draft(0, other, 3)]
    # p_min: a draft-model token below it is not proposed.
    assert DraftModelDrafter(pipe, p_min=1.0).draft(1, prompt, 3) == []
    # ... its probability taken over the top 10 logits, as llama.cpp's draft-simple takes it
    n = len(prompt)
    logits = (
        _pipeline(path, n_slots=1)
        .forward(torch.tensor(prompt), torch.zeros(n, dtype=torch.long), torch.arange(n), torch.tensor([n - 1]))[0]
        .float()
    )
    full, top10 = float(torch.softmax(logits, -1).max()), float(torch.softmax(logits.topk(10).values, -1)[0])
    assert full < top10
    between = DraftModelDrafter(_pipeline(path, n_slots=1), p_min=(full + top10) / 2)
    assert between.draft(0, prompt, 1) == greedy[:1]


def test_draft_model_must_share_the_vocabulary(tiny_model, tmp_path):
    llama, qwen = GGUFFile(tiny_model("llama")), GGUFFile(tiny_model("qwen2"))
    check_same_vocab(llama, GGUFFile(tiny_model("llama", seed=3, n_layers=1)))
    with pytest.raises(UserError, match="vocabulary"):
        check_same_vocab(llama, qwen)

    model = ModelSettings(None, "cpu", "float32", 64)
    draft = SpecConfig(type="draft")
    with pytest.raises(UserError, match="vocabulary"):
        build_speculator(draft, str(tiny_model("qwen2")), llama, model, n_slots=1)
    small = str(tiny_model("llama", seed=3, n_layers=1))
    assert "draft" in build_speculator(draft, small, llama, model, n_slots=1).drafters
    with pytest.raises(UserError, match="only used with --spec-type draft"):
        build_speculator(SpecConfig(type="ngram"), small, llama, model, n_slots=1)
    with pytest.raises(UserError, match="needs --model-draft"):
        build_speculator(draft, None, llama, model, n_slots=1)


@pytest.mark.parametrize("with_q", [False, True])
def test_speculator_verify_samples_the_samplers_distribution(with_q):
    """The real Speculator.verify with a real Sampler (temperature, top-k, top-p, repeat penalty):
    the first emitted token follows the sampler's distribution at row 0 (max 4.5 standard errors per
    token) over requests of different seeds."""
    V, k, n = 12, 3, 4000
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(k + 1, V, generator=gen) * 2
    history = [1, 2, 2]
    params = SamplingParams(temperature=0.8, top_k=8, top_p=0.95, repeat_penalty=1.3, seed=5)
    spec = Speculator(SpecConfig("ngram"))
    q = torch.softmax(torch.randn(k, V, generator=gen), -1)
    counts = torch.zeros(V)
    for seed in range(n):
        draft = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(k)]
        if not with_q:
            draft = [3, 4, 5]
        emitted = spec.verify(logits, Draft(draft, q if with_q else None), Sampler(replace(params, seed=seed)), history)
        counts[emitted[0]] += 1
    want = distribution(logits[:1], Rows.build([Sampler(params)], [history], torch.device("cpu")))[0]
    assert bool((counts[want == 0] == 0).all())  # filtered tokens never appear
    sd = (want * (1 - want) / n).sqrt().clamp_min(1e-9)
    assert float(((counts / n - want).abs() / sd).max()) < 4.5
    assert spec.stats.drafts == n


def test_default_model_greedy_speculation_is_exact(default_model):
    """Gemma 3 270M: n-gram speculation gives the plain greedy output token for token on a
    code-copying prompt (most drafts accepted) and on free prose (many rejected).

    float32: there a verify row differs from the single-token decode of the same position by ~2e-5
    (matmul blocking depends on the row count), far below real logit margins. With bf16 activations
    and int8 weights (the CPU default) the int8 kernel's rounding also depends on the row count and
    the bf16 logits tie often, so greedy speculation can take the other side of a near-tie there,
    as batching slots together can."""
    g = GGUFFile(default_model)
    tok = Tokenizer.from_gguf(g)
    eng = Engine(Pipeline(build_stage(g, device="cpu", dtype="float32", n_slots=1, n_ctx=512)), tok, 1, 512).start()
    code = "def area(w, h):\n    result = w * h\n    print('area', result)\n    return result\n"
    prompts = [
        f"```python\n{code}```\n\nThe same code again:\n\n```python\n",
        "The river had flooded twice that spring, and by the time the surveyors arrived the old mill",
    ]
    try:
        for i, text in enumerate(prompts):
            prompt = tok.encode(text)
            plain, _ = _run(eng, prompt, None, n=24)
            spec, t = _run(eng, prompt, SpecConfig("ngram", n_max=3), n=24)
            assert spec == plain
            if i == 0:
                assert t["draft_n_accepted"] > t["draft_n"] / 2
    finally:
        eng.stop()
