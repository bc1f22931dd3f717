"""Test support (not a test module): worker processes forked from one that has already imported torch
and the engine. A tiny worker's start took ~2.3 s of CPU, nearly all of it `import torch` and the
engine's modules, paid again by each worker of the suite; forked it takes ~0.3 s, and the imports
are paid once per test process.

The child is a real worker: its own process in its own session, running `hydra-engine`'s own
`main` with the environment it is given, stdout and stderr to its log, exiting through the
interpreter's shutdown (atexit, threads joined) as `python -m hydra_console.engine.cli` does. It
differs in its command line (the zygote's) and in what was imported before its environment was set:
`OMP_NUM_THREADS=1` (as every test worker runs) and the test process's own variables.

The zygote stays single-threaded (a fork copies only the forking thread): one select loop reads spawn
requests on stdin, forks, and reaps its children through pidfds, answering `pid N` and `exit N CODE`
lines on stdout. Not on a CUDA host: its driver must not be touched before a fork (`rpc_workers`
execs there), and none of this is needed there."""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path


def _serve() -> None:
    """The zygote's loop (this file run as a script). A child returns from here into `_child`."""
    import torch  # noqa: F401  what the fork saves: imported once

    import hydra_console.engine.cli  # noqa: F401
    import hydra_console.engine.workers.head  # noqa: F401
    import hydra_console.engine.workers.peer  # noqa: F401

    children: dict[int, int] = {}  # pidfd -> pid
    buf = b""
    os.write(1, b"ready\n")
    while True:
        readable, _, _ = select.select([0, *children], [], [])
        for fd in readable:
            if fd in children:
                pid = children.pop(fd)
                os.close(fd)
                _, status = os.waitpid(pid, 0)
                os.write(1, f"exit {pid} {os.waitstatus_to_exitcode(status)}\n".encode())
                continue
            data = os.read(0, 1 << 16)
            if not data:  # the test process is gone
                return
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                request = json.loads(line)
                # opened before the fork, so they exist once the pid is answered (a test may read them at once)
                out, err = (
                    os.open(request.pop(k), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) for k in ("out", "err")
                )
                pid = os.fork()
                if pid == 0:
                    for child_fd in children:
                        os.close(child_fd)
                    _child(out=out, err=err, **request)  # never returns
                os.close(out)
                os.close(err)
                children[os.pidfd_open(pid)] = pid
                os.write(1, f"pid {pid}\n".encode())


def _child(argv: list[str], env: dict[str, str], out: int, err: int, cwd: str) -> None:
    import torch

    os.setsid()
    os.chdir(cwd)
    null = os.open(os.devnull, os.O_RDONLY)
    for fd, to in ((null, 0), (out, 1), (err, 2)):
        os.dup2(fd, to)
    for fd in {null, out, err}:
        os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    # The zygote imported torch with one OpenMP thread; a fresh process would take its environment's number.
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS") or len(os.sched_getaffinity(0))))
    from hydra_console.engine import cli

    sys.argv, sys.path[0] = [cli.__file__, *argv], cwd  # as `python -m hydra_console.engine.cli` sets them
    sys.exit(cli.main(argv))  # the interpreter's own exit from here: atexit, threads joined, streams flushed


class ForkedProcess:
    """The parts of `subprocess.Popen` the tests use, for a child of the zygote."""

    def __init__(self, pid: int, zygote: Zygote):
        self.pid, self._zygote, self.returncode = pid, zygote, None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.exit_code(self.pid, 0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._zygote.exit_code(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout)
        return self.returncode


class Zygote:
    """One per test process, started at its first worker."""

    def __init__(self):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, bufsize=0
        )
        assert self.proc.stdout.readline() == b"ready\n", "the worker zygote did not start"
        self._spawn_lock = threading.Lock()
        self._changed = threading.Condition()
        self._pids: list[int] = []
        self._exits: dict[int, int] = {}
        threading.Thread(target=self._read, daemon=True, name="zygote-reader").start()
        atexit.register(self.close)

    def close(self) -> None:
        """Its stdin closed, the zygote returns (its children are stopped by their tests)."""
        self.proc.stdin.close()
        self.proc.wait(timeout=30)

    def _read(self) -> None:
        for line in self.proc.stdout:
            kind, *values = line.split()
            with self._changed:
                if kind == b"pid":
                    self._pids.append(int(values[0]))
                else:
                    self._exits[int(values[0])] = int(values[1])
                self._changed.notify_all()

    def spawn(self, argv: list[str], env: dict[str, str], out: Path, err: Path | None = None) -> ForkedProcess:
        """`hydra-engine ARGV` forked, stdout to `out` and stderr to `err` (else `out` too), appended."""
        request = {"argv": argv, "env": env, "out": str(out), "err": str(err or out), "cwd": os.getcwd()}
        with self._spawn_lock:
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            with self._changed:
                if not self._changed.wait_for(lambda: self._pids, timeout=60):
                    raise AssertionError("the worker zygote did not fork")
                return ForkedProcess(self._pids.pop(0), self)

    def exit_code(self, pid: int, timeout: float | None) -> int | None:
        with self._changed:
            self._changed.wait_for(lambda: pid in self._exits, timeout=timeout)
            return self._exits.get(pid)


def run(argv: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """As `subprocess.run([python, -m, hydra_console.engine.cli, *argv], capture_output=True, text=True)`."""
    with tempfile.TemporaryDirectory() as folder:
        out, err = Path(folder) / "out", Path(folder) / "err"
        proc = zygote().spawn(argv, env, out, err)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        return subprocess.CompletedProcess(argv, proc.returncode, out.read_text(), err.read_text())


_zygote: Zygote | None = None
_zygote_lock = threading.Lock()


def zygote() -> Zygote:
    global _zygote
    with _zygote_lock:
        if _zygote is None or _zygote.proc.poll() is not None:
            _zygote = Zygote()
        return _zygote


if __name__ == "__main__":
    _serve()
