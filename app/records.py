"""What the supervisor records: each worker's `State` and its `Worker` record (what runs, counters,
histories of its /status), the `Event`s and `LogLine`s observers read, the restart `Backoff`, and
`SupervisorError`, a command it cannot carry out. No Textual import."""

from __future__ import annotations

import asyncio
import signal
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

import psutil

from ..contracts.errors import UserError
from ..contracts.status import Status
from .config import SupervisorSettings, WorkerSpec
from .sources import Probe
from .worker_log import LogFile

HISTORY = 120  # samples kept for sparklines (2 min at 1 Hz)


class State(str, Enum):
    STOPPED = "stopped"
    STARTING = "starting"
    READY = "ready"
    DEGRADED = "degraded"
    BACKOFF = "backoff"  # crashed, waiting to restart
    CRASH_LOOP = "crash-loop"  # exits soon after every start (still retried, with backoff)
    PORT_BUSY = "port-busy"  # another process holds its port: started once the port frees
    CRASHED = "crashed"  # crashed, auto-restart off
    STOPPING = "stopping"
    UNREACHABLE = "unreachable"  # attached worker that does not answer


class SupervisorError(UserError):
    """A command the supervisor cannot carry out (the UI shows the message)."""


@dataclass(frozen=True)
class Event:
    ts: float
    worker: str  # "" for console-wide events
    kind: str  # started, adopted, ready, degraded, unreachable, crashed, crash-loop, restarted, stopping, killed, stopped, split, error
    message: str


@dataclass(frozen=True)
class LogLine:
    seq: int
    ts: float
    worker: str
    text: str


class Backoff:
    """1 s, 2 s, 4 s … capped at `maximum`; `reset()` after a healthy run."""

    def __init__(self, initial: float = 1.0, maximum: float = 30.0):
        self.initial, self.maximum = initial, maximum
        self._next = initial

    def next(self) -> float:
        delay = self._next
        self._next = min(self._next * 2, self.maximum)
        return delay

    def reset(self) -> None:
        self._next = self.initial


def describe_exit(code: int | None) -> str:
    """Exit status for people: 0, 1, SIGKILL (asyncio reports signals as negative codes)."""
    if code is None:
        return "—"
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return str(code)


@dataclass
class Worker:
    spec: WorkerSpec
    role: str  # "head" | "peer"
    managed: bool  # started by this console (False: attached, monitor only)
    log: deque
    logfile: LogFile | None  # None: remote and attached (its file is on its host), or not writable
    backoff: Backoff
    state: State = State.STOPPED
    pid: int | None = None
    started_at: float | None = None
    ready_at: float | None = None
    restarts: int = 0  # every restart, the operator's included
    crash_restarts: int = 0  # automatic ones only: what the restart alert counts
    failures: int = 0  # exits in a row without a healthy run (healthy_reset_s), however long each took
    last_err: str | None = None  # last non-empty line it logged (names a crash loop's cause)
    last_exit: int | None = None
    argv: list[str] | None = None  # what the running process was really started with
    run_id: str | None = None
    seen_pid: int | None = None  # attached: the pid /status reported last (a change = a restart elsewhere)
    down_since: float | None = None  # when it went degraded / unreachable
    backoff_until: float | None = None
    probe: Probe | None = None
    probe_split_changes: int = 0  # the supervisor's split_changes when `probe` was asked for
    prefill_hist: deque = field(default_factory=lambda: deque(maxlen=HISTORY))
    decode_hist: deque = field(default_factory=lambda: deque(maxlen=HISTORY))
    rtt_hist: dict[str, deque] = field(default_factory=dict)  # a head's peers: addr -> (time, worst RTT ms | None)
    history: deque = field(
        default_factory=lambda: deque(maxlen=HISTORY)
    )  # (time, Status) as polled: triage's advice (incidents.py keeps incidents longer)
    cpu_pct: float | None = None  # psutil, local started workers only
    rss: int | None = None
    wanted: bool = False  # should be running (drives auto-restart)
    misses: int = 0  # polls missed in a row since the last answer
    proc: asyncio.subprocess.Process | None = None
    _watch: asyncio.Task | None = None
    _restart: asyncio.Task | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # serialises start/stop/restart
    _ps: psutil.Process | None = None
    _follow: asyncio.Task | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def log_path(self) -> Path | None:
        return self.logfile.path if self.logfile else None

    @property
    def status(self) -> Status | None:
        return self.probe.status if self.probe else None

    @property
    def running(self) -> bool:
        return self.proc is not None

    def uptime(self, now: float) -> float | None:
        if self.managed:
            return now - self.started_at if self.running and self.started_at is not None else None
        st = self.status
        return st.uptime_s if st else None

    def shown_pid(self) -> int | None:
        if self.managed:
            return self.pid if self.running else None
        st = self.status
        return st.pid if st else None


def new_worker(spec: WorkerSpec, role: str, managed: bool, log_path: Path, settings: SupervisorSettings) -> Worker:
    """A worker's record before anything runs; a remote attached worker has no log file here."""
    return Worker(
        spec=spec,
        role=role,
        managed=managed,
        log=deque(maxlen=settings.ring_lines),
        logfile=LogFile(log_path, settings.log_max_bytes, settings.log_backups) if managed or spec.is_local else None,
        backoff=Backoff(settings.backoff_initial_s, settings.backoff_max_s),
    )
