"""Incident triage: a timeline that puts what the supervisor saw (restarts, crash loops, workers
down and back) beside what the head's /status history shows (peers down/up, RTT spikes, pool
drops, a full queue or context, speculation's acceptance collapsing, latency spikes), and advice
that names the setting to change.

Plain functions over plain data: `history` is the head's /status documents as polled, oldest
first, as (time, Status); `events` the supervisor's events. No I/O, no Textual: `incidents.py`
keeps what these find, for hours and across consoles.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from ..contracts.status import Status
from .config import Alerts
from .records import Event

SPIKE_FACTOR = 4.0  # inter-token p99 this many times its p50: a latency spike
COLLAPSED = 0.10  # speculation's recent acceptance under this, after it was at least HEALTHY
HEALTHY = 0.30
MIN_DRAFT_TOKENS = 20  # advice on acceptance needs at least this many draft tokens in the window
KV_FULL_MARGIN = 1  # a slot within this many positions of its context is full

# Supervisor events on the timeline, by kind: (incident kind, shown).
EVENT_INCIDENTS = {
    "restarted": "restart",
    "crash-loop": "crash-loop",
    "crashed": "crash",
    "unreachable": "down",
    "degraded": "down",
    "ready": "up",
    "split": "split",
    "killed": "crash",
}

# A crash loop's last log line -> what to change.
CRASH_CAUSES: list[tuple[re.Pattern, str]] = [
    (re.compile(p, re.IGNORECASE), fix)
    for p, fix in [
        (r"no such file|not found|does not exist", "fix the model path (the profile's `model`)"),
        (r"address already in use|port .* held", "free the port or change the worker's `port` in the profile"),
        (r"out of memory|OutOfMemory", "fewer layers on it (split editor), or lower --ctx / --parallel"),
        (r"unrecognized arguments|invalid choice|must be", "fix the flag in the worker's `args`"),
    ]
]


@dataclass(frozen=True)
class Incident:
    ts: float
    kind: str  # restart, crash-loop, crash, down, up, split, peer-down, peer-up, rtt-spike, pool-drop, queue-full, kv-full, acceptance-collapse, latency-spike
    subject: str  # a worker or a peer address
    message: str


@dataclass(frozen=True)
class Advice:
    key: str  # one per kind of problem and subject: the UI keeps one line each
    message: str  # what is wrong, then the setting to change


def _peers(st: Status) -> dict:
    return {p.addr: p for p in st.peers}


def _kv_full(st: Status) -> list[int]:
    return [s.id for s in st.slots if s.n_ctx and s.n_past >= s.n_ctx - KV_FULL_MARGIN]


def event_incident(e: Event) -> Incident | None:
    """A supervisor event as an incident, if it is one."""
    kind = EVENT_INCIDENTS.get(e.kind)
    return Incident(e.ts, kind, e.worker, e.message) if kind else None


def status_incidents(prev: Status, cur: Status, ts: float, alerts: Alerts, subject: str = "head") -> list[Incident]:
    """What changed between two polls of one worker's /status (`subject`): its peers, its pool, its
    requests, its slots, speculation. A condition that lasts is one incident, at its start."""
    out = []
    before = _peers(prev)
    for addr, p in _peers(cur).items():
        was = before.get(addr)
        if was is not None and was.state != p.state and "down" in (was.state, p.state):
            kind = "peer-down" if p.state == "down" else "peer-up"
            out.append(
                Incident(ts, kind, addr, f"peer {addr} {was.state} → {p.state}" + (f" ({p.error})" if p.error else ""))
            )
        peak, was_peak = p.rtt_peak_ms, (was.rtt_peak_ms if was is not None else None)
        if peak is not None and peak >= alerts.rtt_ms and (was_peak is None or was_peak < alerts.rtt_ms):
            out.append(
                Incident(ts, "rtt-spike", addr, f"peer {addr} RTT {peak:.1f} ms (alert at {alerts.rtt_ms:g} ms)")
            )
    if prev.pool and cur.pool and cur.pool.dropped > prev.pool.dropped:
        out.append(
            Incident(
                ts,
                "pool-drop",
                subject,
                f"RPC pool dropped {cur.pool.dropped - prev.pool.dropped} connection(s): its queue was full",
            )
        )
    r0, r1 = prev.requests, cur.requests
    if r0 and r1:
        if r1.rejected_total > r0.rejected_total:
            out.append(
                Incident(
                    ts,
                    "queue-full",
                    subject,
                    f"{r1.rejected_total - r0.rejected_total} request(s) refused: queue full ({r1.queued} waiting)",
                )
            )
        spiking = r1.itl_p99_ms is not None and r1.itl_p50_ms and r1.itl_p99_ms >= SPIKE_FACTOR * r1.itl_p50_ms
        spiked = r0.itl_p99_ms is not None and r0.itl_p50_ms and r0.itl_p99_ms >= SPIKE_FACTOR * r0.itl_p50_ms
        if spiking and not spiked:
            out.append(
                Incident(
                    ts,
                    "latency-spike",
                    subject,
                    f"inter-token p99 {r1.itl_p99_ms:.0f} ms, {r1.itl_p99_ms / r1.itl_p50_ms:.0f}x its p50",
                )
            )
    full = set(_kv_full(cur)) - set(_kv_full(prev))
    if full:
        out.append(Incident(ts, "kv-full", subject, f"slot(s) {', '.join(map(str, sorted(full)))} reached the context"))
    a0, a1 = prev.speculative.recent_acceptance, cur.speculative.recent_acceptance
    if a0 is not None and a1 is not None and a0 >= HEALTHY and a1 < COLLAPSED:
        out.append(
            Incident(ts, "acceptance-collapse", subject, f"{cur.speculative.type} acceptance {a0:.0%} → {a1:.0%}")
        )
    return out


# An incident that stays open until its subject's closing kind follows it.
CLOSED_BY = {"down": "up", "crash": "up", "crash-loop": "up", "peer-down": "peer-up"}


def open_incidents(incidents: list[Incident]) -> list[Incident]:
    """Incidents not over yet, oldest first: a worker down, crashed or looping that has not been
    ready since; a peer down that has not come back."""
    last: dict[tuple[str, str], Incident] = {}  # (subject, closing kind) -> the incident it would close
    for inc in sorted(incidents, key=lambda i: i.ts):
        if inc.kind in CLOSED_BY:
            last[(inc.subject, CLOSED_BY[inc.kind])] = inc
        else:
            last.pop((inc.subject, inc.kind), None)
    return sorted(last.values(), key=lambda i: i.ts)


def advise(history: list[tuple[float, Status]], events: list[Event], alerts: Alerts) -> list[Advice]:
    """What to change now, judged on the latest document and the window `history` covers."""
    out: list[Advice] = []
    if history:
        out += _requests_advice(history) + _spec_advice(history) + _link_advice(history, alerts)
    out += _crash_advice(events)
    return out


def _requests_advice(history) -> list[Advice]:
    (_, first), (_, last) = history[0], history[-1]
    out = []
    r = last.requests
    if r and r.queued > r.slots_total:
        slots = f"{r.slots_total} slot" + ("s" if r.slots_total != 1 else "")
        out.append(Advice("queue", f"queue {r.queued} deep with {slots}: raise --parallel"))
    if r and first.requests and r.rejected_total > first.requests.rejected_total:
        n = r.rejected_total - first.requests.rejected_total
        limit = f" at {r.queue_max}" if r.queue_max is not None else ""
        out.append(
            Advice(
                "queue-full", f"{n} requests refused, queue full{limit}: raise --max-queue, or --parallel to drain it"
            )
        )
    full = _kv_full(last)
    if full:
        out.append(
            Advice(
                "kv-full",
                f"slot(s) {', '.join(map(str, full))} at the context ({last.slots[full[0]].n_ctx} tokens): raise --ctx",
            )
        )
    if first.pool and last.pool and last.pool.dropped > first.pool.dropped:
        out.append(
            Advice(
                "pool-drop",
                f"RPC pool dropped {last.pool.dropped - first.pool.dropped} connections: "
                "raise --rpc-pool-size or --rpc-queue",
            )
        )
    return out


def _spec_advice(history) -> list[Advice]:
    (_, first), (_, last) = history[0], history[-1]
    s0, s1 = first.speculative, last.speculative
    drafted, accepted = s1.draft_tokens - s0.draft_tokens, s1.accepted - s0.accepted
    if s1.type == "off" or drafted < MIN_DRAFT_TOKENS:
        return []
    rate = accepted / drafted
    if rate >= COLLAPSED:
        return []
    decoded = max(last.throughput.decode_tokens_total - first.throughput.decode_tokens_total, 1)
    waste = (drafted - accepted) / decoded  # rejected draft rows verified per token kept
    return [
        Advice(
            "speculation",
            f"{s1.type} acceptance {rate:.0%} over {drafted} draft tokens: {waste:.1f} rejected rows "
            "verified per token: turn it off (--spec-type off), or lower --draft-max",
        )
    ]


def _link_advice(history, alerts: Alerts) -> list[Advice]:
    last = history[-1][1]
    step = last.requests.itl_p50_ms if last.requests else None
    out = []
    for addr in _peers(last):
        rtts = [p.rtt_ms for _, st in history for p in st.peers if p.addr == addr and p.rtt_ms is not None]
        if not rtts:
            continue
        p99, p50 = np.percentile(rtts, [99, 50]).tolist()
        if p99 < alerts.rtt_ms:
            continue
        share = f": the hop is {p50 / step:.0%} of a step" if step else ""
        out.append(
            Advice(
                f"rtt:{addr}",
                f"peer {addr} RTT p99 {p99:.0f} ms{share}: move layers off it "
                "(split editor, m: advisor) or give it a faster link",
            )
        )
    return out


def _crash_advice(events: list[Event]) -> list[Advice]:
    out, seen = [], set()
    for e in reversed(events):
        if e.kind != "crash-loop" or e.worker in seen:
            continue
        seen.add(e.worker)
        fix = next((fix for rx, fix in CRASH_CAUSES if rx.search(e.message)), "read its log (l)")
        out.append(Advice(f"crash-loop:{e.worker}", f"{e.worker} is crash-looping: {fix}"))
    return out
