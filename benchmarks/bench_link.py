"""A split across a link you can dial (issue 40 items 1 and 2).

    sudo python benchmarks/bench_link.py [--links 1gbit,2.5gbit,10gbit,wan] [--peers 1] [--n-gen 64]
                                         [--prompt-tokens 256] [-r 3] [--json PATH]
    python benchmarks/bench_link.py --project-only      # item 2 alone: no root, no processes

**Measured.** The head (`hydra-engine serve`) and each peer (`hydra-engine peer`) run in their own
network namespace; each peer's namespace is joined to the head's by a veth pair shaped on both ends
(`tc netem rate R delay D`: every direction gets the rate and the one-way delay, so RTT = 2 D).
The same three workloads run through the head's HTTP API as on loopback (a second head whose peers
sit in the head's own namespace on 127.0.0.1): greedy decode (`speculative: off`), MTP decode
(k = 3, p-min 0: the synthetic model's MTP block predicts the trunk's next token, so every draft is
taken) and prefill (a `--prompt-tokens` prompt, one token out). Per link it prints the bytes and
round trips per token (bytes from the head's /status `peers` counters, round trips from each
peer's /status `resident.forwards`), tok/s (the server's `timings`, median of `-r`) and the
slowdown against loopback. The model is a small synthetic qwen35 (DeltaNet + gated attention + its
NextN block, `engine/synth.py`, `--n-embd` wide) on the CPU.

Where the kernel has no `sch_netem` (`tc qdisc add ... netem` says "unknown"), the delay and the
rate move into `benchmarks/link.py`, a relay in the head's namespace that holds each chunk for D
and paces it at R before it crosses the veth (the head reaches its peer through the relay); a
`relay-0` row (no delay, no rate) then shows what the relay itself costs.

It needs root (network namespaces, `tc`): without it, or without `ip`/`tc`, it says so and exits 0.
The namespaces, the veths and every process it started are removed on the way out, whatever
happens (Ctrl-C and SIGTERM included).

**Projected** (`--project-only`, also printed after a measured run): the 27B shape's hidden size
(5120) at a GPU's step time. A CPU step (tens of ms) hides any LAN, so the link's cost per token is
computed instead: per round trip, the measured host cost of a FORWARD frame of that width (packing,
framing, one TCP round trip of the frame over loopback less an empty frame's, parsing: bf16 and
f32), plus the bytes' time on the wire at the link's rate, plus its RTT; over the GPU step time of
docs/PERF.md (27B Q5_K_M decode on an H100 through HTTP, session 23: 107.6 tok/s → 9.29 ms; a k = 3
verify costs ×1.386 a one-token step, so one round trip carries 4 tokens in 12.9 ms of GPU time). The
faster the step, the larger the link's share: session 22's rows used 88.1 tok/s and ×1.48.
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import json
import os
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# name -> (tc rate, one-way delay ms per direction, relay rate in Mbit/s)
LINKS = {
    "1gbit": ("1gbit", 0.2, 1000.0),
    "2.5gbit": ("2500mbit", 0.1, 2500.0),
    "10gbit": ("10gbit", 0.05, 10000.0),
    "wan": ("100mbit", 10.0, 100.0),  # 20 ms RTT, 100 Mbit/s
}
# docs/PERF.md: Qwen3.5-27B shape, Q5_K_M, one H100, compiled + CUDA graphs (issue 37's table)
GPU_DECODE_TOK_S = 107.6  # one stream through HTTP (PERF.md, "Session 23: the 27B side by side")
VERIFY_FACTOR = 1.386  # a k = 3 verify (4 tokens) against a one-token step (bench_spec, same section)
HIDDEN_27B = 5120
TOKEN = "bench-link-token"
CLONE_NEWNET = 0x40000000
THREADS: int | None = 1  # OMP_NUM_THREADS of every worker (--threads; 0: the runtime's default)
SYNTH = dict(
    n_layers=8,
    n_head=8,
    n_head_kv=2,
    head_dim=64,
    ssm_state=64,
    ssm_groups=2,
    ssm_v_heads=4,
    full_attention_interval=4,
    nextn=True,
    bigram=True,
)
PROMPT = "The link between the two machines carries hidden states, never weights, and the head"


# --- item 2: the projection ------------------------------------------------------------------------


def measure_serialization(
    d: int, rows: int, dtype_name: str, device: str = "cpu", iters: int = 1500, output: bool = False
) -> dict:
    """Host cost of one FORWARD round trip of `rows` x `d` hidden states in `dtype_name`, as the
    head and a peer frame them (engine/rpc/compute.py, wire.py), over loopback TCP: median round
    trip of that frame minus an empty frame's (the loopback's own round trip, which a real link
    replaces with its RTT). On a CUDA `device` both sides also stage the states as they do
    (engine/device.py: to the host through page-locked memory and back, waiting for the copies).
    `output`: a greedy step through a last peer that holds the output head and the MTP block
    (`--output-stage last`): FORWARD_OUT out (the states, rows, token ids, a draft ahead), each
    row's argmax and the next draft back. Returns ms and the frame sizes."""
    import numpy as np
    import torch

    from hydra_console.contracts.rpc import AHEAD_DRAFT, COMPUTE_HEADER, COMPUTE_SIZE, FORWARD_REPLY, Cmd
    from hydra_console.engine.device import host_buffer, to_host
    from hydra_console.engine.rpc.forward_frames import (
        pack_forward,
        pack_forward_out,
        raw_bytes,
        unpack_forward,
        unpack_forward_out,
    )
    from hydra_console.engine.rpc.tcp import tune_socket
    from hydra_console.engine.rpc.wire import (
        SocketReader,
        read_compute_request,
        read_compute_response_size,
        send_all,
    )

    dtype = getattr(torch, dtype_name)
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    server = socket.create_server(("127.0.0.1", 0))
    addr = server.getsockname()

    def peer_side():
        conn, _ = server.accept()
        tune_socket(conn)
        reader = SocketReader(conn)
        try:
            while True:
                cmd, payload = read_compute_request(reader, 1 << 30)
                if cmd not in (Cmd.FORWARD, Cmd.FORWARD_OUT):
                    break
                if cmd == Cmd.FORWARD_OUT:  # each row's argmax and one draft of 3 ahead back
                    _, hidden, _, _, rows_, _, _, _, ahead = unpack_forward_out(payload)
                    hidden.to(dev)  # the stage's input on its device; its argmax rows: any ids
                    out = rows_.to(dev, torch.int32)
                    draft = [np.int32(1)] * 3
                    body = raw_bytes(to_host(out)).tobytes() + b"".join(
                        AHEAD_DRAFT.pack(0, 0, len(draft)) + np.asarray(draft).tobytes() for _ in ahead
                    )
                else:
                    _, hidden, _, _ = unpack_forward(payload)
                    out = hidden.to(dev).clone()  # the stage's input on its device; its output a new tensor
                    body = raw_bytes(to_host(out).to(hidden.dtype))
                reply = FORWARD_REPLY.pack(0, 0)
                send_all(conn, COMPUTE_SIZE.pack(len(reply) + len(body)), reply, body)
        except Exception:
            pass
        finally:
            conn.close()

    th = threading.Thread(target=peer_side, daemon=True)
    th.start()
    sock = socket.create_connection(addr)
    tune_socket(sock)
    reader = SocketReader(sock)

    def round_trips(t: int) -> tuple[float, int, int]:
        h = torch.randn(t, d).to(dev, dtype)
        slots, positions = torch.zeros(t, dtype=torch.long), torch.arange(t)
        times = []
        for i in range(iters):
            sync()
            t0 = time.perf_counter()
            hidden = to_host(h)
            if output:
                ahead = ((0, t - 1, 3, 0.0),) if t > 1 else ()  # a verify brings its next draft
                parts = pack_forward_out(1, hidden, slots, positions, torch.arange(t), positions, False, True, ahead)
            else:
                parts = pack_forward(1, hidden, slots, positions)
            size = sum(memoryview(p).cast("B").nbytes for p in parts)
            sent = send_all(sock, COMPUTE_HEADER.pack(Cmd.FORWARD_OUT if output else Cmd.FORWARD, size), *parts)
            n = read_compute_response_size(reader, 1 << 30)
            reader.read_exact(FORWARD_REPLY.size)
            if output:
                reader.read_exact(n - FORWARD_REPLY.size)  # the argmax rows and the draft: ids, read as ids
            else:
                out = host_buffer((t, d), dtype, dev)
                if t:
                    reader.read_into(memoryview(out.view(-1).view(torch.uint8).numpy()))
                out.to(dev, non_blocking=True)
            sync()
            if i >= iters // 10:  # the first tenth warms up
                times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3, sent, COMPUTE_SIZE.size + n

    empty_ms, _, _ = round_trips(0)
    full_ms, req, rep = round_trips(rows)
    empty2_ms, _, _ = round_trips(0)
    send_all(sock, COMPUTE_HEADER.pack(Cmd.PING, 0))
    sock.close()
    server.close()
    base = min(empty_ms, empty2_ms)
    return {
        "d": d,
        "rows": rows,
        "dtype": dtype_name,
        "device": device,
        "request_bytes": req,
        "reply_bytes": rep,
        "frame_rtt_ms": full_ms,
        "empty_rtt_ms": base,
        "serialization_ms": max(full_ms - base, 0.0),
    }


