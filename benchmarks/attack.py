"""The long versions of tests/test_attacks.py (issue 13), on a head + one peer split, both with a token.

    python benchmarks/attack.py [--model PATH] [--duration 120] [--sockets 1000]

1. quiet baseline: completion latency and the control port's INFO latency;
2. idle sockets: `--sockets` silent connections on each RPC port (re-opened as the workers' deadlines
   close them) for `--duration` s while split completions run; peak RSS and threads of both
   workers, completion latency against the baseline, INFO and /health latency;
3. pre-auth memory probe: frames announcing 512 MiB before AUTH on both ports, RSS before and after;
Prints numbers; asserts nothing. The HTTP flood against the request queue is
benchmarks/attack_http.py.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import selectors
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil
from ready import wait_ready

from hydra_console.app.control_client import request_sync
from hydra_console.contracts.rpc import CONTROL_MAGIC, Cmd, Op
from hydra_console.engine.rpc import wire
from hydra_console.engine.rpc.compute import pack_hello
from hydra_console.engine.rpc.wire import SocketReader
from hydra_console.engine.synth import write_synthetic

TOKEN = "attack-bench-token"
PROMPT = "The history of the city begins"
MiB = 1 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Worker:
    def __init__(self, role: str, model: Path, log: Path, *extra: str):
        self.port, self.rpc = free_port(), free_port()
        cmd = [
            sys.executable,
            "-m",
            "hydra_console.engine.cli",
            role,
            "--model",
            str(model),
            "--device",
            "cpu",
            "--port",
            str(self.port),
            "--rpc-port",
            str(self.rpc),
            *extra,
        ]
        env = {**os.environ, "HYDRA_TOKEN": TOKEN, "OMP_NUM_THREADS": "1"}
        with open(log, "wb") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
        self.ps = psutil.Process(self.proc.pid)
        self.peak_rss = self.peak_threads = 0

    def wait_ready(self) -> None:
        wait_ready(self.port, f"worker on {self.port}", 180)

    def sample(self) -> tuple[int, int]:
        rss, threads = self.ps.memory_info().rss, self.ps.num_threads()
        self.peak_rss, self.peak_threads = max(self.peak_rss, rss), max(self.peak_threads, threads)
        return rss, threads

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=15)


def completion_s(head: Worker, n: int) -> float:
    t0 = time.perf_counter()
    r = httpx.post(
        f"http://127.0.0.1:{head.port}/v1/completions",
        timeout=300,
        json={"prompt": PROMPT, "max_tokens": n, "temperature": 0},
    )
    if r.status_code != 200:
        raise RuntimeError(f"completion failed: {r.status_code} {r.text[:200]}")
    return time.perf_counter() - t0


def info_ms(head: Worker) -> float:
    t0 = time.perf_counter()
    assert request_sync("127.0.0.1", head.rpc, Op.INFO, token=TOKEN).ok
    return (time.perf_counter() - t0) * 1e3


def health_ms(head: Worker) -> float:
    t0 = time.perf_counter()
    httpx.get(f"http://127.0.0.1:{head.port}/health", timeout=30)
    return (time.perf_counter() - t0) * 1e3


def p(values: list[float], q: float) -> float:
    return round(sorted(values)[min(int(q * len(values)), len(values) - 1)], 2) if values else float("nan")


class IdleSockets:
    """`n` silent connections to each port, re-opened when a worker's deadline closes one."""

    def __init__(self, ports: list[int], n: int):
        self.ports, self.n = ports, n
        self.sel = selectors.DefaultSelector()
        self.opened = self.reopened = self.refused = 0
        for port in ports:
            for _ in range(n):
                self._open(port)

    def _open(self, port: int) -> None:
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
        except OSError:
            self.refused += 1
            return
        s.setblocking(False)
        self.sel.register(s, selectors.EVENT_READ, port)
        self.opened += 1

    def tend(self, timeout: float) -> None:
        for key, _ in self.sel.select(timeout):
            try:
                gone = not key.fileobj.recv(4096)
            except BlockingIOError:
                continue
            except OSError:
                gone = True
            if gone:
                self.sel.unregister(key.fileobj)
                key.fileobj.close()
                self.reopened += 1
                self._open(key.data)

    def close(self) -> None:
        for key in list(self.sel.get_map().values()):
            key.fileobj.close()
        self.sel.close()


