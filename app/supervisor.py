"""Process supervision of the head and peer workers (asyncio; no Textual import).

Each started worker runs in its own session/process group so a stop reaches everything it
spawned: SIGTERM to the group, a grace period (10 s by default), then SIGKILL. A worker that
exits while it is wanted is restarted after a backoff of 1 s doubling to 30 s; one that ran for
`healthy_reset_s` before it died starts again from 1 s. A worker writes its stdout and stderr into
its own log file through its log writer (`worker_log.py`), never into pipes of the console, so it
outlives the console that started it; every console follows the files into ring buffers (per
worker and merged). Every
`poll_s` the supervisor probes /health and /status of each worker through a `StatusSource` and
derives its state.

Workers it starts prove a token on their RPC ports: `token` (the console passes HYDRA_TOKEN from
its environment, so workers started elsewhere share it), else a random one kept per profile. Local workers get
it in their environment; remote ones in a 0600 file (`REMOTE_TOKEN_FILE`, written through the
launcher with the token on stdin), never in argv, where `ps` on either host would show it.

Observers (the UI) read `workers`, `events`, `merged_log` and call the async commands; they get
each new `Event` through `subscribe` and each polled /status through `subscribe_status`.

Truth over intent: a worker's record holds the argv it was really started with, and a (re)start
launches `Supervisor.split`, the split the head last reported in /status (or the one the operator
applied), never a draft saved to the profile.

Takeover: every started worker carries HYDRA_RUN_ID in its environment, and a per-profile state
file (state dir, written atomically) lists pids, ports, run ids, log files and the console that
runs them. A console that starts finds the workers of its profile that still run with those run
ids and adopts them (watch, stop, restart) instead of starting duplicates; while the console named
in the file lives, it watches them read-only instead (`owner`). `shutdown(stop_workers=False)`
detaches, leaving them and naming no console in the file.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Callable

import psutil

from ..contracts.errors import UserError
from ..contracts.split import counts_of, split_arg
from ..contracts.status import Status
from . import control_client
from .config import DEFAULT_SSH_TEMPLATE, Profile, WorkerSpec, atomic_write, state_dir
from .sources import HttpStatusSource, Probe, StatusSource
from .worker_log import LogFile

log = logging.getLogger("hydra.console.supervisor")
HISTORY = 120  # samples kept for sparklines (2 min at 1 Hz)
MISSES_TOLERATED = 3  # polls in a row a worker that answered before may miss before its state changes
FOLLOW_S = 0.2  # how often the log files are read
WRITER_DRAIN_S = 2.0  # a dead worker's log writer gets this long to write its last lines
CONSOLE_MARK = "[hydra-console]"  # the console's own lines in a worker's log file
_STARTED = psutil.Process().create_time()  # with the pid, names this console in the run file
START_TOLERANCE_S = 1.5  # start times read by two processes: each derives the boot time from a clock NTP moves
RUN_ID_ENV = "HYDRA_RUN_ID"  # set on every started worker: a later console recognises its workers by it


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


def _port_taken(host: str, port: int) -> bool:
    """Binding fails where the worker would bind (SO_REUSEADDR, as its servers set it, so only a
    socket still bound there counts, not connections closing). A connect would miss a holder that
    does not accept: a full backlog times out like a free port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host or "0.0.0.0", port))
        except OSError:
            return True
    return False


def connect_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


REMOTE_TOKEN_FILE = ".hydra/token-{name}"  # relative: ssh starts the remote command in the login directory


def port_owner(port: int) -> str:
    """Who listens on `port` on this machine: "pid 4711 (python -m http.server 8080)"."""
    try:
        conns = psutil.net_connections(kind="inet")
    except psutil.Error:
        conns = []
    for c in conns:
        if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN and c.pid:
            try:
                cmd = shlex.join(psutil.Process(c.pid).cmdline())
            except psutil.Error:
                cmd = "?"
            return f"pid {c.pid} ({cmd[:80]})"
    return "a process this user cannot see"


