"""The Engine on a real tiny synthetic model: batching, queueing, stops, scoring, cancellation, each
with and without overlap (a decoding step launched before the host reads the one before)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from hydra_console.engine.errors import ContextOverflow
from hydra_console.engine.gguf_file import GGUFFile
from hydra_console.engine.model import build_stage
from hydra_console.engine.pipeline import Pipeline
from hydra_console.engine.serving.runtime import Engine, Request
from hydra_console.engine.serving.sampling_params import InvalidParam, SamplingParams
from hydra_console.engine.text.tokenizer import Tokenizer

N_SLOTS, N_CTX = 3, 128
PROMPTS = ["the quick brown fox", "hello world", "a b c d e f", "night and day and night"]


@pytest.fixture(scope="module")
def model(tiny_model):
    g = GGUFFile(tiny_model("llama"))
    return g, Tokenizer.from_gguf(g)


def start_engine(model, overlap: bool) -> Engine:
    g, tok = model
    pipeline = Pipeline(build_stage(g, device="cpu", dtype="float32", n_slots=N_SLOTS, n_ctx=N_CTX))
    return Engine(pipeline, tok, N_SLOTS, N_CTX, overlap=overlap).start()


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "overlap"])
def engine(model, request):
    eng = start_engine(model, request.param)
    yield eng
    eng.stop()


def run(engine: Engine, prompt: list[int], **kw):
    """(text, generated ids, prompt logprobs, final event) of one request."""
    text, ids, scored, final = [], [], [], None
    for ev in engine.generate(Request(prompt, **kw), timeout=30):
        text.append(ev.text)
        ids += [t.id for t in ev.tokens]
        scored += ev.prompt_logprobs or []
        final = ev
    return "".join(text), ids, scored, final


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kw)


def test_concurrent_greedy_equals_single_and_shares_forwards(engine, model):
    _, tok = model
    prompts = [tok.encode(p) for p in PROMPTS]
    single = [run(engine, p, params=greedy(), max_tokens=12, ignore_eos=True)[:2] for p in prompts]

    results: dict[int, tuple] = {}
    steps_before = engine.stats.steps
    threads = [
        threading.Thread(
            target=lambda i=i, p=p: results.__setitem__(
                i, run(engine, p, params=greedy(), max_tokens=12, ignore_eos=True)[:2]
            )
        )
        for i, p in enumerate(prompts)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert [results[i] for i in range(len(prompts))] == single
    # 4 requests x 12 tokens through 3 slots: far fewer forwards than tokens means batched steps
    assert engine.stats.steps - steps_before < 4 * 12 * 0.75


def test_requests_beyond_the_slots_wait_in_the_queue(engine, model):
    _, tok = model
    reqs = [Request(tok.encode(p), greedy(), max_tokens=40, ignore_eos=True) for p in PROMPTS]
    for r in reqs:
        engine.submit(r)
    deadline = time.monotonic() + 10
    while engine.n_processing < N_SLOTS and time.monotonic() < deadline:
        time.sleep(0.005)
    assert (engine.n_processing, engine.n_deferred) == (N_SLOTS, 1)
    for r in reqs:
        engine.cancel(r)
    deadline = time.monotonic() + 10
    while (engine.n_processing or engine.n_deferred) and time.monotonic() < deadline:
        time.sleep(0.005)
    assert (engine.n_processing, engine.n_deferred) == (0, 0)


def test_cancel_frees_the_slot_and_ends_the_request(engine, model):
    _, tok = model
    events = []
    req = Request(tok.encode(PROMPTS[0]), greedy(), max_tokens=N_CTX - 10, ignore_eos=True, sink=events.append)
    engine.submit(req)
    deadline = time.monotonic() + 10
    while not any(e.text for e in events) and time.monotonic() < deadline:
        time.sleep(0.005)
    engine.cancel(req)
    while events[-1].finish_reason is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert events[-1].finish_reason == "cancelled"
    assert events[-1].usage["completion_tokens"] < N_CTX - 10
    assert engine.n_processing == 0


def test_stop_string_cuts_and_is_never_streamed(engine, model):
    _, tok = model
    prompt = tok.encode(PROMPTS[1])
    ref, _, _, _ = run(engine, prompt, params=greedy(), max_tokens=30, ignore_eos=True)
    # a stop string starting at its first occurrence somewhere inside the reference text
    at = next(i for i in range(4, len(ref) - 3) if ref.find(ref[i : i + 3]) == i)
    stop = ref[at : at + 3]
    pieces = []
    for ev in engine.generate(
        Request(prompt, greedy(), max_tokens=30, ignore_eos=True, stop=[stop, "\x00never"]), timeout=30
    ):
        pieces.append(ev.text)
        final = ev
    assert "".join(pieces) == ref[:at]
    assert final.finish_reason == "stop"
    assert all(stop not in p for p in pieces)


def test_usage_timings_and_length(engine, model):
    _, tok = model
    prompt = tok.encode(PROMPTS[2])
    text, ids, _, final = run(engine, prompt, params=greedy(), max_tokens=9, ignore_eos=True)
    assert final.finish_reason == "length"
    cached = final.timings["cache_n"]  # the prompt cache: an earlier test may have left this prompt's prefix
    assert final.usage == {
        "prompt_tokens": len(prompt),
        "completion_tokens": 9,
        "total_tokens": len(prompt) + 9,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    assert len(ids) == 9 and tok.decode(prompt + ids, skip_special=True) == tok.decode(prompt, skip_special=True) + text
    t = final.timings
    assert (t["prompt_n"] + t["cache_n"], t["predicted_n"], t["draft_n"], t["draft_n_accepted"]) == (
        len(prompt),
        9,
        0,
        0,
    )
    assert t["prompt_ms"] > 0 and t["predicted_ms"] > 0


def test_prompt_cache_reuses_a_slots_prefix_and_changes_nothing(engine, model):
    _, tok = model
    prompt = tok.encode(PROMPTS[1] + " and more words to share")
    first = run(engine, prompt, params=greedy(), max_tokens=6, ignore_eos=True, cache_prompt=False)
    again = run(engine, prompt, params=greedy(), max_tokens=6, ignore_eos=True)
    longer = run(engine, prompt + first[1][:2], params=greedy(), max_tokens=4, ignore_eos=True)
    assert first[3].timings["cache_n"] == 0
    assert again[3].timings["cache_n"] == len(prompt) - 1 and again[1] == first[1]
    assert longer[3].timings["cache_n"] >= len(prompt) and longer[1] == first[1][2:6]


def test_seeded_sampling_repeats(engine, model):
    _, tok = model
    prompt = tok.encode(PROMPTS[3])
    params = SamplingParams(temperature=1.5, seed=1234)
    a = run(engine, prompt, params=params, max_tokens=16, ignore_eos=True)[1]
    b = run(engine, prompt, params=params, max_tokens=16, ignore_eos=True)[1]
    c = run(engine, prompt, params=SamplingParams(temperature=1.5, seed=99), max_tokens=16, ignore_eos=True)[1]
    assert a == b and a != c


def test_prompt_scoring_matches_a_direct_forward(engine, model):
    g, tok = model
    prompt = tok.encode(" ".join(PROMPTS) * 5)  # longer than one scoring chunk
    assert len(prompt) > 64
    _, ids, scored, final = run(engine, prompt, params=greedy(), max_tokens=0, prompt_logprobs=2)
    assert ids == [] and final.usage["completion_tokens"] == 0 and final.finish_reason == "length"
    assert [s.token for s in scored] == prompt
    assert scored[0].logprob is None

    ref = Pipeline(build_stage(g, device="cpu", dtype="float32", n_slots=1, n_ctx=N_CTX))
    n = len(prompt)
    logits = ref.forward(torch.tensor(prompt), torch.zeros(n, dtype=torch.long), torch.arange(n), torch.arange(n))
    lp = torch.log_softmax(logits, -1)
    want = [float(lp[i - 1, prompt[i]]) for i in range(1, n)]
    assert [s.logprob for s in scored[1:]] == pytest.approx(want, abs=1e-4)
    assert [t for t, _ in scored[5].top] == torch.topk(lp[4], 2).indices.tolist()


def test_bad_requests_are_rejected_up_front(engine, model):
    _, tok = model
    with pytest.raises(ContextOverflow, match="exceeds the available context size"):
        engine.submit(Request((tok.encode("hello") * N_CTX)[:N_CTX], greedy(), max_tokens=1))
    with pytest.raises(InvalidParam):
        engine.submit(Request([], greedy()))
    with pytest.raises(InvalidParam):
        engine.submit(Request([tok.vocab_size + 5], greedy()))


def test_max_tokens_past_the_context_end_where_the_slot_is_full(engine, model):
    """llama-server's n_predict past the context: not refused; every token the slot holds, then
    "length", truncated (with a token in flight too: the overlap engine)."""
    _, tok = model
    prompt = tok.encode(PROMPTS[0])
    _, ids, _, final = run(engine, prompt, params=greedy(), max_tokens=10 * N_CTX, ignore_eos=True)
    assert len(ids) == N_CTX - len(prompt) and final.finish_reason == "length" and final.truncated


def test_both_step_kinds_give_the_same_tokens(engine, model):
    """Prefill riding with decode tokens (the CPU default) or prefill alone: the same greedy output."""
    g, tok = model
    prompts = [tok.encode(p) for p in PROMPTS[:3]]
    want = [run(engine, p, params=greedy(), max_tokens=10, ignore_eos=True)[1] for p in prompts]
    other = Engine(
        Pipeline(build_stage(g, device="cpu", dtype="float32", n_slots=N_SLOTS, n_ctx=N_CTX)),
        tok,
        N_SLOTS,
        N_CTX,
        mixed_steps=not engine.mixed_steps,
    ).start()
    try:
        got: dict[int, list[int]] = {}
        threads = []
        for i, p in enumerate(prompts):  # staggered: later prompts prefill while earlier ones decode
            threads.append(
                threading.Thread(
                    target=lambda i=i, p=p: got.__setitem__(
                        i, run(other, p, params=greedy(), max_tokens=10, ignore_eos=True)[1]
                    )
                )
            )
            threads[-1].start()
            time.sleep(0.01)
        for t in threads:
            t.join(timeout=60)
    finally:
        other.stop()
    assert [got.get(i) for i in range(3)] == want


def test_end_of_generation_stops_unless_ignored(engine, model):
    _, tok = model
    prompt = tok.encode("hello")
    for seed in range(50):  # a hot temperature reaches the end-of-generation token within a few seeds
        params = SamplingParams(temperature=3.0, seed=seed)
        text, ids, _, final = run(engine, prompt, params=params, max_tokens=100)
        if final.finish_reason == "stop":
            break
    assert final.finish_reason == "stop", "no seed reached end of generation"
    n = final.usage["completion_tokens"]
    assert n < 100 and len(ids) == n - 1  # the end token counts in usage but is not output
    more_text, more_ids, _, more = run(engine, prompt, params=params, max_tokens=100, ignore_eos=True)
    assert more.finish_reason == "length" and more_ids[: n - 1] == ids and more_ids[n - 1] in tok.eog_ids
    assert more_text.startswith(text)


def outputs(engine: Engine, requests: list[dict], together: bool, cached: bool = False) -> list[tuple]:
    """(text, ids, finish reason, stop word, completion tokens, logprobs[, prompt tokens from the
    cache]) of each request, run one after the other or all at once (more than the slots: the last
    ones wait for a slot)."""

    def one(kw):
        text, ids, lps, final = [], [], [], None
        for ev in engine.generate(Request(**kw), timeout=60):
            text.append(ev.text)
            ids += [t.id for t in ev.tokens]
            lps += [(t.logprob.token, round(t.logprob.logprob, 4)) for t in ev.tokens if t.logprob is not None]
            final = ev
        out = "".join(text), ids, final.finish_reason, final.stop_word, final.usage["completion_tokens"], lps
        return out + (final.timings["cache_n"],) if cached else out

    if not together:
        return [one(kw) for kw in requests]
    out: dict[int, tuple] = {}
    threads = [threading.Thread(target=lambda i=i, kw=kw: out.__setitem__(i, one(kw))) for i, kw in enumerate(requests)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return [out.get(i) for i in range(len(requests))]


@pytest.mark.parametrize("arch", ["llama", "qwen35"])
def test_overlap_gives_the_synchronous_output_while_sequences_end_mid_batch(tiny_model, arch):
    """Requests batched together end at different steps — max_tokens, a stop string, the
    end-of-generation token — while the others go on, and queued ones take the freed slots: with
    overlap every request's output (text, tokens, finish, usage, logprobs) is the synchronous
    engine's for it alone. Greedy, seeded sampling and penalties (whose window ends on the token in
    flight) alike. The freed slots then serve from their prompt cache unchanged, also where a
    dropped row advanced a recurrent (DeltaNet) state one token further than the synchronous run."""
    g = GGUFFile(tiny_model(arch, **({"n_layers": 4} if arch == "qwen35" else {})))
    tok = Tokenizer.from_gguf(g)
    sync, overlapped = start_engine((g, tok), False), start_engine((g, tok), True)
    try:
        hello = tok.encode("hello")
        eos_seed = next(
            seed
            for seed in range(50)
            if outputs(
                sync, [dict(prompt=hello, params=SamplingParams(temperature=3.0, seed=seed), max_tokens=60)], False
            )[0][2]
            == "stop"
        )
        ref = outputs(
            sync, [dict(prompt=tok.encode(PROMPTS[1]), params=greedy(), max_tokens=30, ignore_eos=True)], False
        )[0][0]
        at = next(i for i in range(4, len(ref) - 3) if ref.find(ref[i : i + 3]) == i)
        requests = [
            dict(prompt=tok.encode(PROMPTS[0]), params=greedy(logprobs=2), max_tokens=5, ignore_eos=True),
            dict(
                prompt=tok.encode(PROMPTS[1]), params=greedy(), max_tokens=30, ignore_eos=True, stop=[ref[at : at + 3]]
            ),
            dict(prompt=hello, params=SamplingParams(temperature=3.0, seed=eos_seed), max_tokens=60),
            dict(
                prompt=tok.encode(PROMPTS[3]),
                params=greedy(repeat_penalty=1.5, presence_penalty=0.3),
                max_tokens=24,
                ignore_eos=True,
            ),
            dict(
                prompt=tok.encode(PROMPTS[2]),
                params=SamplingParams(
                    temperature=1.2, top_k=8, top_p=0.9, seed=7, frequency_penalty=0.5, logprobs=1, post_sampling=True
                ),
                max_tokens=20,
                ignore_eos=True,
            ),
        ]
        want = outputs(sync, requests, together=False)
        assert [w[2] for w in want] == ["length", "stop", "stop", "length", "length"]
        assert want[1][3] and not want[2][3]  # one ends on its stop string, one on end-of-generation
        steps = overlapped.stats.overlapped
        assert outputs(overlapped, requests, together=True) == want
        assert overlapped.stats.overlapped > steps, "no step was launched before the previous one was read"
        assert (overlapped.n_processing, overlapped.n_deferred) == (0, 0)
        assert outputs(overlapped, requests[:3], together=False) == want[:3]  # from the prompt cache the slots kept
        # a prompt that extends the whole sequence of a request that ended on a stop string (its
        # extra row ran) continues from its slot's state
        assert outputs(overlapped, [requests[1]], False) == [want[1]]
        follow = {**requests[1], "prompt": requests[1]["prompt"] + want[1][1], "stop": []}
        got = outputs(overlapped, [follow], False, cached=True)[0]
        assert got[-1] >= len(requests[1]["prompt"])  # the slot's state carried on
        assert got[:-1] == outputs(sync, [{**follow, "cache_prompt": False}], False)[0]
    finally:
        sync.stop()
        overlapped.stop()
