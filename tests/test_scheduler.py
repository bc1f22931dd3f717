"""The scheduler, and the engine's step around it, without a model: a fake forward returns chosen
logits, a fake tokenizer turns ids into text."""

from __future__ import annotations

import pytest
import torch
from fake_tokenizer import EOS, PIECES, FakeTokenizer

from hydra_console.engine.errors import Unavailable
from hydra_console.engine.serving.kv_manager import KVManager
from hydra_console.engine.serving.runtime import Engine
from hydra_console.engine.serving.sampling import PENDING
from hydra_console.engine.serving.scheduler import Scheduler
from hydra_console.engine.serving.sequence import Event, Request
from hydra_console.engine.spec import SpecConfig, Speculator

pytestmark = pytest.mark.unit


def scheduler(n_slots: int = 2, batch_tokens: int = 256, mixed: bool = True, spec: Speculator | None = None):
    return Scheduler(
        n_slots, n_ctx=64, batch_tokens=batch_tokens, mixed_steps=mixed, speculator=spec or Speculator(), eog_ids={EOS}
    )


def step(s: Scheduler, token: int = 1):
    """One step with every sampled token `token`; finished sequences leave their slot, as the engine does."""
    cancelled = s.admit()
    batch = s.schedule()
    s.postprocess(batch, [[token] if c.sample else [] for c in batch.chunks])
    for c in batch.chunks:
        if c.seq.finish_reason is not None:
            s.free(c.seq)
    return cancelled, batch


def shape(batch) -> list[tuple[int, int, int, bool]]:
    """(request id, start, end, samples) per chunk."""
    return [(c.seq.req.id, c.start, c.end, c.sample) for c in batch.chunks]


def test_requests_take_free_slots_in_arrival_order_and_the_rest_wait():
    s = scheduler(n_slots=2)
    reqs = [Request([1, 2, 3], max_tokens=4) for _ in range(3)]
    for r in reqs:
        s.add(r)
    s.admit()
    assert [seq.req for seq in s.slots] == reqs[:2]
    assert list(s.waiting) == reqs[2:]
    assert [r.id for r in reqs] == [1, 2, 3]


def test_a_request_pinned_to_a_busy_slot_waits_for_it_and_the_rest_go_on():
    """llama-server's id_slot: the pinned request takes its slot when it frees, keeping its place
    in the queue; a request behind it takes another free slot meanwhile."""
    s = scheduler(n_slots=3)
    first, pinned, other = Request([1, 2], max_tokens=1, id_slot=1), Request([1, 2], id_slot=1), Request([1, 2])
    for r in (first, pinned, other):
        s.add(r)
    s.admit()
    assert (s.slots[1].req, list(s.waiting)) == (first, [pinned]) and other.slot in (0, 2)
    step(s)  # `first` ends (max_tokens 1) and frees slot 1
    s.admit()
    assert s.slots[1].req is pinned and pinned.slot == 1 and not s.waiting


def test_a_finished_sequence_gives_its_slot_to_the_oldest_waiting_request():
    s = scheduler(n_slots=2)
    short, long_, late1, late2 = (Request([1, 2], max_tokens=n) for n in (1, 5, 5, 5))
    for r in (short, long_, late1, late2):
        s.add(r)
    _, batch = step(s)
    assert batch.chunks[0].seq.finish_reason == "length"
    assert s.slots[0] is None
    s.admit()
    assert [seq.req for seq in s.slots] == [late1, long_] and list(s.waiting) == [late2]


def test_prefill_chunks_share_the_token_budget_oldest_first():
    s = scheduler(n_slots=2, batch_tokens=8)
    for _ in range(2):
        s.add(Request([1, 2, 3, 4, 1, 2], max_tokens=5))
    _, batch = step(s)
    assert shape(batch) == [(1, 0, 6, True), (2, 0, 2, False)]
    assert batch.inputs() == ([1, 2, 3, 4, 1, 2, 1, 2], [0] * 6 + [1] * 2, [0, 1, 2, 3, 4, 5, 0, 1], [5])
    _, batch = step(s)  # mixed: the decoding sequence's token rides along with the rest of the prompt
    assert shape(batch) == [(1, 6, 7, True), (2, 2, 6, True)]
    assert batch.n_prefill == 4


