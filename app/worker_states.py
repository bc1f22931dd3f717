"""A worker's state machine: what a poll's answer makes of it (missed polls tolerated, the
/status histories, ready / degraded / unreachable), and what an exit does (stopped, crashed, or
a restart after its backoff; a crash loop after `crash_loop_count` exits without a healthy run).
Each change raises its event through `emit`."""

from __future__ import annotations

from collections import deque
from typing import Callable

import psutil

from ..contracts.status import Status
from .config import SupervisorSettings
from .records import HISTORY, State, Worker, describe_exit
from .sources import Probe

MISSES_TOLERATED = 3  # polls in a row a worker that answered before may miss before its state changes

Emit = Callable[[str, str, str], object]


def started(w: Worker, proc, argv: list[str], run_id: str, started_at: float, crash_loop_count: int) -> None:
    """A process of the worker runs (started, or adopted): starting, or still in its crash loop."""
    w.proc, w.pid, w.argv, w.run_id = proc, proc.pid, argv, run_id
    w.started_at, w.ready_at, w.probe, w.backoff_until, w.down_since = started_at, None, None, None, None
    w.state = State.CRASH_LOOP if w.failures >= crash_loop_count else State.STARTING
    try:
        w._ps = psutil.Process(proc.pid) if w.spec.is_local else None
    except psutil.Error:
        w._ps = None


def record_rtts(w: Worker, ts: float, status: Status) -> None:
    """Each peer's worst round trip this poll knows of (`rtt_peak_ms`: a spike between two polls
    included); None while it is not up. A peer the head no longer drives is forgotten."""
    addrs = {p.addr for p in status.peers}
    for gone in w.rtt_hist.keys() - addrs:
        del w.rtt_hist[gone]
    for p in status.peers:
        hist = w.rtt_hist.setdefault(p.addr, deque(maxlen=HISTORY))
        hist.append((ts, p.rtt_peak_ms if p.state == "up" else None))


def apply_probe(
    w: Worker,
    p: Probe,
    split_changes: int,
    clock: Callable[[], float],
    emit: Emit,
    on_status: Callable[[str, float, Status], None],
) -> None:
    """Take a poll's answer: `split_changes` = the supervisor's when it was asked for; `on_status`
    gets each /status polled."""
    if w.managed and (not w.running or w.state == State.STOPPING):
        return  # the answer raced a stop or an exit
    if not p.reachable and w.probe is not None and w.probe.reachable:
        # A worker busy with a long forward can miss a poll: only MISSES_TOLERATED in a row count.
        w.misses += 1
        if w.misses < MISSES_TOLERATED:
            return
    w.misses = 0
    w.probe, w.probe_split_changes = p, split_changes
    if p.status is not None:
        ts = clock()
        w.history.append((ts, p.status))
        w.prefill_hist.append(p.status.throughput.prefill_tok_s)
        w.decode_hist.append(p.status.throughput.decode_tok_s)
        record_rtts(w, ts, p.status)
        on_status(w.name, ts, p.status)
    if w._ps is not None:
        try:
            w.cpu_pct = w._ps.cpu_percent(None)
            w.rss = w._ps.memory_info().rss
        except psutil.Error:
            w._ps = None
    pid = p.status.pid if p.status else None
    if not w.managed and pid:
        if w.seen_pid and pid != w.seen_pid:
            emit(w.name, "restarted", f"pid {w.seen_pid} → {pid} (restarted outside this console)")
        w.seen_pid = pid
    hs = p.health_state
    if hs is None:
        # Started and once up, now silent: degraded (the process lives); never answered yet: starting.
        up_before = w.state in (State.READY, State.DEGRADED)
        new = (State.DEGRADED if up_before else State.STARTING) if w.managed else State.UNREACHABLE
    else:
        new = {"ok": State.READY, "degraded": State.DEGRADED}.get(hs, State.STARTING)
        if new == State.DEGRADED and w.role == "peer" and w.started_at is not None and w.ready_at is None:
            # A peer has no stage until its head loads one and says degraded meanwhile: since its
            # start that is waiting for the head, not an incident.
            new = State.STARTING
    if new == State.STARTING and w.state == State.CRASH_LOOP:
        return  # still looping until it is ready once
    if new == w.state:
        return
    old, w.state, now = w.state, new, clock()
    if new == State.READY:
        w.ready_at = now
        if w.down_since is not None:
            emit(w.name, "ready", f"ready again after {now - w.down_since:.1f} s {old.value}")
        elif w.managed and w.started_at:
            emit(w.name, "ready", f"ready {now - w.started_at:.1f} s after its start")
        else:
            emit(w.name, "ready", "ready")
        w.down_since = None
        return
    if w.down_since is None and new in (State.DEGRADED, State.UNREACHABLE):
        w.down_since = now
    if new == State.DEGRADED:
        emit(w.name, "degraded", f"not answering: {p.error}" if hs is None else "health reports degraded")
    elif new == State.UNREACHABLE:
        emit(w.name, "unreachable", p.error or "no answer")


def exited(
    w: Worker, code: int | None, ran: float, now: float, settings: SupervisorSettings, auto_restart: bool, emit: Emit
) -> float | None:
    """After the worker's process exited with `code`, `ran` seconds after its start: the delay
    before its restart, or None (not wanted, or auto-restart off)."""
    if not w.wanted:
        w.state = State.STOPPED
        emit(w.name, "stopped", f"pid {w.pid} exited ({describe_exit(code)})")
        return None
    if not auto_restart:
        w.state, w.wanted = State.CRASHED, False
        emit(w.name, "crashed", f"pid {w.pid} exited ({describe_exit(code)}) after {ran:.1f} s")
        return None
    if ran >= settings.healthy_reset_s:
        w.backoff.reset()
        w.failures = 0
    w.failures += 1
    looping = w.failures >= settings.crash_loop_count
    delay = w.backoff.next()
    w.state, w.backoff_until = (State.CRASH_LOOP if looping else State.BACKOFF), now + delay
    emit(w.name, "crashed", f"pid {w.pid} exited ({describe_exit(code)}) after {ran:.1f} s; restart in {delay:g} s")
    if looping:
        emit(
            w.name,
            "crash-loop",
            f"{w.failures} exits in a row, none after a healthy run ({settings.healthy_reset_s:g} s); "
            f"last line: {w.last_err or '(none)'}",
        )
    return delay
