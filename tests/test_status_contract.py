"""The /health and /status documents (contracts.status): what a worker serves, the console reads back."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hydra_console.app.sources import Probe
from hydra_console.contracts.status import (
    READY_STAGE,
    WARMING_STAGE,
    Health,
    PeerInfo,
    Pool,
    StageInfo,
    Status,
    Throughput,
)
from hydra_console.engine.status import StatusDocument

pytestmark = pytest.mark.unit


def test_a_served_document_reads_back_unchanged():
    doc = StatusDocument("head", "127.0.0.1", 8080, config={"parallel": 4})
    doc.add_provider(
        lambda: {
            "pool": Pool(2, 1, 0, 64, 0, 3),
            "peers": [PeerInfo("127.0.0.1:8091", "up", 0.4, layers=(9, 18))],
            "stages": [StageInfo("head", None, (0, 9), "cpu", "ok")],
        }
    )
    served = doc.document()
    assert Status.from_json(served.to_json()) == served
    assert served.devices and served.pool.busy == 1 and served.config == {"parallel": 4}
    health = doc.health()
    assert Health.from_json(health.to_json()) == health and health.http_code == 503  # still starting
    doc.startup_stage = WARMING_STAGE
    assert doc.health().http_code == 503 and doc.health().status == "warming"
    doc.startup_stage = READY_STAGE
    assert doc.health().http_code == 200
    # When each stage was reached, in seconds from the process's start (this test process's: > 0).
    times = doc.document().startup_s
    assert list(times) == ["alive", "warming", "ready"] and 0 < times["alive"] <= times["warming"] <= times["ready"]
    assert Status.from_json(doc.document().to_json()).startup_s == times


def test_wrong_types_fall_back_to_defaults_never_raise():
    s = Status.from_json(
        {
            "pid": "x",
            "stages": [{"layers": [1]}, "junk", {"role": "peer", "layers": [2, 5]}],
            "throughput": {"decode_tok_s": True, "prefill_tok_s": 3},
            "peers": None,
            "pool": 7,
        }
    )
    assert s.pid is None and s.pool is None and s.peers == []
    assert [x.layers for x in s.stages] == [None, (2, 5)]
    assert s.throughput.decode_tok_s == 0.0 and s.throughput.prefill_tok_s == 3.0
    s = Status.from_json(
        {
            "requests": {"queued": "x", "ttft_p50_ms": 12, "queue_max": None},
            "process": {"rss": 1.5},
            "pool": {"connections": 3, "busy": 5},
        }
    )
    assert (s.requests.queued, s.requests.ttft_p50_ms, s.requests.queue_max) == (0, 12.0, None)
    assert s.process.rss is None and s.pool.idle == 0  # never negative
    assert Status.from_json({}).requests is None and Status.from_json({}).process is None  # an older worker


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=4),
    max_leaves=20,
)
field_names = st.sampled_from(
    [
        "role",
        "pid",
        "stages",
        "devices",
        "throughput",
        "speculative",
        "pool",
        "peers",
        "slots",
        "model",
        "http",
        "requests",
        "process",
    ]
)


@given(
    st.dictionaries(field_names, json_values, max_size=6),
    st.one_of(st.none(), st.dictionaries(st.text(max_size=8), json_values, max_size=4)),
)
def test_the_console_parses_any_json_once(status, health):
    p = Probe(True, 200, health, status)
    assert isinstance(p.status, Status) and (health is None or isinstance(p.health, Health))
    assert isinstance(p.health_state, str)


def test_a_decode_steps_average_leaves_the_prompt_steps_out():
    before = Throughput(
        steps_total=10, step_phase_s={"forward": 1.0}, prompt_steps_total=2, prompt_step_phase_s={"forward": 0.5}
    )
    after = Throughput(
        steps_total=20, step_phase_s={"forward": 2.5}, prompt_steps_total=4, prompt_step_phase_s={"forward": 1.6}
    )
    assert after.step_ms_since(before) == pytest.approx({"forward": 150.0})  # 1.5 s over 10 steps
    assert after.step_ms_since(before, decode_only=True) == pytest.approx({"forward": 50.0})  # 0.4 s over 8
    assert after.steps_since(before) == 10 and after.steps_since(before, decode_only=True) == 8
    only_prompts = Throughput(
        steps_total=12, step_phase_s={"forward": 2.0}, prompt_steps_total=4, prompt_step_phase_s={"forward": 1.5}
    )
    assert only_prompts.step_ms_since(before, decode_only=True) is None  # no decode step between them
