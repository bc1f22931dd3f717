"""A started worker as a local process: it leads its own session/process group, so a signal to the
group reaches everything it spawned; its stdout and stderr are a pipe to its log writer
(`worker_log.py`), a process of its own session, never a pipe of the console."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time

import psutil

from .worker_log import LogFile

WRITER_DRAIN_S = 2.0  # a dead worker's log writer gets this long to write its last lines


def signal_group(pid: int | None, sig: int) -> None:
    if pid:
        try:
            os.killpg(pid, sig)  # pgid == pid: every worker leads its own session
        except (ProcessLookupError, PermissionError):
            pass


def log_pipe(logfile: LogFile | None) -> tuple[int, subprocess.Popen | None, str | None]:
    """The worker's stdout and stderr: the write end of a pipe whose read end only its log writer
    holds (a process of its own session, so no stop of the worker's group cuts its last lines).
    Also what went wrong, when its output is lost."""
    if logfile is None:
        return asyncio.subprocess.DEVNULL, None, None
    try:
        logfile.follow_from_end()
        logfile.path.parent.mkdir(parents=True, exist_ok=True)
        r, wr = os.pipe()
    except OSError as e:
        return asyncio.subprocess.DEVNULL, None, f"no log file ({e.strerror or e}: {logfile.path}): its output is lost"
    try:
        writer = subprocess.Popen(
            logfile.writer_argv(),
            stdin=r,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
    except OSError as e:
        os.close(wr)
        return asyncio.subprocess.DEVNULL, None, f"no log writer ({e.strerror or e}): its output is lost"
    finally:
        os.close(r)
    return wr, writer, None


async def start_process(argv: list[str], out: int, env: dict[str, str]) -> asyncio.subprocess.Process:
    """The worker's process, leading its own session, its stdout and stderr on `out`."""
    return await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=out,
        stderr=out,
        start_new_session=True,
        env=env,
    )


def reap(writer: subprocess.Popen, timeout: float) -> None:
    try:
        writer.wait(timeout)
    except subprocess.TimeoutExpired:
        pass


def release(proc) -> None:
    """Detach from a started child: keep asyncio's transport from killing it, as close() and
    collection would (CPython's transport). It writes its own log file, so nothing else ties it to us."""
    transport = getattr(proc, "_transport", None)
    if transport is not None:
        transport._closed = True


def kill_groups_sync(pids: list[int], grace: float) -> None:
    """SIGTERM to each group, SIGKILL to those still there after `grace`, without an event loop."""
    for pid in pids:
        signal_group(pid, signal.SIGTERM)
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
        signal_group(pid, signal.SIGKILL)