def project(links: list[str], peers: int = 1, device: str = "cpu") -> dict:
    """Item 2's table: per-token link time of the 27B shape over each link, against the GPU step."""
    step_ms = 1e3 / GPU_DECODE_TOK_S
    verify_ms = VERIFY_FACTOR * step_ms
    ser = {
        (dt, rows, out): measure_serialization(HIDDEN_27B, rows, dt, device, output=out)
        for dt in ("bfloat16", "float32")
        for rows in (1, 4)
        for out in (False, True)
    }
    rows_out = []
    for name in links:
        _, delay_ms, mbit = LINKS[name]
        rtt = 2 * delay_ms
        for dt in ("bfloat16", "float32"):
            out = {"link": name, "rate_mbit": mbit, "rtt_ms": rtt, "dtype": dt}
            modes = (("decode", 1, step_ms, 1, False), ("mtp", 4, verify_ms, 4, False))
            # --output-stage last, greedy: the argmax rows and the next draft come back, not the states
            modes += (("decode_out", 1, step_ms, 1, True), ("mtp_out", 4, verify_ms, 4, True))
            for mode, rows, gpu_ms, tokens, via_out in modes:
                s = ser[(dt, rows, via_out)]
                wire_ms = (s["request_bytes"] + s["reply_bytes"]) * 8 / (mbit * 1e6) * 1e3
                link_ms = peers * (rtt + wire_ms + s["serialization_ms"])  # one round trip per peer per step
                out[mode] = {
                    "bytes_per_round_trip": s["request_bytes"] + s["reply_bytes"],
                    "serialization_ms": s["serialization_ms"],
                    "wire_ms": wire_ms,
                    "link_ms_per_token": link_ms / tokens,
                    "gpu_ms_per_token": gpu_ms / tokens,
                    "cost": link_ms / (gpu_ms + link_ms),  # tok/s lost against the same GPUs with no link
                }
            rows_out.append(out)
    return {
        "gpu_step_ms": step_ms,
        "verify_ms": verify_ms,
        "peers": peers,
        "device": device,
        "serialization": [ser[k] for k in sorted(ser)],
        "rows": rows_out,
    }