def test_prefill_runs_alone_unless_steps_are_mixed():
    s = scheduler(n_slots=2, mixed=False)
    s.add(Request([1, 2, 3], max_tokens=5))
    step(s)
    s.add(Request([4, 3], max_tokens=5))
    _, batch = step(s)
    assert shape(batch) == [(2, 0, 2, True)]
    _, batch = step(s)
    assert shape(batch) == [(1, 3, 4, True), (2, 2, 3, True)]


def test_decoding_sequences_share_one_batch_one_token_each():
    s = scheduler(n_slots=2)
    s.add(Request([1, 2, 3], max_tokens=5))
    s.add(Request([4], max_tokens=5))
    step(s, token=7)
    _, batch = step(s, token=7)
    assert shape(batch) == [(1, 3, 4, True), (2, 1, 2, True)]
    assert batch.inputs() == ([7, 7], [0, 1], [3, 1], [0, 1])
    assert [seq.tokens for seq in s.slots] == [[1, 2, 3, 7, 7], [4, 7, 7]]
    assert [seq.n_past for seq in s.slots] == [4, 2]


def test_length_and_end_of_generation_finish_a_sequence():
    s = scheduler(n_slots=3)
    for r in (Request([1], max_tokens=1), Request([1], max_tokens=5), Request([1], max_tokens=5, ignore_eos=True)):
        s.add(r)
    _, batch = step(s, token=2)
    assert [(c.seq.finish_reason, c.seq.n_gen) for c in batch.chunks] == [("length", 1), (None, 1), (None, 1)]
    _, batch = step(s, token=EOS)
    assert [(c.seq.finish_reason, c.seq.n_gen) for c in batch.chunks] == [("stop", 2), (None, 2)]
    assert [seq is not None for seq in s.slots] == [False, False, True]


def test_a_request_for_no_tokens_finishes_when_its_prompt_is_in():
    s = scheduler()
    s.add(Request([1, 2], max_tokens=0))
    _, batch = step(s)
    assert shape(batch) == [(1, 0, 2, False)]
    assert batch.chunks[0].seq.finish_reason == "length" and batch.chunks[0].seq.n_gen == 0


def test_cancelled_requests_leave_their_slot_or_the_queue():
    s = scheduler(n_slots=1)
    running, queued, next_ = Request([1], max_tokens=5), Request([2], max_tokens=5), Request([3], max_tokens=5)
    for r in (running, queued, next_):
        s.add(r)
    step(s)
    running.cancelled = queued.cancelled = True
    cancelled, batch = step(s)
    assert [(seq.req, seq.finish_reason) for seq in cancelled] == [(running, "cancelled")]
    assert s.slots[0].req is next_ and not s.waiting
    assert shape(batch) == [(3, 0, 1, True)]


def test_a_verified_draft_advances_past_the_accepted_tokens():
    s = scheduler(spec=Speculator(SpecConfig("ngram", n_max=3)))
    s.add(Request([1, 2, 3, 4, 1, 2], max_tokens=10))
    step(s, token=3)  # history 1 2 3 4 1 2 3: the n-gram "1 2 3" was followed by "4 1 2"
    batch = s.schedule()
    (chunk,) = batch.chunks
    assert chunk.draft.tokens == [4, 1, 2]
    assert batch.inputs() == ([3, 4, 1, 2], [0] * 4, [6, 7, 8, 9], [0, 1, 2, 3])
    s.postprocess(batch, [[4, 1, 7]])  # two accepted, then the target's own token
    seq = chunk.seq
    assert (seq.n_past, seq.n_gen, seq.n_drafted, seq.n_accepted) == (9, 4, 3, 2)
    assert seq.tokens[-4:] == [3, 4, 1, 7]


