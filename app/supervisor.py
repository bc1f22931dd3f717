"""Process supervision of the head and peer workers (asyncio; no Textual import): the coordinator.

Each started worker leads its own process group: a stop is SIGTERM to the group, a grace period
(40 s by default: past the head's drain), then SIGKILL. A worker that exits while it is wanted restarts after a backoff
of 1 s doubling to 30 s (from 1 s again after `healthy_reset_s` of health). It writes its output
into its own log file through its log writer, never into pipes of the console, so it outlives the
console; every console follows the files. Every `poll_s` each worker's /health and /status are
probed through a `StatusSource`. Its parts: `launch.py` (argv, environment, ssh, busy ports),
`tokens.py`, `processes.py`, `takeover.py` (the run file, adoption, the owning console),
`split_commands.py` (apply a split, probe it, refuse a misfit, follow the head's),
`split_control.py` (CONFIGURE, PROBE), `worker_states.py`, `log_follow.py`, `records.py`,
`observers.py`.

Observers (the UI) read `workers`, `events`, `merged_log` and call the async commands; they get
each new `Event` through `subscribe` and each polled /status through `subscribe_status`.

Truth over intent: a worker's record holds the argv it was really started with, and a (re)start
launches `Supervisor.split`, the split the head last reported in /status (or the one the operator
applied), never a draft saved to the profile. A second console of a live console's profile watches
read-only (`owner`); `shutdown(stop_workers=False)` detaches, leaving the workers to the next one.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shlex
import signal
import socket
import subprocess
import time
import uuid
from collections import deque
from pathlib import Path
from typing import Callable

from ..contracts.status import Status
from .config import Profile, state_dir
from .launch import busy_ports, port_owner, send_token, worker_argv, worker_env
from .log_follow import LogFollower
from .observers import Observers
from .processes import WRITER_DRAIN_S, kill_groups_sync, log_pipe, reap, release, signal_group, start_process
from .records import Event, LogLine, State, SupervisorError, Worker, new_worker
from .sources import HttpStatusSource, Probe, StatusSource
from .split_commands import SplitCommands
from .split_fit import CardPlans
from .takeover import Adopted, adoptable, logged_path, owning_console, read_run_file, write_run_file
from .tokens import profile_token
from .worker_log import LogFile
from .worker_states import apply_probe, exited, started

log = logging.getLogger("hydra.console.supervisor")


class Supervisor(SplitCommands):
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
        self.owner = None if attach or readonly else owning_console(self.state_path, profile)
        self.readonly = readonly or self.owner is not None
        self.attach_only = attach or self.readonly  # read-only: starts, stops and applies nothing
        self.split = list(profile.split) if profile.split else None  # what a (re)start of the head launches
        self.plans = CardPlans(profile)  # each split against the workers' cards (split_fit.py)
        self.run_id = uuid.uuid4().hex[:12]
        self.identity = f"hydra-console pid {os.getpid()} on {socket.gethostname()}"
        self.token = token or profile_token(self.state_path.with_suffix(".token"))
        self.detached = False
        self.log_dir = Path(log_dir or self.settings.log_dir or state_dir() / "logs")
        self.events: deque[Event] = deque(maxlen=1000)
        self._logs = LogFollower(clock, self.settings.ring_lines * 2, self._task)
        self.merged_log: deque[LogLine] = self._logs.merged
        self.workers: dict[str, Worker] = {}
        for i, spec in enumerate(profile.workers):
            path = self.log_dir / f"{profile.name}-{spec.name}.log"
            role = "head" if i == 0 else "peer"
            self.workers[spec.name] = new_worker(spec, role, not (self.attach_only or spec.attach), path, self.settings)
        self._observers = Observers()
        self._tasks: set[asyncio.Task] = set()
        self._poller: asyncio.Task | None = None
        self._last_ranges: tuple | None = None
        # Times this console set the split: the head's ranges from a poll sent before the last
        # change are the old process's (or the old CONFIGURE's), and must not undo it.
        self.split_changes = 0

    # ---- observation -------------------------------------------------------------------------

    def subscribe(self, fn: Callable[[Event], None]) -> Callable[[], None]:
        return self._observers.on_event(fn)

    def subscribe_status(self, fn: Callable[[str, float, Status], None]) -> Callable[[], None]:
        """`fn(worker, time, status)` for every /status polled (what the incident log compares)."""
        return self._observers.on_status(fn)

    def emit(self, worker: str, kind: str, message: str) -> Event:
        ev = Event(self.clock(), worker, kind, message)
        self.events.append(ev)
        self._observers.event(ev)
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

    # ---- commands ----------------------------------------------------------------------------

    def command_for(self, name: str) -> list[str]:
        """argv that starts worker `name` (through its ssh launcher when remote)."""
        w = self.worker(name)
        return worker_argv(self.profile, w.spec, w.role, self.split)

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
        _, entries = read_run_file(self.state_path)
        for w in self.workers.values():
            if not w.managed and w.logfile is not None:  # another console's (or a hand-started) worker
                self._use_logged_path(w, entries.get(w.name))
                w.logfile.follow_from_tail(self.settings.ring_lines)
                self._logs.follow(w)
        starting = [w for w in [*list(self.workers.values())[1:], self.head] if w.managed and not w.running]
        if starting:
            await self.refuse_misfit(self.split)
        for w in starting:
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
            busy = busy_ports(w.spec)
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

    async def _start_when_free(self, w: Worker) -> None:
        while busy_ports(w.spec):
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
        signal_group(pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.shield(watch), grace)
        except asyncio.TimeoutError:
            self.emit(w.name, "killed", f"pid {pid} still running {grace:g} s after SIGTERM: SIGKILL")
            signal_group(pid, signal.SIGKILL)
            await watch

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
                    release(w.proc)
        await self.source.aclose()

    def kill_all_sync(self, grace: float = 3.0) -> None:
        """Last resort when the event loop is gone: no started worker may outlive the console
        (unless the operator detached)."""
        if self.detached:
            return
        pids = [w.pid for w in self.workers.values() if w.managed and w.proc is not None and w.pid]
        kill_groups_sync(pids, grace)

    # ---- processes ---------------------------------------------------------------------------

    def _task(self, coro) -> asyncio.Task:
        t = asyncio.create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    async def _spawn(self, w: Worker) -> None:
        if w.running:
            return
        argv = self.command_for(w.name)
        if not w.spec.is_local:  # its token, in its 0600 file on its host first
            err = await send_token(w.spec, self.token, self.settings.grace_s + 20)
            if err is not None:
                self.emit(w.name, "error", err)
                self._after_exit(w, None)
                return
        out, writer, lost = log_pipe(w.logfile)
        if lost:
            self.emit(w.name, "error", lost)
        env = worker_env(self.token, self.run_id)
        try:
            proc = await start_process(argv, out, env)
        except OSError as e:
            if writer is not None:
                os.close(out)
                await asyncio.to_thread(reap, writer, WRITER_DRAIN_S)
            self.emit(w.name, "error", f"cannot start {argv[0]}: {e.strerror or e}")
            self._after_exit(w, None)
            return
        if writer is not None:
            os.close(out)  # the worker holds its own copy: the writer sees EOF once it exits
        self._track(w, proc, argv, self.run_id, self.clock())
        self._logs.mark(w, f"started pid {proc.pid}: {shlex.join(argv)}")
        self.emit(w.name, "started", f"pid {proc.pid}" + ("" if w.spec.is_local else f" on {w.spec.host}"))
        w._watch = self._task(self._wait(w, proc, writer))

    def _track(self, w: Worker, proc, argv: list[str], run_id: str, started_at: float) -> None:
        started(w, proc, argv, run_id, started_at, self.settings.crash_loop_count)
        self._save_state()

    def _adopt(self) -> None:
        """Take over this profile's workers that a previous console started and left running."""
        left_by, found = adoptable(self.state_path, self.workers)
        for w, entry, ps in found:
            w.wanted = True
            w.backoff.reset()
            self._track(w, Adopted(ps), list(entry.get("argv") or ps.cmdline()), entry["run_id"], ps.create_time())
            if w.logfile is not None:
                self._use_logged_path(w, entry)
                w.logfile.follow_from_tail(self.settings.ring_lines)
            self._logs.mark(w, f"adopted pid {ps.pid} by console pid {os.getpid()}")
            self.emit(w.name, "adopted", f"pid {ps.pid} (run {entry['run_id']}, left by console pid {left_by})")
            w._watch = self._task(self._wait(w, w.proc, None))
        self._save_state()

    def _use_logged_path(self, w: Worker, entry) -> None:
        """The file the worker really writes (its console's --log-dir may differ from ours)."""
        path = logged_path(entry)
        if path is not None and path != w.log_path:
            w.logfile = LogFile(path, self.settings.log_max_bytes, self.settings.log_backups)

    def _save_state(self) -> None:
        """The state file: which of this profile's workers run, so a later console can adopt them.
        A watching console writes none: the file is the running console's."""
        if not self.attach_only:
            write_run_file(self.state_path, self.profile.name, self.workers.values(), self.detached)

    async def _wait(self, w: Worker, proc: asyncio.subprocess.Process, writer: subprocess.Popen | None) -> None:
        code = await proc.wait()
        if writer is not None:  # its last lines reach the file (a grandchild may hold the pipe: not forever)
            await asyncio.to_thread(reap, writer, WRITER_DRAIN_S)
        self._logs.read(w)  # its last lines name the cause of a crash
        self._after_exit(w, code)

    def _after_exit(self, w: Worker, code: int | None) -> None:
        now = self.clock()
        ran = now - w.started_at if w.started_at is not None and w.proc is not None else 0.0
        w.proc, w._ps, w.cpu_pct, w.rss, w.argv = None, None, None, None, None
        w.last_exit = code
        self._save_state()
        delay = exited(w, code, ran, now, self.settings, self.auto_restart, self.emit)
        if delay is not None:
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
            apply_probe(w, p, split_changes, self.clock, self.emit, self._observers.status)
        self._note_split()