def idle_sockets_phase(head: Worker, peer: Worker, args, baseline_s: float) -> dict:
    workers = (head, peer)
    for w in workers:
        w.peak_rss = w.peak_threads = 0
    start = {w: w.sample() for w in workers}
    idle = IdleSockets([head.rpc, peer.rpc], args.sockets)
    latencies, infos, healths, failures = [], [], [], 0
    stop = threading.Event()

    def generate():
        nonlocal failures
        while not stop.is_set():
            try:
                latencies.append(completion_s(head, args.tokens))
            except (RuntimeError, httpx.HTTPError):
                failures += 1

    gen = threading.Thread(target=generate)
    gen.start()
    end = time.monotonic() + args.duration
    while time.monotonic() < end:
        idle.tend(0.5)
        for w in workers:
            w.sample()
        infos.append(info_ms(head))
        healths.append(health_ms(head))
    stop.set()
    gen.join()
    opened, reopened, refused = idle.opened, idle.reopened, idle.refused
    idle.close()
    return {
        "sockets_per_port": args.sockets,
        "duration_s": args.duration,
        "opened": opened,
        "reopened_after_deadline": reopened,
        "refused_at_connect": refused,
        "completions": len(latencies),
        "failed": failures,
        "latency_median_s": round(statistics.median(latencies), 3) if latencies else None,
        "latency_vs_quiet": round(statistics.median(latencies) / baseline_s, 2) if latencies else None,
        "info_ms_p50": p(infos, 0.5),
        "info_ms_p99": p(infos, 0.99),
        "health_ms_p99": p(healths, 0.99),
        **{f"{name}_rss_mib_start": round(start[w][0] / MiB, 1) for name, w in (("head", head), ("peer", peer))},
        **{f"{name}_rss_mib_peak": round(w.peak_rss / MiB, 1) for name, w in (("head", head), ("peer", peer))},
        **{f"{name}_threads_start": start[w][1] for name, w in (("head", head), ("peer", peer))},
        **{f"{name}_threads_peak": w.peak_threads for name, w in (("head", head), ("peer", peer))},
    }


def preauth_probe(head: Worker, peer: Worker, rounds: int = 20) -> dict:
    """Frames announcing 512 MiB before AUTH (first frame, AUTH after HELLO, control); RSS around them."""
    huge = 512 * MiB
    out = {}
    for name, w in (("head", head), ("peer", peer)):
        before, closed = w.sample()[0], 0
        for _ in range(rounds):
            frames = [struct.pack("<BQ", Cmd.HELLO, huge), None]
            if w is head:
                frames.append(struct.pack("<HBBHQH", CONTROL_MAGIC, Op.AUTH, 0, 0, huge, 0))
            for frame in frames:
                with socket.create_connection(("127.0.0.1", w.rpc), timeout=30) as s:
                    if frame is None:  # AUTH of 511 MiB after a valid HELLO
                        s.sendall(wire.pack_compute_request(Cmd.HELLO, pack_hello()))
                        r = SocketReader(s)
                        wire.read_compute_response(r, 64), wire.read_compute_response(r, 64)
                        frame = struct.pack("<BQ", Cmd.AUTH, huge - MiB)
                    try:
                        s.sendall(frame + b"x" * 65536)
                        closed += s.recv(1) == b""
                    except OSError:
                        closed += 1
        out[f"{name}_rss_growth_mib"] = round((w.sample()[0] - before) / MiB, 1)
        out[f"{name}_closed"] = f"{closed}/{rounds * (len(frames))}"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF file (default: a synthetic 8-layer gemma3)")
    ap.add_argument("--duration", type=float, default=120.0, help="seconds the idle sockets are held")
    ap.add_argument("--sockets", type=int, default=1000, help="idle sockets per RPC port")
    ap.add_argument("--tokens", type=int, default=16, help="tokens per completion")
    ap.add_argument("--quiet", type=int, default=5, help="completions in the quiet baseline")
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 4 * args.sockets + 256)), hard))
    with tempfile.TemporaryDirectory() as tmp:
        model = (
            Path(args.model)
            if args.model
            else write_synthetic(
                Path(tmp) / "attack.gguf", "gemma3", n_layers=8, n_embd=256, n_head=4, n_head_kv=2, n_ff=512
            )
        )
        peer = Worker("peer", model, Path(tmp) / "peer.log")
        head = Worker(
            "serve", model, Path(tmp) / "head.log", "--peer", f"127.0.0.1:{peer.rpc}", "--parallel", "2", "--ctx", "512"
        )
        try:
            peer.wait_ready()
            head.wait_ready()
            completion_s(head, args.tokens)  # warm-up
            quiet = [completion_s(head, args.tokens) for _ in range(args.quiet)]
            baseline = statistics.median(quiet)
            infos = [info_ms(head) for _ in range(20)]
            print(
                json.dumps({"quiet_latency_median_s": round(baseline, 3), "quiet_info_ms_p50": p(infos, 0.5)}),
                flush=True,
            )
            print(json.dumps(idle_sockets_phase(head, peer, args, baseline)), flush=True)
            print(json.dumps(preauth_probe(head, peer)), flush=True)
        finally:
            for w in (head, peer):
                w.stop()


if __name__ == "__main__":
    main()
