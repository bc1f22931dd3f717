"""Takeover: the per-profile run file and adopting the workers a previous console left running.

Every started worker carries HYDRA_RUN_ID in its environment, and a per-profile run file (state
dir, written atomically) lists pids, ports, run ids, log files and the console that runs them. A
console that starts finds the workers of its profile that still run with those run ids and adopts
them (watch, stop, restart) instead of starting duplicates; while the console named in the file
lives, it watches them read-only instead (`owning_console`). A detached console names none.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from pathlib import Path
from typing import Iterable

import psutil

from .config import Profile, WorkerSpec, atomic_write
from .launch import RUN_ID_ENV
from .records import Worker

log = logging.getLogger("hydra.console.supervisor")
CONSOLE_STARTED = psutil.Process().create_time()  # with the pid, names this console in the run file
START_TOLERANCE_S = 1.5  # start times read by two processes: each derives the boot time from a clock NTP moves


class Adopted:
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


def live_worker(entry: dict, spec: WorkerSpec) -> psutil.Process | None:
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


def read_run_file(path: Path) -> tuple[dict, dict]:
    """The run file and its worker entries ({}, {} when there is none)."""
    try:
        doc = json.loads(path.read_text())
        return doc, dict(doc["workers"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}, {}


def owning_console(path: Path, profile: Profile) -> int | None:
    """Another live console that runs workers of this profile: its pid."""
    doc, entries = read_run_file(path)
    owner = doc.get("console_pid")
    if not isinstance(owner, int) or owner == os.getpid():
        return None
    try:  # that console itself, not a process that got its pid after it died
        started = psutil.Process(owner).create_time()
        if abs(started - float(doc.get("console_started", 0))) > START_TOLERANCE_S:
            return None
    except (psutil.Error, TypeError, ValueError):
        return None
    specs = {s.name: s for s in profile.workers if s.is_local}
    live = any(isinstance(e, dict) and n in specs and live_worker(e, specs[n]) for n, e in entries.items())
    return owner if live else None


def adoptable(path: Path, workers: dict[str, Worker]) -> tuple[object, list[tuple[Worker, dict, psutil.Process]]]:
    """Who left the run file, and its workers this console manages that still run and are not tracked yet."""
    doc, entries = read_run_file(path)
    left_by = doc.get("left_by", doc.get("console_pid", "?"))
    found = []
    for name, entry in entries.items():
        w = workers.get(name)
        if w is None or not w.managed or w.running or not w.spec.is_local:
            continue
        ps = live_worker(entry, w.spec) if isinstance(entry, dict) else None
        if ps is not None:
            found.append((w, entry, ps))
    return left_by, found


def logged_path(entry) -> Path | None:
    """The log file a run-file entry names (its console's --log-dir may differ from ours)."""
    path = entry.get("log") if isinstance(entry, dict) else None
    return Path(path) if isinstance(path, str) else None


def write_run_file(path: Path, profile: str, workers: Iterable[Worker], detached: bool) -> None:
    """Which of this profile's workers run, so a later console can adopt them (none: no file)."""
    entries = {
        w.name: {
            "pid": w.pid,
            "port": w.spec.port,
            "rpc": w.spec.rpc,
            "run_id": w.run_id,
            "argv": w.argv,
            "log": str(w.log_path) if w.log_path else None,
        }
        for w in workers
        if w.managed and w.running and w.spec.is_local
    }
    try:
        if entries:
            atomic_write(
                path,
                json.dumps(
                    {
                        "profile": profile,
                        # Who runs them now: none once detached (its process may live on).
                        "console_pid": None if detached else os.getpid(),
                        "left_by": os.getpid(),
                        "console_started": CONSOLE_STARTED,
                        "workers": entries,
                    },
                    indent=1,
                ),
            )
        else:
            path.unlink(missing_ok=True)
    except OSError as e:
        log.warning("state file %s: %s", path, e)
