"""The output processor without a model: UTF-8 holdback, stop strings, what the final event says."""

from __future__ import annotations

import pytest
from fake_tokenizer import EOS, FakeTokenizer

from hydra_console.engine.serving.output import OutputProcessor
from hydra_console.engine.serving.runtime import EngineStats
from hydra_console.engine.serving.scheduler import Sampled
from hydra_console.engine.serving.sequence import Event, Request, Sequence

pytestmark = pytest.mark.unit


@pytest.fixture
def events() -> list[Event]:
    return []


@pytest.fixture
def out() -> OutputProcessor:
    return OutputProcessor(FakeTokenizer(), EngineStats())


def sequence(events: list[Event], stop: list[str] = (), max_tokens: int = 10) -> Sequence:
    """A sequence whose one-token prompt is in the KV cache, as the scheduler leaves it after prefill."""
    seq = Sequence(Request([0], max_tokens=max_tokens, stop=list(stop), sink=events.append), slot=0)
    seq.n_past = 1
    return seq


def step(out: OutputProcessor, seq: Sequence, *tids: int, finish: str | None = None, at_eog: bool = False) -> None:
    """What a step hands the output processor: tokens the scheduler appended (several for a verified
    draft), the finish reason it set and whether it ended on an end-of-generation token."""
    for tid in tids:
        seq.append(tid)
    seq.finish_reason, seq.at_eog = finish, at_eog
    out.process(seq, Sampled(list(tids), [None] * len(tids)))


def text(events: list[Event]) -> str:
    return "".join(e.text for e in events)


def test_half_a_utf8_character_is_held_back(out, events):
    seq = sequence(events)
    step(out, seq, 5)  # 0xC3: the first byte of "é"
    assert text(events) == ""
    step(out, seq, 6)
    assert text(events) == "é"


def test_a_stop_string_spanning_two_tokens_ends_the_request(out, events):
    seq = sequence(events, stop=["lo w"])
    step(out, seq, 1, 2)  # "he" "llo": "lo" may start the stop string
    assert text(events) == "hel"
    step(out, seq, 3)  # " wor"
    assert text(events) == "hel"
    assert all("lo w" not in e.text for e in events)
    final = events[-1]
    assert final.finish_reason == "stop" and final.usage["completion_tokens"] == 3


def test_text_before_the_stop_string_in_its_token_is_released(out, events):
    seq = sequence(events, stop=["wor"])
    step(out, seq, 1, 2, 3)
    assert text(events) == "hello "
    assert events[-1].finish_reason == "stop"


def test_no_text_and_no_tokens_after_the_stop_string(out, events):
    seq = sequence(events, stop=[" wo"])
    step(out, seq, 1, 3, 4, 7)  # "he" " wor" "ld" "!" in one step (a verified draft)
    assert text(events) == "he"
    assert [t.id for e in events for t in e.tokens] == [1, 3]
    assert events[-1].usage["completion_tokens"] == 2 and seq.n_gen == 2


def test_end_of_generation_counts_but_is_not_shown(out, events):
    seq = sequence(events)
    step(out, seq, 1, EOS, finish="stop", at_eog=True)
    assert text(events) == "he"
    assert [t.id for e in events for t in e.tokens] == [1]
    assert events[-1].usage == {
        "prompt_tokens": 1,
        "completion_tokens": 2,
        "total_tokens": 3,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_a_stop_on_a_content_token_shows_it(out, events):
    """A complete grammar stops on the token that completed it: that token is output."""
    seq = sequence(events)
    step(out, seq, 1, finish="stop")
    assert text(events) == "he" and [t.id for e in events for t in e.tokens] == [1]
    assert events[-1].finish_reason == "stop" and events[-1].usage["completion_tokens"] == 1


def test_the_final_event_releases_what_was_held(out, events):
    seq = sequence(events, stop=["hex"])
    step(out, seq, 1)  # "he" may start "hex"
    assert text(events) == ""
    step(out, seq, 5, finish="length")  # half a character: flushed as U+FFFD
    assert text(events) == "he\ufffd"
    final = events[-1]
    assert final.finish_reason == "length" and final.error is None
    assert (final.timings["prompt_n"], final.timings["predicted_n"]) == (1, 2)
    assert out.stats.prompt_tokens == 1 and out.stats.predicted_tokens == 2


def test_a_cancelled_request_gets_a_final_event(out, events):
    seq = sequence(events)
    step(out, seq, 1)
    seq.finish_reason = "cancelled"
    out.process(seq)
    assert text(events) == "he" and events[-1].finish_reason == "cancelled"
    assert events[-1].usage["completion_tokens"] == 1