def test_a_token_in_flight_is_pending_in_the_next_batch_and_max_tokens_counts_it():
    """Overlap: the next batch is scheduled before the previous one's tokens are read. Its input is
    PENDING (the engine takes it on the device), and a sequence whose token in flight is its last
    (max_tokens) is not scheduled again; one that may still end on a token is (plain decoding only)."""
    s = scheduler()
    s.add(Request([5, 6, 7], max_tokens=3))
    s.add(Request([8, 9], max_tokens=8))
    step(s)  # both prompts: one token each
    assert s.overlappable()
    first = s.schedule()
    s.launched(first)  # not read yet
    second = s.schedule()
    assert shape(second) == [(1, 4, 5, True), (2, 3, 4, True)]
    assert second.inputs()[0] == [PENDING, PENDING]
    s.postprocess(first, [[2], [2]])
    s.launched(second)
    assert shape(s.schedule()) == [(2, 4, 5, True)]  # request 1's token in flight is its third: it is done
    s.postprocess(second, [[2], [2]])
    assert s.slots[0].finish_reason == "length" and s.slots[1].finish_reason is None
    s.free(s.slots[0])
    s.add(Request([1, 2], max_tokens=4))
    s.admit()
    assert not s.overlappable()  # a prompt to prefill: the host decides first


def pooled(capacity: int, n_slots: int = 2, mixed: bool = True) -> Scheduler:
    """A scheduler over a fake `--kv-unified` pool of `capacity` positions: each slot holds its
    sequence's positions so far, or the ones a step asks for."""
    s = scheduler(n_slots=n_slots, mixed=mixed)

    def fits(ends: dict[int, int]) -> bool:
        return sum(ends.get(q.slot, q.n_past) for q in s.running) <= capacity

    s.kv.fits = fits
    return s


def test_a_full_pool_ends_the_newest_sequence_that_holds_kv_with_an_error_while_prompts_wait():
    s = pooled(capacity=8, n_slots=3)
    old, new, waiting = (
        Request([1, 2], max_tokens=10),
        Request([3, 4], max_tokens=10),
        Request([5, 6, 7, 8], max_tokens=2),
    )
    for r in (old, new):
        s.add(r)
    for _ in range(3):
        step(s)  # 2 + 2 positions, then 3 + 3, 4 + 4: the pool is full
    s.add(waiting)
    _, batch = step(s)  # neither can grow, and the prompt has no room: the newer holder ends
    assert not batch.chunks and [q.req for q in batch.shed] == [new]
    assert batch.shed[0].finish_reason == "error"  # never "length": it asked for more
    _, batch = step(s)
    assert shape(batch) == [(1, 4, 5, True)]  # the older grows into the freed positions; the prompt waits
    assert s.slots[2].req is waiting and s.slots[2].n_past == 0


def test_alone_in_a_pool_that_cannot_hold_it_a_sequence_ends_with_an_error_not_by_length():
    s = pooled(capacity=4)
    s.add(Request([1, 2], max_tokens=10))
    for _ in range(3):
        step(s)  # its prompt and three tokens: the fourth needs a fifth position
    _, batch = step(s)
    assert not batch.chunks and batch.shed[0].finish_reason == "error" and batch.shed[0].n_gen == 3


def test_a_full_pool_waits_for_a_sequence_whose_last_token_is_in_flight():
    """Overlap: the older sequence's token in flight is its last; its positions come back once the
    host reads it, so the newer one waits instead of being ended."""
    s = pooled(capacity=6)
    s.add(Request([1, 2], max_tokens=2))
    s.add(Request([3, 4], max_tokens=5))
    step(s)  # both prompts, a token each: 2 + 2 positions held, 3 + 3 once the next step runs
    first = s.schedule()
    s.launched(first)  # request 1's second token, its last, in flight
    second = s.schedule()
    assert not second.chunks and not second.shed  # request 2 needs a 4th position: it waits
    s.postprocess(first, [[1], [1]])
    s.free(s.slots[0])
    assert shape(s.schedule()) == [(2, 3, 4, True)]


