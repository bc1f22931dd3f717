"""Incident triage's rules (app/triage.py) on synthetic /status histories and events."""

from __future__ import annotations

import pytest

from hydra_console.app.config import Alerts, Profile
from hydra_console.app.incidents import IncidentLog
from hydra_console.app.records import HISTORY, Event
from hydra_console.app.sources import FixedFeedSource, Probe
from hydra_console.app.supervisor import Supervisor
from hydra_console.app.triage import Incident, advise, event_incident, open_incidents, status_incidents
from hydra_console.contracts.status import Status

pytestmark = pytest.mark.unit
ALERTS = Alerts(rtt_ms=20.0)


def doc(**kw) -> Status:
    """A head's /status with a few fields set (the rest as a fresh head reports them)."""
    base = {
        "role": "head",
        "requests": {"slots_total": 4},
        "pool": {"size": 2},
        "speculative": {"type": "off"},
        "peers": [{"addr": "p2:9", "state": "up", "rtt_ms": 1.0}],
        "slots": [{"id": 0, "n_ctx": 128}],
    }
    for key, value in kw.items():
        base[key] = {**base[key], **value} if isinstance(value, dict) and isinstance(base.get(key), dict) else value
    return Status.from_json(base)


def kinds(incidents) -> list[tuple[str, str]]:
    return [(i.kind, i.subject) for i in incidents]


def timeline(history, events, alerts):
    """Every incident of a history and events, oldest first, as the incident log records them."""
    out = [i for e in events if (i := event_incident(e))]
    for (_, prev), (ts, cur) in zip(history, history[1:]):
        out += status_incidents(prev, cur, ts, alerts)
    return sorted(out, key=lambda i: i.ts)


def test_a_quiet_history_has_no_incident_and_no_advice():
    history = [(t, doc()) for t in range(5)]
    assert timeline(history, [], ALERTS) == [] and advise(history, [], ALERTS) == []


def test_timeline_correlates_events_and_status_changes_in_time_order():
    history = [
        (0.0, doc()),
        (1.0, doc(peers=[{"addr": "p2:9", "state": "up", "rtt_ms": 45.0}])),  # RTT spike
        (2.0, doc(peers=[{"addr": "p2:9", "state": "down", "error": "reset"}], pool={"dropped": 2})),
        (
            3.0,
            doc(
                peers=[{"addr": "p2:9", "state": "up", "rtt_ms": 1.0}],
                requests={"rejected_total": 3, "queued": 64},
                slots=[{"id": 0, "n_ctx": 128, "n_past": 128}],
            ),
        ),
        (4.0, doc(requests={"itl_p50_ms": 10.0, "itl_p99_ms": 90.0})),
    ]
    events = [
        Event(2.5, "peer2", "crashed", "pid 7 exited (SIGKILL)"),
        Event(2.6, "peer2", "restarted", "after 1 s backoff"),
        Event(9.0, "peer2", "crash-loop", "3 exits in a row"),
    ]
    got = timeline(history, events, ALERTS)
    assert kinds(got) == [
        ("rtt-spike", "p2:9"),
        ("peer-down", "p2:9"),
        ("pool-drop", "head"),
        ("crash", "peer2"),
        ("restart", "peer2"),
        ("peer-up", "p2:9"),
        ("queue-full", "head"),
        ("kv-full", "head"),
        ("latency-spike", "head"),
        ("crash-loop", "peer2"),
    ]
    assert "reset" in got[1].message and "2 connection" in got[2].message and "3 request(s) refused" in got[6].message
    # A spike is one incident while it lasts, not one per poll.
    assert kinds(
        timeline(
            [(0, doc()), *[(t, doc(peers=[{"addr": "p2:9", "state": "up", "rtt_ms": 45.0}])) for t in (1, 2, 3)]],
            [],
            ALERTS,
        )
    ) == [("rtt-spike", "p2:9")]


def test_a_spike_between_two_polls_is_on_the_timeline():
    """The head's worst round trip of its last seconds (`rtt_max_ms`) shows a stall that its last
    round trip, normal again by the poll, hides."""
    spike = {"addr": "p2:9", "state": "up", "rtt_ms": 1.0, "rtt_max_ms": 812.5}
    got = timeline([(0, doc()), (1, doc(peers=[spike])), (2, doc(peers=[spike])), (3, doc())], [], ALERTS)
    assert kinds(got) == [("rtt-spike", "p2:9")] and "812.5 ms" in got[0].message