def profile_token(path: Path) -> str:
    """The RPC token of a profile's workers, kept 0600 beside its state file: the next console of
    the profile (attached, or adopting workers a killed console left) proves the same one."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path.read_text().strip()
    except FileNotFoundError:  # no state directory yet
        path.parent.mkdir(parents=True, exist_ok=True)
        return profile_token(path)
    token = secrets.token_hex(32)
    with os.fdopen(fd, "w") as f:
        f.write(token)
    return token


class _Adopted:
    """A worker process another console started: its exit code is its parent's to read."""

    def __init__(self, ps: psutil.Process):
        self.pid, self._ps = ps.pid, ps

    async def wait(self) -> None:
        while True:
            try:
                if self._ps.status() == psutil.STATUS_ZOMBIE:
                    return None
            except psutil.NoSuchProcess:
                return None
            await asyncio.sleep(0.2)


def _ours(entry: dict, spec: WorkerSpec) -> psutil.Process | None:
    """The live process a state-file entry names, if it is still that worker (same ports, same run id)."""
    try:
        if (entry["port"], entry["rpc"]) != (spec.port, spec.rpc):
            return None
        ps = psutil.Process(int(entry["pid"]))
        if ps.status() == psutil.STATUS_ZOMBIE:
            return None
        try:
            same = ps.environ().get(RUN_ID_ENV) == entry["run_id"]
        except psutil.AccessDenied:
            same = ps.cmdline() == entry.get("argv")
        return ps if same else None
    except (psutil.Error, KeyError, TypeError, ValueError):
        return None


def _reap(writer: subprocess.Popen, timeout: float) -> None:
    try:
        writer.wait(timeout)
    except subprocess.TimeoutExpired:
        pass


def _release(proc) -> None:
    """Detach from a started child: keep asyncio's transport from killing it, as close() and
    collection would (CPython's transport). It writes its own log file, so nothing else ties it to us."""
    transport = getattr(proc, "_transport", None)
    if transport is not None:
        transport._closed = True