def print_projection(p: dict) -> None:
    print(
        f"\nProjection: 27B shape (hidden {HIDDEN_27B}), {p['peers']} peer(s), GPU step {p['gpu_step_ms']:.2f} ms "
        f"({GPU_DECODE_TOK_S} tok/s, H100, docs/PERF.md); MTP k=3 verify {p['verify_ms']:.2f} ms for 4 tokens"
    )
    print(
        f"serialization (host cost of a FORWARD round trip, hidden states on {p['device']}, "
        "measured here over loopback, minus an empty frame's):"
    )
    for s in p["serialization"]:
        print(
            f"  {s['dtype']:8s} {s['rows']} row(s): {s['request_bytes']} B out + {s['reply_bytes']} B back, "
            f"{s['serialization_ms'] * 1e3:.1f} us (frame {s['frame_rtt_ms'] * 1e3:.1f} us, empty {s['empty_rtt_ms'] * 1e3:.1f} us)"
        )
    for title, dec, mtp in (
        ("output head on the head (the default)", "decode", "mtp"),
        ("--output-stage last, greedy (argmax rows and the next draft back)", "decode_out", "mtp_out"),
    ):
        print(f"\n{title}:")
        print(
            "| link | RTT ms | dtype | decode: wire + ser. ms | link ms/token | cost | MTP k=3: wire + ser. ms | link ms/token | cost |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for r in p["rows"]:
            d, m = r[dec], r[mtp]
            print(
                f"| {r['link']} ({r['rate_mbit']:g} Mbit/s) | {r['rtt_ms']:g} | {r['dtype']} | "
                f"{d['wire_ms']:.3f} + {d['serialization_ms']:.3f} | {d['link_ms_per_token']:.3f} | **{d['cost'] * 100:.1f} %** | "
                f"{m['wire_ms']:.3f} + {m['serialization_ms']:.3f} | {m['link_ms_per_token']:.3f} | **{m['cost'] * 100:.1f} %** |"
            )


# --- item 1: namespaces, shaping, processes -----------------------------------------------------


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed: {done.stderr.strip()}")
    return done


def in_ns(ns: str, *argv: str) -> tuple[str, ...]:
    return ("ip", "netns", "exec", ns, *argv)


def enter_netns(name: str) -> None:
    """Move this (still single-threaded) process into namespace `name`: the heads it starts and
    its HTTP requests then live there."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({name}): {os.strerror(err)}")
    finally:
        os.close(fd)


class Topology:
    """A namespace for the head and one per peer, each peer's joined to the head's by a veth pair
    (10.79.N.1 on the head's side, 10.79.N.2 on the peer's)."""

    def __init__(self, n_peers: int):
        tag = secrets.token_hex(2)
        self.head_ns = f"hydra-link-{tag}-h"
        self.peer_ns = [f"hydra-link-{tag}-p{i}" for i in range(n_peers)]
        self.devs = [(f"hlh{tag}{i}", f"hlp{tag}{i}") for i in range(n_peers)]  # ≤ 15 characters
        base = int(tag[:2], 16) % 200
        self.addrs = [(f"10.79.{base + i}.1", f"10.79.{base + i}.2") for i in range(n_peers)]
        self.made: list[str] = []

    def create(self) -> None:
        for ns in [self.head_ns, *self.peer_ns]:
            sh("ip", "netns", "add", ns)
            self.made.append(ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        for ns, (hd, pd), (ha, pa) in zip(self.peer_ns, self.devs, self.addrs):
            sh("ip", "link", "add", hd, "netns", self.head_ns, "type", "veth", "peer", "name", pd, "netns", ns)
            sh("ip", "-n", self.head_ns, "addr", "add", f"{ha}/24", "dev", hd)
            sh("ip", "-n", ns, "addr", "add", f"{pa}/24", "dev", pd)
            sh("ip", "-n", self.head_ns, "link", "set", hd, "up")
            sh("ip", "-n", ns, "link", "set", pd, "up")

    def ends(self):
        """(namespace, device) of both ends of every pair."""
        for ns, (hd, pd) in zip(self.peer_ns, self.devs):
            yield self.head_ns, hd
            yield ns, pd

    def has_netem(self) -> bool:
        ns, dev = next(self.ends())
        ok = sh(*in_ns(ns, "tc", "qdisc", "add", "dev", dev, "root", "netem", "delay", "0ms"), check=False)
        sh(*in_ns(ns, "tc", "qdisc", "del", "dev", dev, "root"), check=False)
        return ok.returncode == 0

    def shape(self, rate: str | None, delay_ms: float | None) -> None:
        for ns, dev in self.ends():
            if rate is None:
                sh(*in_ns(ns, "tc", "qdisc", "del", "dev", dev, "root"), check=False)
            else:
                args = ("rate", rate, "delay", f"{delay_ms}ms", "limit", "100000")
                sh(*in_ns(ns, "tc", "qdisc", "replace", "dev", dev, "root", "netem", *args))

    def remove(self) -> None:
        for ns in reversed(self.made):  # a namespace takes its veth ends (and so the pairs) along
            sh("ip", "netns", "del", ns, check=False)
        self.made.clear()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A process in its own session (killed as a group), its output in a log file."""

    live: list[Proc] = []

    def __init__(self, cmd: list[str], log_dir: Path, name: str):
        self.name, self.log_path = name, log_dir / f"{name}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **({"OMP_NUM_THREADS": str(THREADS)} if THREADS else {})}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        Proc.live.append(self)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
            except ProcessLookupError:
                pass
        if self in Proc.live:
            Proc.live.remove(self)


def engine_cmd(role: str, model: Path, host: str, port: int, rpc_port: int, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "hydra_console.engine.cli",
        role,
        "--model",
        str(model),
        "--device",
        "cpu",
        "--host",
        host,
        "--rpc-host",
        host,
        "--port",
        str(port),
        "--rpc-port",
        str(rpc_port),
        "--auth-token",
        TOKEN,
        *extra,
    ]


def http(method: str, url: str, timeout: float = 300.0, **kw):
    import httpx

    return httpx.request(method, url, timeout=timeout, **kw)


def wait_ready(url: str, proc: Proc, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.proc.poll() is not None:
            raise RuntimeError(f"{proc.name} exited with {proc.proc.returncode}:\n{proc.log()}")
        try:
            if http("GET", f"{url}/health", timeout=2.0).status_code == 200:
                return
        except Exception:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{proc.name} not ready after {timeout} s:\n{proc.log()}")


class Split:
    """A head and its peers: `peer_hosts[i]` is where peer i listens (and in which namespace, None:
    this one); `via[i]` the address the head dials for it (a relay's, or the peer's own)."""

    def __init__(self, name: str, model: Path, log_dir: Path, peer_places: list[tuple[str | None, str]], args):
        self.name, self.peers, self.peer_urls, self.rpc_addrs = name, [], [], []
        for i, (ns, host) in enumerate(peer_places):
            port, rpc = free_port(), free_port()
            cmd = engine_cmd("peer", model, host, port, rpc)
            self.peers.append(Proc(list(in_ns(ns, *cmd)) if ns else cmd, log_dir, f"{name}-peer{i}"))
            self.peer_urls.append(f"http://{host}:{port}")
            self.rpc_addrs.append(f"{host}:{rpc}")
        self.via = list(self.rpc_addrs)
        self.model, self.log_dir, self.args = model, log_dir, args
        self.head: Proc | None = None

    def start_head(self) -> None:
        port, rpc = free_port(), free_port()
        n = len(self.peers) + 1
        split = "/".join(str(c) for c in even_counts(SYNTH["n_layers"], n))
        extra = ["--split", split, "--parallel", "1", "--ctx", str(self.args.prompt_tokens + self.args.n_gen + 64)]
        extra += ["--spec-type", "mtp", "--draft-max", "3", "--draft-p-min", "0"]
        for addr in self.via:
            extra += ["--peer", addr]
        self.head = Proc(
            engine_cmd("serve", self.model, "127.0.0.1", port, rpc, *extra), self.log_dir, f"{self.name}-head"
        )
        self.url = f"http://127.0.0.1:{port}"

    def wait(self) -> None:
        for p, url in zip(self.peers, self.peer_urls):
            wait_ready(url, p)
        wait_ready(self.url, self.head)
        deadline = time.monotonic() + 60
        while not all(p["state"] == "up" for p in self.status()["peers"]):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: peers not up: {self.status()['peers']}")
            time.sleep(0.1)

    def status(self) -> dict:
        return http("GET", f"{self.url}/status", timeout=30).json()

    def counters(self) -> tuple[int, int, float]:
        """(bytes both ways over every peer link, FORWARDs served by every peer, last RTT ms)."""
        peers = self.status()["peers"]
        nbytes = sum(p["bytes_sent"] + p["bytes_recv"] for p in peers)
        forwards = sum(http("GET", f"{u}/status", timeout=30).json()["resident"]["forwards"] for u in self.peer_urls)
        rtts = [p["rtt_ms"] for p in peers if p["rtt_ms"] is not None]
        return nbytes, forwards, max(rtts) if rtts else float("nan")

    def stop(self) -> None:
        for p in [self.head, *self.peers]:
            if p is not None:
                p.stop()


def even_counts(n: int, parts: int) -> list[int]:
    base, extra = divmod(n, parts)
    return [base + (i < extra) for i in range(parts)]


def request(split: Split, body: dict) -> tuple[dict, int, int, float]:
    """(response, link bytes, peer FORWARDs, last RTT ms) of one completion."""
    b0, f0, _ = split.counters()
    r = http("POST", f"{split.url}/v1/completions", json={**body, "temperature": 0, "cache_prompt": False})
    if r.status_code != 200:
        raise Unavailable(f"{split.name}: {r.status_code} {r.text[:300]}")
    b1, f1, rtt = split.counters()
    return r.json(), b1 - b0, f1 - f0, rtt


class Unavailable(RuntimeError):
    pass


def run_workload(split: Split, workload: str, args) -> dict:
    """One request; its tok/s and the link counters per token: per prompt token for prefill, per
    decoded token for decode (the prompt's own forward, measured by a one-token request with the
    same prompt, taken off; the first token comes with it)."""
    if workload == "prefill":
        reply, nbytes, forwards, rtt = request(split, {"prompt": prompt_ids(args.prompt_tokens), "max_tokens": 1})
        t = reply["timings"]
        tokens, rate = t["prompt_n"], t["prompt_per_second"]
    else:
        body = {"prompt": PROMPT, "max_tokens": args.n_gen, "ignore_eos": True}
        if workload == "decode":
            body["speculative"] = {"type": "off"}
        _, pre_bytes, pre_forwards, _ = request(split, {**body, "max_tokens": 1})
        reply, nbytes, forwards, rtt = request(split, body)
        t = reply["timings"]
        tokens, rate = t["predicted_n"] - 1, t["predicted_per_second"]
        nbytes, forwards = nbytes - pre_bytes, forwards - pre_forwards
    r = reply
    return {
        "tok_s": rate,
        "tokens": tokens,
        "bytes_per_token": nbytes / tokens,
        "round_trips_per_token": forwards / tokens,
        "rtt_ms": rtt,
        "text": r["choices"][0]["text"],
        "accepted": (t.get("draft_n_accepted"), t.get("draft_n")),
    }


def prompt_ids(n: int) -> list[int]:
    return [5 + (i * 7) % 50 for i in range(n)]


def measure(loop: Split, linked: Split, args) -> dict:
    """Each workload `-r` times on the link, each run paired with one on loopback just before it
    (a loaded machine drifts between blocks: a ratio of neighbours is steadier than one of
    medians). Per workload: the link's counters and tok/s, loopback's tok/s, the median ratio."""
    out = {}
    for workload in ("decode", "mtp", "prefill"):
        pairs = [(run_workload(loop, workload, args), run_workload(linked, workload, args)) for _ in range(args.reps)]
        lo, li = [p[0] for p in pairs], [p[1] for p in pairs]
        mid = li[len(li) // 2]
        out[workload] = {
            **{k: mid[k] for k in ("tokens", "bytes_per_token", "round_trips_per_token", "text", "accepted")},
            "tok_s": statistics.median(r["tok_s"] for r in li),
            "tok_s_runs": [round(r["tok_s"], 1) for r in li],
            "loopback_tok_s": statistics.median(r["tok_s"] for r in lo),
            "loopback_tok_s_runs": [round(r["tok_s"], 1) for r in lo],
            "ratio": statistics.median(b["tok_s"] / a["tok_s"] for a, b in pairs),
            "rtt_ms": min(r["rtt_ms"] for r in li),
            "same_text": all(a["text"] == b["text"] for a, b in pairs),
        }
    return out


def reattach(split: Split, timeout: float = 120.0) -> None:
    """The relays restarted: the head finds its connections closed at its next request (a 503),
    then re-attaches through the new relay; wait until a request goes through."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            request(split, {"prompt": PROMPT, "max_tokens": 2})
            return
        except Unavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
            split.wait()


class Relay:
    """benchmarks/link.py in the head's namespace (where netem is missing): listens on 127.0.0.1
    at a fixed port per peer, so the head keeps dialing the same address across links."""

    def __init__(self, log_dir: Path, target: str, port: int):
        self.log_dir, self.target, self.port, self.proc = log_dir, target, port, None

    def start(self, delay_ms: float, rate_mbit: float | None) -> None:
        self.stop()
        cmd = [sys.executable, str(Path(__file__).with_name("link.py")), "--to", self.target]
        cmd += ["--listen", f"127.0.0.1:{self.port}", "--delay-ms", str(delay_ms)]
        cmd += ["--rate-mbit", str(rate_mbit)] if rate_mbit else []
        self.proc = Proc(cmd, self.log_dir, f"relay-{self.port}")
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline or self.proc.proc.poll() is not None:
                    raise RuntimeError(f"relay did not start:\n{self.proc.log()}") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()
            self.proc = None


def cleanup(topo: Topology | None) -> None:
    for p in list(Proc.live):
        p.stop()
    if topo is not None:
        topo.remove()


def bench(args) -> dict:
    from hydra_console.engine.synth import write_synthetic

    log_dir = Path(tempfile.mkdtemp(prefix="bench-link-"))
    model = write_synthetic(log_dir / "q35-mtp.gguf", "qwen35", n_embd=args.n_embd, n_ff=3 * args.n_embd, **SYNTH)
    topo = Topology(args.peers)
    atexit.register(cleanup, topo)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: sys.exit(130))
    try:
        topo.create()
        netem = topo.has_netem()
        enter_netns(topo.head_ns)  # before any thread: the heads start in it and we talk to them there
        print(
            f"namespaces: head {topo.head_ns}, peers {', '.join(topo.peer_ns)}; shaping: "
            + ("tc netem on both veth ends" if netem else "no sch_netem in this kernel: benchmarks/link.py relay")
            + f"; logs in {log_dir}",
            flush=True,
        )
        loop = Split("loopback", model, log_dir, [(None, "127.0.0.1")] * args.peers, args)
        linked = Split("link", model, log_dir, [(ns, pa) for ns, (_, pa) in zip(topo.peer_ns, topo.addrs)], args)
        relays = []
        if not netem:
            relays = [Relay(log_dir, addr, free_port()) for addr in linked.rpc_addrs]
            linked.via = [f"127.0.0.1:{r.port}" for r in relays]
            for r in relays:
                r.start(0.0, None)
        loop.start_head()
        linked.start_head()
        loop.wait()
        linked.wait()
        for split in (loop, linked):  # one untimed pass each (first-call costs)
            run_workload(split, "mtp", args)
            run_workload(split, "prefill", args)

        results = {}
        links = (["relay-0"] if not netem else []) + args.links
        for name in links:
            if name == "relay-0":
                rate, delay, mbit = None, 0.0, None
            else:
                rate, delay, mbit = LINKS[name]
            if netem:
                topo.shape(rate, delay)
            else:
                for r in relays:
                    r.start(delay, mbit)
                reattach(linked)
            results[name] = measure(loop, linked, args)
            results[name]["shaping"] = "netem" if netem else "relay"
            results[name]["delay_ms"], results[name]["rate"] = delay, rate or "unlimited"
            print_row(name, results[name])
        for name, r in results.items():
            for w in ("decode", "mtp"):
                if not r[w]["same_text"]:
                    print(f"WARNING: {name} {w}: the text differs from loopback's")
        return {"netem": netem, "n_embd": args.n_embd, "peers": args.peers, "links": results}
    finally:
        cleanup(topo)
        atexit.unregister(cleanup)


HEADER_PRINTED = False


def print_row(name: str, r: dict) -> None:
    global HEADER_PRINTED
    if not HEADER_PRINTED:
        print(
            "| link | RTT ms (min, head's) | workload | bytes/token | round trips/token | tok/s link (runs) "
            "| tok/s loopback (runs) | link / loopback |"
        )
        print("|---|---|---|---|---|---|---|---|")
        HEADER_PRINTED = True
    for w in ("decode", "mtp", "prefill"):
        x = r[w]
        acc = f" (accepted {x['accepted'][0]}/{x['accepted'][1]})" if w == "mtp" else ""
        print(
            f"| {name} | {x['rtt_ms']:.2f} | {w}{acc} | {x['bytes_per_token']:.0f} | {x['round_trips_per_token']:.3f} | "
            f"{x['tok_s']:.1f} ({', '.join(map(str, x['tok_s_runs']))}) | "
            f"{x['loopback_tok_s']:.1f} ({', '.join(map(str, x['loopback_tok_s_runs']))}) | "
            f"{x['ratio']:.3f}× ({(x['ratio'] - 1) * 100:+.1f} %) |",
            flush=True,
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--links", default="1gbit,2.5gbit,10gbit,wan", help=f"comma-separated, of {', '.join(LINKS)}")
    ap.add_argument("--peers", type=int, default=1, help="peers, each in its own namespace (layers split evenly)")
    ap.add_argument("--n-gen", type=int, default=64, help="tokens per decode request")
    ap.add_argument("--prompt-tokens", type=int, default=256, help="prefill prompt length")
    ap.add_argument("--n-embd", type=int, default=256, help="hidden size of the synthetic qwen35")
    ap.add_argument("-r", "--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each worker (0: the default)")
    ap.add_argument(
        "--device", default="cpu", help="where the projection's hidden states live (cuda: staged as the head does)"
    )
    ap.add_argument("--project-only", action="store_true", help="only the 27B projection (item 2): no root needed")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    args.links = [x for x in args.links.split(",") if x]
    global THREADS
    THREADS = args.threads or None
    bad = [x for x in args.links if x not in LINKS]
    if bad or args.peers < 1 or args.n_gen < 2 or args.prompt_tokens < 1 or args.reps < 1:
        ap.error(f"unknown link {bad}" if bad else "--peers, --reps, --prompt-tokens ≥ 1 and --n-gen ≥ 2")
    out = {}
    if not args.project_only:
        missing = [c for c in ("ip", "tc") if shutil.which(c) is None]
        if os.geteuid() != 0 or missing:
            why = f"no {' / '.join(missing)} command (iproute2)" if missing else "it is not running as root"
            print(
                f"bench_link: skipped, {why}: the measured part needs root to create network namespaces, "
                "veth pairs and tc qdiscs (sudo python benchmarks/bench_link.py). The projection follows."
            )
        else:
            out["measured"] = bench(args)
    out["projection"] = project(list(LINKS), args.peers, args.device)
    print_projection(out["projection"])
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