def test_acceptance_collapse_is_an_incident_and_costly_speculation_names_the_flag():
    spec = {"type": "ngram"}
    history = [
        (
            0.0,
            doc(
                speculative={**spec, "draft_tokens": 100, "accepted": 60, "recent_acceptance": 0.6},
                throughput={"decode_tokens_total": 100},
            ),
        ),
        (
            1.0,
            doc(
                speculative={**spec, "draft_tokens": 241, "accepted": 60, "recent_acceptance": 0.0},
                throughput={"decode_tokens_total": 150},
            ),
        ),
    ]
    assert kinds(timeline(history, [], ALERTS)) == [("acceptance-collapse", "head")]
    (advice,) = advise(history, [], ALERTS)
    assert advice.key == "speculation"
    assert (
        advice.message.startswith("ngram acceptance 0% over 141 draft tokens: 2.8 rejected rows")
        and "--spec-type off" in advice.message
    )
    # Too few drafts to judge: no advice.
    few = [(0.0, doc(speculative=spec)), (1.0, doc(speculative={**spec, "draft_tokens": 5}))]
    assert advise(few, [], ALERTS) == []


def test_advice_names_the_setting():
    history = [
        (0.0, doc(pool={"dropped": 1}, peers=[{"addr": "p2:9", "state": "up", "rtt_ms": 30.0}])),
        (
            1.0,
            doc(
                requests={"queued": 12, "rejected_total": 4, "queue_max": 12, "itl_p50_ms": 100.0},
                pool={"dropped": 3},
                peers=[{"addr": "p2:9", "state": "up", "rtt_ms": 40.0}],
                slots=[{"id": 0, "n_ctx": 128, "n_past": 127}],
            ),
        ),
    ]
    events = [
        Event(
            0.5,
            "peer1",
            "crash-loop",
            "3 exits in a row, none after a healthy run (60 s); last line: hydra-engine: "
            "error: /m/x.gguf: No such file or directory",
        )
    ]
    got = {a.key: a.message for a in advise(history, events, ALERTS)}
    assert got["queue"] == "queue 12 deep with 4 slots: raise --parallel"
    assert got["queue-full"].startswith("4 requests refused, queue full at 12: raise --max-queue")
    assert got["kv-full"] == "slot(s) 0 at the context (128 tokens): raise --ctx"
    assert "dropped 2 connections: raise --rpc-pool-size or --rpc-queue" in got["pool-drop"]
    assert got["rtt:p2:9"].startswith("peer p2:9 RTT p99 40 ms: the hop is 35% of a step: move layers off it")
    assert got["crash-loop:peer1"] == "peer1 is crash-looping: fix the model path (the profile's `model`)"


async def test_incidents_outlive_the_poll_history_and_the_console_and_age_out_after_keep_s(tmp_path):
    now = [1000.0]
    up, down = doc(), doc(peers=[{"addr": "p2:9", "state": "down", "error": "reset"}])
    feed = FixedFeedSource({"head": Probe(True, 200, {"status": "ok"}, up)})
    sup = Supervisor(Profile(peers=[]), attach=True, source=feed, clock=lambda: now[0])
    path = tmp_path / "run" / "default.incidents.jsonl"
    log = IncidentLog(ALERTS, path, clock=lambda: now[0], keep_s=86400)
    log.follow(sup)
    for i in range(HISTORY * 3):  # the peer goes down once, then polls go on for longer than the history
        feed.probes["head"] = Probe(True, 200, {"status": "ok"}, down if i >= 1 else up)
        now[0] += 1.0
        await sup.poll_once()
    assert all(st.peers[0].state == "down" for _, st in sup.head.history)  # the change left the history
    assert ("peer-down", "p2:9") in kinds(log.since(0)) and len(log.incidents) == 2  # ready, peer-down
    now[0] += 5 * 3600  # the console started after the page, hours later
    assert ("peer-down", "p2:9") in kinds(IncidentLog(ALERTS, path, clock=lambda: now[0], keep_s=86400).since(0))
    now[0] += 86400
    assert IncidentLog(ALERTS, path, clock=lambda: now[0], keep_s=86400).since(0) == []


def test_the_incident_file_stays_within_its_size_keeping_the_newest(tmp_path):
    path = tmp_path / "run" / "p.incidents.jsonl"
    log = IncidentLog(ALERTS, path, max_bytes=4096, clock=lambda: 10_000.0)
    for i in range(500):  # ~80 bytes each: ten times the bound
        log.add([Incident(1000.0 + i, "down", "peer1", f"peer1: down #{i}")])
        assert path.stat().st_size <= 4096 + 100, i
    again = IncidentLog(ALERTS, path, clock=lambda: 10_000.0).since(0)  # the next console's view
    assert again and again[-1].message == "peer1: down #499" and len(again) < 60


def test_an_incident_is_open_until_its_subject_recovers():
    incidents = [
        Incident(1.0, "peer-down", "p2:9", "down"),
        Incident(2.0, "crash", "peer1", "exited"),
        Incident(3.0, "up", "peer1", "ready again"),
        Incident(4.0, "crash-loop", "head", "looping"),
        Incident(5.0, "peer-up", "p3:9", "another peer"),
    ]
    assert [i.message for i in open_incidents(incidents)] == ["down", "looping"]
    assert open_incidents([*incidents, Incident(6.0, "peer-up", "p2:9", "back"), Incident(7.0, "up", "head", "")]) == []
