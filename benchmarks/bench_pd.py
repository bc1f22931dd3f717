"""Prefill/decode disaggregation: what long prompts cost the streams already decoding.

    python benchmarks/bench_pd.py [--model PATH] [--device cpu] [--dtype float32] [--streams 2]
                                  [--prompt-tokens 512] [--every-s 2] [--duration-s 20] [--threshold 64]
                                  [--layers 8 --embd 512 --ff 1536 (synthetic model)] [--threads 1] [--json]
                                  [--modes local,pd,slots] [--netns [--mtu N]] [--slot-reps 3] [--prefill-deadline 300]

Issue-sized on a GPU: --model M.gguf --device cuda --dtype bfloat16 --streams 8 --prompt-tokens 4096
--every-s 2 --ctx 8192 --threads 0. Per mode (`local`: the head prefills everything; `pd`: prompts of at least
--threshold tokens go to a `serve --role prefill` worker), a fresh head runs --streams streaming
completions; after a quiet warm-up (their inter-token gaps there are the `idle` baseline), a long
prompt (random token ids, no prompt cache) arrives every --every-s seconds. Prints p50/p99 of the
streams' inter-token gaps while long prompts arrive, the long prompts' TTFT, and for `pd` the
transfer throughput the head measured (prompt-state bytes / fetch + placement time, /status `pd`).
Without --model a random-weight llama GGUF of the given shape is written to a temporary folder.

--netns (root): the prefill worker runs in its own network namespace, reached over a veth pair (its
own IP stack and address, not loopback), with an auth token on both sides as off-loopback RPC needs.
The namespace and the pair are removed at the end. --mtu sets the pair's MTU (a same-host link can
take up to 65535, as loopback's 65536; the kernel's default is 1500).

Transfer throughput is that of the transfers after the warm-up one (prompt-state bytes / (fetch +
placement - the prefill worker's compute)), each split into collect (the prefill worker copying the
state out and checksumming it), wire (framing, the network, receiving with each chunk's checksum
checked as it arrives) and place (this head's header checks and copy into the slot). A 4,096-token
state of hundreds of MB from a model small enough to prefill on a CPU:
--layers 64 --embd 256 --ff 256 --prompt-tokens 4096 --ctx 4200 (268 MB in float32).

Mode `slots` (in --modes): restoring a slot against recomputing it. A fresh head (one slot) prefills
a --prompt-tokens prompt (`recompute_ms`: its prompt_ms), saves the slot to --slot-save-path,
erases it, restores it (`restore_ms`: file read, checks and placement, the server's own timing)
and answers the same prompt again from the restored slot (`ttft_after_restore_ms`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from ready import wait_ready

from hydra_console.engine.synth import write_synthetic


def free_port_pair() -> int:
    while True:
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port


NETNS_TOKEN = "bench-pd-netns"


def ip(*argv: str) -> None:
    done = subprocess.run(["ip", *argv], capture_output=True, text=True, timeout=10)
    if done.returncode != 0:
        raise SystemExit(f"`ip {' '.join(argv)}` failed: {done.stderr.strip()}")


class Netns:
    """A network namespace holding one end of a veth pair: `addr` inside it, `launcher` runs a
    command there. Always removed on exit."""

    def __init__(self, mtu: int | None = None):
        self.mtu = mtu

    def __enter__(self) -> Netns:
        tag = secrets.token_hex(3)  # interface names stay within 15 characters
        self.name, self.outer, inner = f"hydra-bench-{tag}", f"hbo{tag}", f"hbi{tag}"
        subnet = f"10.78.{int(tag[:2], 16)}"
        self.addr, self.launcher = f"{subnet}.2", ["ip", "netns", "exec", self.name]
        ip("netns", "add", self.name)
        try:
            for argv in [
                ("link", "add", self.outer, "type", "veth", "peer", "name", inner),
                ("link", "set", inner, "netns", self.name),
                ("addr", "add", f"{subnet}.1/24", "dev", self.outer),
                ("link", "set", self.outer, "up"),
                ("-n", self.name, "addr", "add", f"{subnet}.2/24", "dev", inner),
                ("-n", self.name, "link", "set", inner, "up"),
                ("-n", self.name, "link", "set", "lo", "up"),
            ]:
                ip(*argv)
            if self.mtu:
                ip("link", "set", self.outer, "mtu", str(self.mtu))
                ip("-n", self.name, "link", "set", inner, "mtu", str(self.mtu))
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True, timeout=10)  # takes the pair along
        subprocess.run(["ip", "link", "del", self.outer], capture_output=True, timeout=10)


def start(
    role_args: list[str], args, log_dir: Path, name: str, netns: Netns | None = None
) -> tuple[subprocess.Popen, str, int]:
    """A `serve` worker (in `netns` when given); (process, host, HTTP port), the RPC port is HTTP + 1."""
    port, host = free_port_pair(), "127.0.0.1"
    cmd = [
        sys.executable,
        "-m",
        "hydra_console.engine.cli",
        "serve",
        "--model",
        str(args.model),
        "--device",
        args.device,
        "--dtype",
        args.dtype,
        "--ctx",
        str(args.ctx),
        "--port",
        str(port),
        *role_args,
    ]
    if args.no_compile:
        cmd.append("--no-compile")
    if netns is not None:
        host = netns.addr
        cmd = [*netns.launcher, *cmd, "--host", host, "--rpc-host", host, "--auth-token", NETNS_TOKEN]
    log = open(log_dir / f"{name}.log", "wb")
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)} if args.threads else None
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    wait_ready(port, name, proc=proc, host=host)
    return proc, host, port


def stream(url: str, max_tokens: int, times: list[float], stop: threading.Event) -> None:
    """One decoding stream: the arrival time of every streamed chunk, restarted until `stop`."""
    while not stop.is_set():
        body = {
            "prompt": "once upon a time",
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    times.append(time.perf_counter())
                if stop.is_set():
                    return
        times.append(None)  # a new request: no gap across it


def long_prompt(url: str, n: int, vocab: int, rng: random.Random) -> float:
    """TTFT of a prompt of `n` random token ids (nothing cached)."""
    body = {
        "prompt": [rng.randrange(4, vocab) for _ in range(n)],
        "max_tokens": 1,
        "temperature": 0,
        "cache_prompt": False,
        "stream": True,
    }
    t0 = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                return time.perf_counter() - t0
    raise SystemExit(f"long prompt got no token: {r.status_code}")


def gaps(times: list, t0: float, t1: float) -> list[float]:
    out = []
    for a, b in zip(times, times[1:]):
        if a is not None and b is not None and t0 <= a and b <= t1:
            out.append(b - a)
    return out


def pct(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))] * 1e3


def _ok(pd: dict) -> list[dict]:
    return [t for t in pd.get("recent", []) if not t.get("fallback") and t.get("place_ms") is not None]


def run_mode(mode: str, args, log_dir: Path, netns: Netns | None) -> dict:
    procs = []
    try:
        head_args = ["--parallel", str(args.streams + 1), "--rpc-pool-size", "4"]
        if mode == "pd":
            pw, pw_host, pw_port = start(["--role", "prefill", "--parallel", "1"], args, log_dir, "prefill", netns)
            procs.append(pw)
            head_args += [
                "--prefill-worker",
                f"{pw_host}:{pw_port + 1}",
                "--prefill-threshold",
                str(args.threshold),
                "--prefill-deadline",
                str(args.prefill_deadline),
            ]
            if netns is not None:
                head_args += ["--auth-token", NETNS_TOKEN]
        head, _, port = start(head_args, args, log_dir, f"head-{mode}")
        procs.append(head)
        url = f"http://127.0.0.1:{port}"
        vocab = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["meta"]["n_vocab"]
        rng = random.Random(0)
        long_prompt(url, args.prompt_tokens, vocab, rng)  # warm the path once (both workers)
        warm = httpx.get(f"{url}/status", timeout=10).json().get("pd") or {}
        stop = threading.Event()
        times = [[] for _ in range(args.streams)]
        threads = [threading.Thread(target=stream, args=(url, args.stream_tokens, t, stop), daemon=True) for t in times]
        for t in threads:
            t.start()
        time.sleep(args.warmup_s)
        t_idle0 = time.perf_counter()
        time.sleep(args.idle_s)
        t_load0 = time.perf_counter()
        ttft = []
        while time.perf_counter() - t_load0 < args.duration_s:
            t_next = time.perf_counter() + args.every_s
            ttft.append(long_prompt(url, args.prompt_tokens, vocab, rng))
            time.sleep(max(0.0, t_next - time.perf_counter()))
        t_load1 = time.perf_counter()
        stop.set()
        idle = [g for ts in times for g in gaps(ts, t_idle0, t_load0)]
        loaded = [g for ts in times for g in gaps(ts, t_load0, t_load1)]
        status = httpx.get(f"{url}/status", timeout=10).json()
        pd = status.get("pd") or {}
        moved = {k: pd[k] - warm[k] for k in ("transfers", "bytes", "seconds")} if pd else {}
        loaded_transfers = _ok(pd)[-moved["transfers"] :] if moved.get("transfers") else []
        return {
            "mode": mode + ("+netns" if netns is not None and mode == "pd" else ""),
            "idle_itl_p50_ms": pct(idle, 50),
            "idle_itl_p99_ms": pct(idle, 99),
            "itl_p50_ms": pct(loaded, 50),
            "itl_p99_ms": pct(loaded, 99),
            "p99_over_idle": pct(loaded, 99) / pct(idle, 99) if idle and loaded else None,
            "ttft_p50_ms": pct(ttft, 50),
            "ttft_max_ms": max(ttft) * 1e3,
            "long_prompts": len(ttft),
            "transfers": pd.get("transfers"),
            "fallbacks": pd.get("fallbacks"),
            # Throughput of the transfers after the warm-up one (whose buffers are new: page faults).
            "transfer_gb_s": moved["bytes"] / moved["seconds"] / 1e9 if moved.get("seconds") else None,
            "transfer_mb_each": pd["bytes"] / pd["transfers"] / 1e6 if pd.get("transfers") else None,
            # Of each of those transfers: the prefill worker copying the state out, the move
            # (framing, the network, receiving and checking each chunk), this head placing it.
            "collect_wire_place_ms": [
                [t["collect_ms"], round(t["ms"] - t["prefill_ms"] - t["collect_ms"] - t["place_ms"], 1), t["place_ms"]]
                for t in loaded_transfers
            ],
        }
    finally:
        for p in procs:
            os.killpg(p.pid, 15)
            p.wait(timeout=30)


def run_slots(args, log_dir: Path) -> dict:
    """Restore a slot of --prompt-tokens tokens against recomputing it, on one head."""
    save_dir = log_dir / "slots"
    save_dir.mkdir(exist_ok=True)
    head, _, port = start(["--parallel", "1", "--slot-save-path", str(save_dir)], args, log_dir, "head-slots")
    try:
        url = f"http://127.0.0.1:{port}"
        vocab = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["meta"]["n_vocab"]
        rng = random.Random(1)

        def act(action, **body):
            return httpx.post(
                f"{url}/slots/0",
                params={"action": action},
                json=body or None,  # noqa: E731
                timeout=600,
            ).json()

        def complete(prompt):
            return httpx.post(
                f"{url}/v1/completions",
                json={
                    "prompt": prompt,
                    "max_tokens": 1,  # noqa: E731
                    "temperature": 0,
                    "cache_prompt": True,
                },
                timeout=600,
            ).json()

        complete([rng.randrange(4, vocab) for _ in range(64)])  # warm up
        recompute, restore, after = [], [], []
        for _ in range(args.slot_reps):
            prompt = [rng.randrange(4, vocab) for _ in range(args.prompt_tokens)]
            t0 = time.perf_counter()
            first = complete(prompt)
            ttft_fresh = time.perf_counter() - t0
            recompute.append(first["timings"]["prompt_ms"])
            saved = act("save", filename="bench.bin")
            act("erase")
            restored = act("restore", filename="bench.bin")
            assert restored["n_restored"] == saved["n_saved"], restored
            restore.append(restored["timings"]["restore_ms"])
            t0 = time.perf_counter()
            again = complete(prompt)
            after.append((time.perf_counter() - t0) * 1e3)
            assert again["timings"]["cache_n"] == args.prompt_tokens - 1, again["timings"]
        med = statistics.median
        return {
            "mode": "slots",
            "slot_tokens": saved["n_saved"],
            "slot_mb": saved["n_written"] / 1e6,
            "recompute_ms": med(recompute),
            "restore_ms": med(restore),
            "restore_speedup": med(recompute) / med(restore),
            "ttft_fresh_ms": ttft_fresh * 1e3,
            "ttft_after_restore_ms": med(after),
        }
    finally:
        os.killpg(head.pid, 15)
        head.wait(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF (default: a synthetic llama of --layers/--embd/--ff)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--embd", type=int, default=512)
    ap.add_argument("--ff", type=int, default=1536)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--streams", type=int, default=2)
    ap.add_argument("--stream-tokens", type=int, default=256)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--every-s", type=float, default=2.0)
    ap.add_argument("--duration-s", type=float, default=20.0)
    ap.add_argument("--warmup-s", type=float, default=2.0)
    ap.add_argument("--idle-s", type=float, default=5.0)
    ap.add_argument("--threshold", type=int, default=64)
    ap.add_argument(
        "--prefill-deadline",
        type=float,
        default=300.0,
        help="the head's --prefill-deadline: long, so that a slow CPU prefill is measured, not a fallback",
    )
    ap.add_argument("--modes", default="local,pd", help="comma-separated: local, pd, slots")
    ap.add_argument("--slot-reps", type=int, default=3)
    ap.add_argument("--netns", action="store_true", help="the prefill worker in its own network namespace (root)")
    ap.add_argument(
        "--mtu",
        type=int,
        default=None,
        help="with --netns: the veth pair's MTU (default the kernel's 1500; at most 65535)",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="OMP_NUM_THREADS of each worker (0: torch's default); 1 keeps a 2-core machine's head and "
        "prefill worker on a core each, as two devices would be",
    )
    ap.add_argument(
        "--no-compile",
        action="store_true",
        help="workers skip torch.compile (on a GPU each would compile every batch bucket at start)",
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.model is None:
            args.model = write_synthetic(
                tmp / "bench-pd.gguf",
                "llama",
                n_layers=args.layers,
                n_embd=args.embd,
                n_head=8,
                n_head_kv=4,
                n_ff=args.ff,
                n_ctx=args.ctx,
            )
        with Netns(args.mtu) if args.netns else contextlib.nullcontext() as netns:
            rows = [
                run_slots(args, tmp) if mode == "slots" else run_mode(mode, args, tmp, netns)
                for mode in args.modes.split(",")
            ]
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    fmt = lambda v: "—" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)  # noqa: E731
    for r in rows:
        print(" | ".join(f"{k} {fmt(v)}" for k, v in r.items()))


if __name__ == "__main__":
    main()
