"""Test support (not a test module): free ports and real `hydra-engine serve` / `peer` processes
on loopback. Every test that needs a port or a worker process takes it from here."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import torch
import zygote

# Workers and CLI runs are forked from a process with torch imported (zygote.py), except on a CUDA
# host: its driver must not be touched before a fork.
FORKED = not torch.cuda.is_available()

# Ports handed out lie below Linux's ephemeral range (32768-60999), where every outgoing connection
# (a test's HTTP client, a head's RPC link) takes its local port: a port picked there by binding to
# 0 could be a client's by the time the worker binds it ("Address already in use", seen under load).
# Each xdist worker walks its own block from a random start, so parallel test files do not meet.
PORT_BASE, PORT_SPAN = 20000, 12000

# One client for the tests' requests (thread-safe): `httpx.get` builds a client, and with it an SSL
# context (~25 ms of CPU), per call, so a readiness poll every 50 ms spent a third of a core on that
# alone while the worker it waited for started, and a sweep of 671 bodies 17 s. No keep-alive, as
# `httpx.get`: each request its own connection, and a worker started again on the same port never
# meets a connection to its predecessor.
HTTP = httpx.Client(limits=httpx.Limits(max_connections=None, max_keepalive_connections=0))


def _port_walk():
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    count = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    size = PORT_SPAN // count
    first = PORT_BASE + (int(worker) % count if worker.isdigit() else 0) * size
    offset = random.randrange(size)
    while True:
        for i in range(size - 1):  # port + 1 stays inside the block
            yield first + (offset + i) % (size - 1)


_ports = _port_walk()


def _bindable(port: int) -> socket.socket | None:
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", port))
        return s
    except OSError:
        s.close()
        return None


def free_ports(n: int, *, pairs: bool = False) -> list[int]:
    """`n` distinct loopback ports that were free a moment ago and are not handed out again soon by
    this process; with `pairs`, port + 1 was free too (a worker's HTTP port and its default RPC port)."""
    held: list[socket.socket] = []
    out: list[int] = []
    try:
        for _ in range(200 * n):
            if len(out) == n:
                return out
            port = next(_ports)
            socks = [_bindable(p) for p in ((port, port + 1) if pairs else (port,))]
            held += [x for x in socks if x is not None]
            if all(socks):
                out.append(port)
                if pairs:
                    next(_ports)  # port + 1 is taken
        raise RuntimeError(f"no {n} free port{' pair' if pairs else ''}s on 127.0.0.1")
    finally:
        for s in held:
            s.close()


class Worker:
    """One worker process in its own session; its output goes to a log file shown on failure.
    `host` is where it is reached (it must bind there: pass `--host`/`--rpc-host` in argv);
    `launcher` prefixes the command, e.g. `ip netns exec NAME`."""

    def __init__(
        self,
        role: str,
        argv: list[str],
        log_dir: Path,
        port: int,
        rpc_port: int,
        *,
        host: str = "127.0.0.1",
        launcher: tuple[str, ...] = (),
    ):
        self.role, self.argv, self.port, self.rpc_port = role, argv, port, rpc_port
        self.host, self.launcher = host, tuple(launcher)
        self.log_path = log_dir / f"{role}-{port}.log"
        self.proc: subprocess.Popen | zygote.ForkedProcess | None = None
        self.start()

    def start(self) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        args = [self.role, *self.argv, "--port", str(self.port), "--rpc-port", str(self.rpc_port)]
        if not self.launcher and FORKED:
            self.proc = zygote.zygote().spawn(args, env, self.log_path)
            return
        cmd = [*self.launcher, sys.executable, "-m", "hydra_console.engine.cli", *args]
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        log.close()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def rpc_addr(self) -> str:
        return f"{self.host}:{self.rpc_port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def wait_ready(self, timeout: float = 90.0, seen: list | None = None) -> dict:
        """Poll /health until 200; every (status, body) on the way goes into `seen`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.role} exited with {self.proc.returncode}:\n{self.log()}")
            try:
                r = HTTP.get(f"{self.url}/health", timeout=2.0)
                if seen is not None:
                    seen.append((r.status_code, r.json()))
                if r.status_code == 200:
                    return r.json()
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise AssertionError(f"{self.role} on {self.port} not ready after {timeout} s:\n{self.log()}")

    def status(self) -> dict:
        return HTTP.get(f"{self.url}/status", timeout=10.0).json()

    def kill9(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)


def engine_cli(*argv: str, timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python -m hydra_console.engine.cli ARGV` to its end (text stdout and stderr captured), forked as
    workers are (zygote.py) where they are."""
    env = dict(os.environ if env is None else env)
    if not FORKED:
        cmd = [sys.executable, "-m", "hydra_console.engine.cli", *argv]
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    return zygote.run(list(argv), env, timeout)


def peer(model: Path, log_dir: Path, *extra: str, device: str = "cpu") -> Worker:
    port, rpc = free_ports(2)
    return Worker("peer", ["--model", str(model), "--device", device, *extra], log_dir, port, rpc)


def head(
    model: Path,
    log_dir: Path,
    peers: list[Worker] = (),
    *extra: str,
    parallel: int = 2,
    ctx: int = 256,
    device: str = "cpu",
) -> Worker:
    port, rpc = free_ports(2)
    argv = ["--model", str(model), "--device", device, "--parallel", str(parallel), "--ctx", str(ctx), *extra]
    for p in peers:
        argv += ["--peer", p.rpc_addr]
    return Worker("serve", argv, log_dir, port, rpc)


@contextlib.contextmanager
def running(worker: Worker, timeout: float = 90.0):
    """`worker`, ready; stopped on the way out."""
    try:
        worker.wait_ready(timeout)
        yield worker
    finally:
        worker.stop()


# MTP drafting every step, p-min 0, adaptive drafting off: tests of the MTP path, not of the policy
# (which may choose plain decode on a loaded machine: tests/test_adaptive_draft.py tests it).
MTP_EVERY_STEP = ("--spec-type", "mtp", "--draft-p-min", "0", "--draft-adaptive", "off")


@contextlib.contextmanager
def solo_and_split(model, logs, *split_flags: str):
    """Real processes in float32: a solo head, and a head (`split_flags`) with one peer; all ready,
    all stopped on the way out. Yields {"solo", "peer", "head"}."""
    f32 = ("--dtype", "float32")
    solo, p = head(model, logs, (), *f32), peer(model, logs, *f32)
    split = head(model, logs, [p], *split_flags, *f32)
    try:
        for w in (solo, p, split):
            w.wait_ready()
        yield {"solo": solo, "peer": p, "head": split}
    finally:
        for w in (solo, p, split):
            w.stop()


def complete(w: Worker, prompt: str, max_tokens: int = 16, timeout: float = 60.0, **kw) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **kw}
    return HTTP.post(f"{w.url}/v1/completions", json=body, timeout=timeout)