class Supervisor:
    def __init__(
        self,
        profile: Profile,
        *,
        source: StatusSource | None = None,
        attach: bool = False,
        clock: Callable[[], float] = time.time,
        log_dir: str | Path | None = None,
        auto_restart: bool = True,
        readonly: bool = False,
        state_path: str | Path | None = None,
        token: str | None = None,
    ):
        self.profile = profile
        self.settings = profile.supervisor
        self.source = source or HttpStatusSource()
        self.clock = clock
        self.auto_restart = auto_restart
        self.state_path = Path(state_path) if state_path else state_dir() / "run" / f"{profile.name}.json"
        # A second console of a profile that a live console runs watches it, read-only, instead of
        # competing for its workers (or showing them as stopped).
        self.owner = None if attach or readonly else self._owning_console()
        self.readonly = readonly or self.owner is not None
        self.attach_only = attach or self.readonly  # read-only: starts, stops and applies nothing
        self.split = list(profile.split) if profile.split else None  # what a (re)start of the head launches
        self.run_id = uuid.uuid4().hex[:12]
        self.identity = f"hydra-console pid {os.getpid()} on {socket.gethostname()}"
        self.token = token or profile_token(self.state_path.with_suffix(".token"))
        self.detached = False
        self.log_dir = Path(log_dir or self.settings.log_dir or state_dir() / "logs")
        self.events: deque[Event] = deque(maxlen=1000)
        self.merged_log: deque[LogLine] = deque(maxlen=self.settings.ring_lines * 2)
        self.workers: dict[str, Worker] = {}
        for i, spec in enumerate(profile.workers):
            managed = not (self.attach_only or spec.attach)
            path = self.log_dir / f"{profile.name}-{spec.name}.log"
            self.workers[spec.name] = Worker(
                spec=spec,
                role="head" if i == 0 else "peer",
                managed=managed,
                log=deque(maxlen=self.settings.ring_lines),
                logfile=LogFile(path, self.settings.log_max_bytes, self.settings.log_backups)
                if managed or spec.is_local
                else None,
                backoff=Backoff(self.settings.backoff_initial_s, self.settings.backoff_max_s),
            )
        self._listeners: list[Callable[[Event], None]] = []
        self._status_listeners: list[Callable[[str, float, Status], None]] = []
        self._seq = itertools.count()
        self._tasks: set[asyncio.Task] = set()
        self._poller: asyncio.Task | None = None
        self._last_ranges: tuple | None = None
        # Times this console set the split: the head's ranges from a poll sent before the last
        # change are the old process's (or the old CONFIGURE's), and must not undo it.
        self.split_changes = 0

    # ---- observation -------------------------------------------------------------------------

    def subscribe(self, fn: Callable[[Event], None]) -> Callable[[], None]:
        self._listeners.append(fn)
        return lambda: self._listeners.remove(fn) if fn in self._listeners else None

    def subscribe_status(self, fn: Callable[[str, float, Status], None]) -> Callable[[], None]:
        """`fn(worker, time, status)` for every /status polled (what the incident log compares)."""
        self._status_listeners.append(fn)
        return lambda: self._status_listeners.remove(fn) if fn in self._status_listeners else None

    def emit(self, worker: str, kind: str, message: str) -> Event:
        ev = Event(self.clock(), worker, kind, message)
        self.events.append(ev)
        for fn in list(self._listeners):
            try:
                fn(ev)
            except Exception:  # an observer's bug must not stop supervision
                log.exception("event listener failed on %s", ev)
        return ev

    @property
    def head(self) -> Worker:
        return self.workers[self.profile.head.name]

    def worker(self, name: str) -> Worker:
        try:
            return self.workers[name]
        except KeyError:
            raise SupervisorError(f"no worker named {name!r}") from None

    def running_managed(self) -> list[Worker]:
        """Workers this console started that are still up (what quitting would stop)."""
        return [w for w in self.workers.values() if w.managed and (w.running or w.wanted)]

    def stage_ranges(self) -> list[tuple[str, tuple[int, int]]] | None:
        """Layer ranges the head reports in /status, pipeline order."""
        st = self.head.status
        out = [(s.addr or s.role, s.layers) for s in (st.stages if st else []) if s.layers is not None]
        return out or None

    # ---- commands ----------------------------------------------------------------------------

    def command_for(self, name: str) -> list[str]:
        """argv that starts worker `name` (through its ssh launcher when remote)."""
        p = self.profile
        w = self.worker(name)
        spec = w.spec
        bind = spec.host if spec.is_local else "0.0.0.0"
        rpc_bind = spec.rpc_host or (spec.host if spec.is_local else "0.0.0.0")
        args = ["serve" if w.role == "head" else "peer"]
        if p.model:
            args += ["--model", p.model]
        args += ["--host", bind, "--port", str(spec.port), "--rpc-host", rpc_bind, "--rpc-port", str(spec.rpc)]
        args += ["--device", spec.device, "--ctx", str(p.ctx)]
        for kv, kind in (("k", p.cache_type_k), ("v", p.cache_type_v)):
            if kind != "auto":
                args += [f"--cache-type-{kv}", kind]
        if w.role == "head":
            args += ["--parallel", str(p.parallel)]
            for peer in p.peers:
                args += ["--peer", f"{connect_host(peer.host)}:{peer.rpc}"]
            if self.split:
                args += ["--split", split_arg(self.split)]
            if p.prefill_worker:
                args += ["--prefill-worker", p.prefill_worker, "--prefill-threshold", str(p.prefill_threshold)]
            sp = p.speculative
            if sp.type != "off":
                args += ["--spec-type", sp.type, "--draft-max", str(sp.draft_max)]
                if sp.model_draft:
                    args += ["--model-draft", sp.model_draft]
        args += spec.args
        if spec.is_local:
            prefix = (
                shlex.split(p.engine_command)
                if p.engine_command
                else [sys.executable, "-m", "hydra_console.engine.cli"]
            )
            return prefix + args
        args += ["--auth-token-file", REMOTE_TOKEN_FILE.format(name=name)]
        return self._remote(spec, shlex.join(shlex.split(p.engine_command or "hydra-engine") + args))

    @staticmethod
    def _remote(spec: WorkerSpec, command: str, tty: bool = True) -> list[str]:
        """The launcher's argv running `command` on the worker's host (`tty=False` drops ssh's -tt,
        so stdin reaches the command unechoed)."""
        # Substitute per token so the remote command stays one argument for ssh to hand to the remote shell.
        return [
            command if tok == "{command}" else tok.format(host=spec.host, command=command)
            for tok in shlex.split(spec.launcher or DEFAULT_SSH_TEMPLATE)
            if tty or tok != "-tt"
        ]

    async def _send_token(self, w: Worker) -> bool:
        """Write the token to the remote worker's 0600 token file through the launcher, on stdin."""
        path = REMOTE_TOKEN_FILE.format(name=w.name)
        argv = self._remote(
            w.spec,
            f"umask 077 && mkdir -p {shlex.quote(os.path.dirname(path))} && cat > {shlex.quote(path)}",
            tty=False,
        )
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL,
                start_new_session=True,
            )
            await asyncio.wait_for(proc.communicate(self.token.encode() + b"\n"), self.settings.grace_s + 20)
        except (OSError, asyncio.TimeoutError) as e:
            self.emit(w.name, "error", f"cannot write the token file on {w.spec.host}: {e}")
            return False
        if proc.returncode:
            self.emit(w.name, "error", f"writing the token file on {w.spec.host} exited with {proc.returncode}")
        return proc.returncode == 0

    async def start(self) -> None:
        """Begin polling and start every managed worker (peers first: the head waits for them)."""
        if self._poller is None:
            self._poller = asyncio.create_task(self._poll_loop())
        if self.owner is not None:
            self.emit(
                "",
                "attached",
                f"console pid {self.owner} runs this profile's workers: watching them read-only "
                "(that console starts, stops and re-splits them)",
            )
        if not self.attach_only:
            self._adopt()
        _, entries = self._run_file()
        for w in self.workers.values():
            if not w.managed and w.logfile is not None:  # another console's (or a hand-started) worker
                self._use_logged_path(w, entries.get(w.name))
                w.logfile.follow_from_tail(self.settings.ring_lines)
                self._follow_log(w)
        for w in [*list(self.workers.values())[1:], self.head]:
            if w.managed and not w.running:
                await self.start_worker(w.name)

    def _managed(self, name: str, verb: str) -> Worker:
        w = self.worker(name)
        if not w.managed:
            raise SupervisorError(f"{name} is attached (monitor only); this console does not {verb} it")
        return w

    # Commands on one worker run one at a time (its lock): two quick restarts must not spawn two processes.

    async def start_worker(self, name: str) -> None:
        w = self._managed(name, "start")
        async with w.lock:
            await self._start(w)

    async def stop_worker(self, name: str, grace: float | None = None) -> None:
        w = self._managed(name, "stop")
        async with w.lock:
            await self._stop(w, self.settings.grace_s if grace is None else grace)

    async def restart_worker(self, name: str) -> None:
        w = self._managed(name, "restart")
        async with w.lock:
            old = w.pid if w.running else None
            await self._stop(w, self.settings.grace_s)
            w.restarts += 1
            w.wanted = True
            w.backoff.reset()
            w.failures = 0
            await self._spawn(w)
            self.emit(name, "restarted", f"by operator (pid {old or '—'} → {w.pid or '—'})")

    async def _start(self, w: Worker) -> None:
        if w.running:
            return
        if w.spec.is_local:
            busy = self._busy_ports(w)
            if busy:
                w.state, w.wanted = State.PORT_BUSY, True
                held = "; ".join(f"port {port} held by {port_owner(port)}" for port in busy)
                w.last_err = held
                self.emit(
                    w.name, "error", f"{held}: starting once it is free (--attach watches another console's workers)"
                )
                w._restart = self._task(self._start_when_free(w))
                return
        w.wanted = True
        w.backoff.reset()
        await self._spawn(w)

    def _busy_ports(self, w: Worker) -> list[int]:
        rpc_host = w.spec.rpc_host or w.spec.host
        return [port for host, port in ((w.spec.host, w.spec.port), (rpc_host, w.spec.rpc)) if _port_taken(host, port)]

    async def _start_when_free(self, w: Worker) -> None:
        while self._busy_ports(w):
            await asyncio.sleep(self.settings.poll_s)
        async with w.lock:
            w._restart = None
            if w.wanted and not w.running:
                w.backoff.reset()
                await self._spawn(w)

    async def _stop(self, w: Worker, grace: float) -> None:
        w.wanted = False
        if w._restart is not None:
            w._restart.cancel()
            w._restart = None
        if w.proc is None:
            w.state = State.STOPPED
            w.backoff_until = None
            return
        pid, watch = w.pid, w._watch
        w.state = State.STOPPING
        self.emit(w.name, "stopping", f"SIGTERM to pid {pid}")
        self._signal_group(pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.shield(watch), grace)
        except asyncio.TimeoutError:
            self.emit(w.name, "killed", f"pid {pid} still running {grace:g} s after SIGTERM: SIGKILL")
            self._signal_group(pid, signal.SIGKILL)
            await watch

    async def apply_split(self, counts: list[int]) -> str:
        """Re-split live through the head's CONFIGURE op; else restart the head with --split.

        Peers take no split flag (the head assigns their layers when it connects), so a restart
        of the head is the whole rolling restart. Returns "live" or "restart".
        """
        if self.readonly:
            raise SupervisorError("read-only console: it applies no split")
        if len(counts) != len(self.workers):
            raise SupervisorError(f"split {split_arg(counts)} has {len(counts)} stages for {len(self.workers)} workers")
        head = self.head
        host = connect_host(head.spec.rpc_host or head.spec.host)
        try:
            reply = await control_client.configure(
                host, head.spec.rpc, {"split": split_arg(counts), "by": self.identity}, token=self.token
            )
            if reply.ok:
                self._set_split(counts)
                self.emit(head.name, "split", f"live re-split to {split_arg(counts)}")
                return "live"
            reason = reply.status_name + (f": {reply.meta['error']}" if "error" in reply.meta else "")
        except control_client.ControlUnreachable as e:
            reason = str(e)
        if not head.managed:
            raise SupervisorError(
                f"live re-split refused ({reason}) and {head.name} is attached, so it cannot be restarted"
            )
        self._set_split(counts)
        self.emit(
            head.name, "split", f"live re-split unavailable ({reason}); restarting with --split {split_arg(counts)}"
        )
        await self.restart_worker(head.name)
        return "restart"

    def _set_split(self, counts: list[int]) -> None:
        self.profile.split = self.split = list(counts)
        self.split_changes += 1

    async def probe_split(self, tokens: int = 32, reps: int = 3) -> dict:
        """The split advisor's measurement: the head's PROBE (every stage times its own layers, the
        head times each hop and a whole step). Requests pause for its length."""
        if self.readonly:
            raise SupervisorError("read-only console: it runs no probe")
        head = self.head
        host = connect_host(head.spec.rpc_host or head.spec.host)
        try:
            reply = await control_client.probe(host, head.spec.rpc, tokens, reps, token=self.token)
        except control_client.ControlUnreachable as e:
            raise SupervisorError(f"probe: {e}") from None
        if not reply.ok:
            raise SupervisorError(f"probe refused ({reply.status_name}): {reply.meta.get('error', '')}")
        self.emit(head.name, "probe", f"split probe: one decode step {reply.meta.get('step_ms', 0):.1f} ms")
        return reply.meta

    async def shutdown(self, stop_workers: bool = True) -> None:
        """Stop polling and (by default) the workers this console started, head first; else detach:
        they keep running, and the state file lets the next console of this profile adopt them."""
        if self._poller is not None:
            self._poller.cancel()
            self._poller = None
        if stop_workers:
            for w in [self.head, *list(self.workers.values())[1:]]:
                if w.managed:
                    await self.stop_worker(w.name)
        else:
            self.detached = True
            self._save_state()
        for t in list(self._tasks):
            t.cancel()
        if self.detached:
            for w in self.workers.values():
                if w.proc is not None:
                    _release(w.proc)
        await self.source.aclose()

    def kill_all_sync(self, grace: float = 3.0) -> None:
        """Last resort when the event loop is gone: no started worker may outlive the console
        (unless the operator detached)."""
        if self.detached:
            return
        pids = [w.pid for w in self.workers.values() if w.managed and w.proc is not None and w.pid]
        for pid in pids:
            self._signal_group(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        alive = set(pids)
        while alive and time.monotonic() < deadline:
            for pid in list(alive):
                try:
                    if os.waitpid(pid, os.WNOHANG)[0] == pid:
                        alive.discard(pid)
                except ChildProcessError:  # adopted: another console's child
                    if not psutil.pid_exists(pid):
                        alive.discard(pid)
            time.sleep(0.05)
        for pid in alive:
            self._signal_group(pid, signal.SIGKILL)

    # ---- processes ---------------------------------------------------------------------------

    @staticmethod
    def _signal_group(pid: int | None, sig: int) -> None:
        if pid:
            try:
                os.killpg(pid, sig)  # pgid == pid: every worker leads its own session
            except (ProcessLookupError, PermissionError):
                pass

    def _task(self, coro) -> asyncio.Task:
        t = asyncio.create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    async def _spawn(self, w: Worker) -> None:
        if w.running:
            return
        argv = self.command_for(w.name)
        if not w.spec.is_local and not await self._send_token(w):
            self._after_exit(w, None)
            return
        out, writer = self._log_pipe(w)
        env = dict(os.environ, PYTHONUNBUFFERED="1", HYDRA_TOKEN=self.token, **{RUN_ID_ENV: self.run_id})
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                start_new_session=True,
                env=env,
            )
        except OSError as e:
            if writer is not None:
                os.close(out)
                await asyncio.to_thread(_reap, writer, WRITER_DRAIN_S)
            self.emit(w.name, "error", f"cannot start {argv[0]}: {e.strerror or e}")
            self._after_exit(w, None)
            return
        if writer is not None:
            os.close(out)  # the worker holds its own copy: the writer sees EOF once it exits
        self._track(w, proc, argv, self.run_id, self.clock())
        self._mark(w, f"started pid {proc.pid}: {shlex.join(argv)}")
        self.emit(w.name, "started", f"pid {proc.pid}" + ("" if w.spec.is_local else f" on {w.spec.host}"))
        w._watch = self._task(self._wait(w, proc, writer))

    def _log_pipe(self, w: Worker) -> tuple[int, subprocess.Popen | None]:
        """The worker's stdout and stderr: the write end of a pipe whose read end only its log writer
        holds (a process of its own session, so no stop of the worker's group cuts its last lines)."""
        if w.logfile is None:
            return asyncio.subprocess.DEVNULL, None
        try:
            w.logfile.follow_from_end()
            w.log_path.parent.mkdir(parents=True, exist_ok=True)
            r, wr = os.pipe()
        except OSError as e:
            self.emit(w.name, "error", f"no log file ({e.strerror or e}: {w.log_path}): its output is lost")
            return asyncio.subprocess.DEVNULL, None
        try:
            writer = subprocess.Popen(
                w.logfile.writer_argv(),
                stdin=r,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        except OSError as e:
            os.close(wr)
            self.emit(w.name, "error", f"no log writer ({e.strerror or e}): its output is lost")
            return asyncio.subprocess.DEVNULL, None
        finally:
            os.close(r)
        return wr, writer

    def _track(self, w: Worker, proc, argv: list[str], run_id: str, started_at: float) -> None:
        w.proc, w.pid, w.argv, w.run_id = proc, proc.pid, argv, run_id
        w.started_at, w.ready_at, w.probe, w.backoff_until, w.down_since = started_at, None, None, None, None
        w.state = State.CRASH_LOOP if w.failures >= self.settings.crash_loop_count else State.STARTING
        try:
            w._ps = psutil.Process(proc.pid) if w.spec.is_local else None
        except psutil.Error:
            w._ps = None
        self._save_state()

    def _run_file(self) -> tuple[dict, dict]:
        """The run file and its worker entries ({}, {} when there is none)."""
        try:
            doc = json.loads(self.state_path.read_text())
            return doc, dict(doc["workers"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return {}, {}

    def _owning_console(self) -> int | None:
        """Another live console that runs workers of this profile: its pid."""
        doc, entries = self._run_file()
        owner = doc.get("console_pid")
        if not isinstance(owner, int) or owner == os.getpid():
            return None
        try:  # that console itself, not a process that got its pid after it died
            started = psutil.Process(owner).create_time()
            if abs(started - float(doc.get("console_started", 0))) > START_TOLERANCE_S:
                return None
        except (psutil.Error, TypeError, ValueError):
            return None
        specs = {s.name: s for s in self.profile.workers if s.is_local}
        live = any(isinstance(e, dict) and n in specs and _ours(e, specs[n]) for n, e in entries.items())
        return owner if live else None

    def _adopt(self) -> None:
        """Take over this profile's workers that a previous console started and left running."""
        doc, entries = self._run_file()
        left_by = doc.get("left_by", doc.get("console_pid", "?"))
        for name, entry in entries.items():
            w = self.workers.get(name)
            if w is None or not w.managed or w.running or not w.spec.is_local:
                continue
            ps = _ours(entry, w.spec) if isinstance(entry, dict) else None
            if ps is None:
                continue
            w.wanted = True
            w.backoff.reset()
            self._track(w, _Adopted(ps), list(entry.get("argv") or ps.cmdline()), entry["run_id"], ps.create_time())
            if w.logfile is not None:
                self._use_logged_path(w, entry)
                w.logfile.follow_from_tail(self.settings.ring_lines)
            self._mark(w, f"adopted pid {ps.pid} by console pid {os.getpid()}")
            self.emit(
                w.name,
                "adopted",
                f"pid {ps.pid} (run {entry['run_id']}, left by console pid {left_by})",
            )
            w._watch = self._task(self._wait(w, w.proc, None))
        self._save_state()

    def _use_logged_path(self, w: Worker, entry) -> None:
        """The file the worker really writes (its console's --log-dir may differ from ours)."""
        path = entry.get("log") if isinstance(entry, dict) else None
        if isinstance(path, str) and Path(path) != w.log_path:
            w.logfile = LogFile(Path(path), self.settings.log_max_bytes, self.settings.log_backups)

    def _save_state(self) -> None:
        """The state file: which of this profile's workers run, so a later console can adopt them.
        A watching console writes none: the file is the running console's."""
        if self.attach_only:
            return
        entries = {
            w.name: {
                "pid": w.pid,
                "port": w.spec.port,
                "rpc": w.spec.rpc,
                "run_id": w.run_id,
                "argv": w.argv,
                "log": str(w.log_path) if w.log_path else None,
            }
            for w in self.workers.values()
            if w.managed and w.running and w.spec.is_local
        }
        try:
            if entries:
                atomic_write(
                    self.state_path,
                    json.dumps(
                        {
                            "profile": self.profile.name,
                            # Who runs them now: none once detached (its process may live on).
                            "console_pid": None if self.detached else os.getpid(),
                            "left_by": os.getpid(),
                            "console_started": _STARTED,
                            "workers": entries,
                        },
                        indent=1,
                    ),
                )
            else:
                self.state_path.unlink(missing_ok=True)
        except OSError as e:
            log.warning("state file %s: %s", self.state_path, e)

    def _mark(self, w: Worker, text: str) -> None:
        """A line of the console's own in the worker's log file (where an adopting console reads it too)."""
        text = f"{CONSOLE_MARK} {time.strftime('%Y-%m-%dT%H:%M:%S')} {text}"
        if w.logfile is None:
            self._log(w, text)
            return
        try:
            w.logfile.append(text)
        except OSError as e:
            log.warning("log file %s: %s", w.log_path, e)
        self._follow_log(w)

    def _follow_log(self, w: Worker) -> None:
        if w.logfile is not None and w._follow is None:
            w._follow = self._task(self._follow_loop(w))

    async def _follow_loop(self, w: Worker) -> None:
        while w.logfile is not None:
            self._read_log(w)
            await asyncio.sleep(FOLLOW_S)

    def _read_log(self, w: Worker) -> None:
        for text in w.logfile.read_new() if w.logfile else []:
            self._log(w, text)

    def _log(self, w: Worker, text: str) -> None:
        line = LogLine(next(self._seq), self.clock(), w.name, text)
        w.log.append(line)
        self.merged_log.append(line)
        if text.strip() and not text.startswith(CONSOLE_MARK):
            w.last_err = text.strip()

    async def _wait(self, w: Worker, proc: asyncio.subprocess.Process, writer: subprocess.Popen | None) -> None:
        code = await proc.wait()
        if writer is not None:  # its last lines reach the file (a grandchild may hold the pipe: not forever)
            await asyncio.to_thread(_reap, writer, WRITER_DRAIN_S)
        self._read_log(w)  # its last lines name the cause of a crash
        self._after_exit(w, code)

    def _after_exit(self, w: Worker, code: int | None) -> None:
        now = self.clock()
        ran = now - w.started_at if w.started_at is not None and w.proc is not None else 0.0
        w.proc, w._ps, w.cpu_pct, w.rss, w.argv = None, None, None, None, None
        w.last_exit = code
        self._save_state()
        if not w.wanted:
            w.state = State.STOPPED
            self.emit(w.name, "stopped", f"pid {w.pid} exited ({describe_exit(code)})")
            return
        if not self.auto_restart:
            w.state, w.wanted = State.CRASHED, False
            self.emit(w.name, "crashed", f"pid {w.pid} exited ({describe_exit(code)}) after {ran:.1f} s")
            return
        if ran >= self.settings.healthy_reset_s:
            w.backoff.reset()
            w.failures = 0
        w.failures += 1
        looping = w.failures >= self.settings.crash_loop_count
        delay = w.backoff.next()
        w.state, w.backoff_until = (State.CRASH_LOOP if looping else State.BACKOFF), now + delay
        self.emit(
            w.name, "crashed", f"pid {w.pid} exited ({describe_exit(code)}) after {ran:.1f} s; restart in {delay:g} s"
        )
        if looping:
            self.emit(
                w.name,
                "crash-loop",
                f"{w.failures} exits in a row, none after a healthy run ({self.settings.healthy_reset_s:g} s); "
                f"last line: {w.last_err or '(none)'}",
            )
        w._restart = self._task(self._restart_later(w, delay))

    async def _restart_later(self, w: Worker, delay: float) -> None:
        await asyncio.sleep(delay)
        async with w.lock:
            w._restart = None
            if w.wanted and not w.running:
                w.restarts += 1
                w.crash_restarts += 1
                await self._spawn(w)
                self.emit(w.name, "restarted", f"after {delay:g} s backoff (restart {w.restarts})")

    # ---- polling -----------------------------------------------------------------------------

    async def _poll_loop(self) -> None:
        while True:
            t0 = time.monotonic()
            await self.poll_once()
            await asyncio.sleep(max(0.05, self.settings.poll_s - (time.monotonic() - t0)))

    async def poll_once(self) -> None:
        split_changes = self.split_changes
        targets = [w for w in self.workers.values() if not w.managed or w.running]
        probes = await asyncio.gather(*(self.source.probe(w.spec) for w in targets), return_exceptions=True)
        for w, p in zip(targets, probes):
            if isinstance(p, BaseException):
                p = Probe(False, error=f"{type(p).__name__}: {p}")
            self._apply_probe(w, p, split_changes)
        self._note_split()

    def _apply_probe(self, w: Worker, p: Probe, split_changes: int) -> None:
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
            ts = self.clock()
            w.history.append((ts, p.status))
            w.prefill_hist.append(p.status.throughput.prefill_tok_s)
            w.decode_hist.append(p.status.throughput.decode_tok_s)
            for fn in list(self._status_listeners):
                try:
                    fn(w.name, ts, p.status)
                except Exception:  # an observer's bug must not stop supervision
                    log.exception("status listener failed on %s", w.name)
        if w._ps is not None:
            try:
                w.cpu_pct = w._ps.cpu_percent(None)
                w.rss = w._ps.memory_info().rss
            except psutil.Error:
                w._ps = None
        pid = p.status.pid if p.status else None
        if not w.managed and pid:
            if w.seen_pid and pid != w.seen_pid:
                self.emit(w.name, "restarted", f"pid {w.seen_pid} → {pid} (restarted outside this console)")
            w.seen_pid = pid
        hs = p.health_state
        if hs is None:
            # Started and once up, now silent: degraded (the process lives); never answered yet: starting.
            up_before = w.state in (State.READY, State.DEGRADED)
            new = (State.DEGRADED if up_before else State.STARTING) if w.managed else State.UNREACHABLE
        else:
            new = {"ok": State.READY, "degraded": State.DEGRADED}.get(hs, State.STARTING)
        if new == State.STARTING and w.state == State.CRASH_LOOP:
            return  # still looping until it is ready once
        if new == w.state:
            return
        old, w.state, now = w.state, new, self.clock()
        if new == State.READY:
            w.ready_at = now
            if w.down_since is not None:
                self.emit(w.name, "ready", f"ready again after {now - w.down_since:.1f} s {old.value}")
            elif w.managed and w.started_at:
                self.emit(w.name, "ready", f"ready {now - w.started_at:.1f} s after its start")
            else:
                self.emit(w.name, "ready", "ready")
            w.down_since = None
            return
        if w.down_since is None and new in (State.DEGRADED, State.UNREACHABLE):
            w.down_since = now
        if new == State.DEGRADED:
            self.emit(w.name, "degraded", f"not answering: {p.error}" if hs is None else "health reports degraded")
        elif new == State.UNREACHABLE:
            self.emit(w.name, "unreachable", p.error or "no answer")

    def _note_split(self) -> None:
        """Follow the split the head runs, whoever applied it: a restart of the head relaunches it."""
        ranges = self.stage_ranges()
        if ranges is None or self.head.probe_split_changes != self.split_changes:
            return
        key = tuple(r for _, r in ranges)
        if len(key) == len(self.workers):
            self.split = counts_of(list(key))
        if self._last_ranges is not None and key != self._last_ranges:
            by = self.head.status.split_by
            self.emit(
                self.head.name,
                "split",
                "layers now " + " · ".join(f"[{a},{b})" for a, b in key) + (f" (applied by {by})" if by else ""),
            )
        self._last_ranges = key