def test_without_mixed_steps_a_prompt_without_room_lets_the_decoding_sequences_run():
    s = pooled(capacity=6, mixed=False)
    s.add(Request([1, 2, 3], max_tokens=3))
    step(s)
    s.add(Request([4, 5, 6, 7], max_tokens=2))  # 3 + 4 positions: no room until the first ends
    for want in ([(1, 3, 4, True)], [(1, 4, 5, True)], [(2, 0, 4, True)]):
        _, batch = step(s)
        assert shape(batch) == want and not batch.shed


# ---- the engine's step around the scheduler, with a fake forward ---------------------------------


class FakePipeline:
    """`forward` returns logits whose argmax is `next_token(position)` for each requested row."""

    local = None

    def __init__(self, next_token):
        self.next_token = next_token
        self.calls = 0

    def forward(self, tokens, slots, positions, rows, meanwhile=None, argmax=False, ahead=()):
        self.calls += 1
        if meanwhile is not None:  # Pipeline.forward's contract: once, the layers queued
            meanwhile()
        rows = torch.arange(len(tokens)) if rows is None else rows  # None: every row
        logits = torch.zeros(len(rows), len(PIECES))
        for i, p in enumerate(positions[rows].tolist()):
            logits[i, self.next_token(p)] = 1.0
        return logits


def greedy_request(prompt: list[int], events: list[Event], **kw) -> Request:
    from hydra_console.engine.serving.sampling_params import SamplingParams

    return Request(prompt, SamplingParams(temperature=0.0), sink=events.append, **kw)


def test_engine_steps_batch_requests_through_a_fake_forward():
    pipeline = FakePipeline(lambda p: 1 if p % 2 else 2)  # "he" after odd positions, "llo" after even
    engine = Engine(pipeline, FakeTokenizer(), n_slots=2, n_ctx=32, mixed_steps=True)
    events = [[], [], []]
    for ev in events:
        engine.submit(greedy_request([0, 1], ev, max_tokens=4))
    while engine.n_processing or engine.n_deferred:
        engine.step()
    assert ["".join(e.text for e in ev) for ev in events] == ["hellohello"] * 3
    assert [ev[-1].finish_reason for ev in events] == ["length"] * 3
    assert pipeline.calls == 8  # two slots share each step: the third request waits for a slot
    assert engine.stats.predicted_tokens == 12


def test_a_failed_forward_ends_its_requests_with_the_exception():
    class PeerGone(Unavailable):
        pass

    def fail(_):
        raise PeerGone("peer 10.0.0.2:50052 stopped answering")

    engine = Engine(FakePipeline(fail), FakeTokenizer(), n_slots=2, n_ctx=32).start()
    try:
        *_, final = engine.generate(greedy_request([0, 1], [], max_tokens=4), timeout=10)
    finally:
        engine.stop()
    assert final.finish_reason == "error" and isinstance(final.error, PeerGone)
    assert engine.n_processing == 0


def test_a_slot_keeps_its_prefix_for_the_next_request_until_the_kv_is_lost():
    generation = [0]
    s = Scheduler(
        2,
        64,
        16,
        mixed_steps=True,
        speculator=Speculator(SpecConfig()),
        eog_ids={EOS},
        kv=KVManager(2, kv_generation=lambda: generation[0]),
    )
    first = Request([5, 6, 7, 8], max_tokens=1)
    s.add(first)
    s.admit()
    seq = s.slots[0]
    seq.n_past = 4
    seq.append(9)
    seq.finish_reason = "length"
    s.free(seq)
    s.add(Request([1, 2], max_tokens=1))  # shares nothing: takes the empty slot
    s.add(Request([5, 6, 7, 3], max_tokens=1))
    s.admit()
    assert s.slots[1].n_cached == 0 and (s.slots[0].n_cached, s.slots[0].n_past) == (3, 3)
    for q in list(s.running):
        q.n_past, q.finish_reason = len(q.tokens), "length"
        s.free(q)
    generation[0] += 1  # a peer came back or the split moved: idle slots' KV is gone
    s.add(Request([5, 6, 7, 3], max_tokens=1))
    s.admit()
    assert s.running[0].n_cached == 0