def greedy(w: Worker, prompt: str, n: int = 12) -> tuple[str, list[float]]:
    """Greedy completion text and token logprobs (equal across solo and split, bit for bit). The
    prompt cache stays out of it: a reused prefix changes the batch shapes, and so the last bits."""
    r = complete(w, prompt, n, logprobs=1, cache_prompt=False)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["text"], choice["logprobs"]["token_logprobs"]


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def assert_peer_kill_fails_request_fast(head: Worker, victim: Worker, max_tokens: int, timeout: float) -> None:
    """kill -9 `victim` while `head` decodes a long completion: the request must end with a 503 in
    OpenAI's shape naming the peer, as soon as its connection closes, never hang."""
    result = {}

    def run():
        result["r"] = complete(head, "a long answer", max_tokens, timeout=60)
        result["t"] = time.monotonic()

    t = threading.Thread(target=run)
    t.start()
    wait_for(lambda: any((s["n_decoded"] or 0) > 3 for s in head.status()["slots"]), timeout, "decoding to start")
    killed_at = time.monotonic()  # before the kill: kill9() also waits for the exit
    victim.kill9()
    t.join(timeout=timeout)
    assert not t.is_alive(), "the request hung after the peer died"
    r = result["r"]
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert victim.rpc_addr in err["message"] and err["code"] == "unavailable"
    print(f"503 arrived {result['t'] - killed_at:.3f} s after kill -9: {err['message']}")
    # Noticed by the connection closing (at once), not by the pending-reply watch (WATCH_S +
    # PROBE_ANSWER_S later): the cause, not a stopwatch, so a loaded machine cannot fail it.
    assert "failed mid-request" in err["message"] and "stopped answering" not in err["message"], err["message"]
