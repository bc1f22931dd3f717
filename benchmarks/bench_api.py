"""Benchmarks of `hydra-engine serve` through HTTP (prints numbers, asserts nothing).

1. cold start: process launch → first /health answer (port up) → /health 200 (model ready);
2. aggregate decode tok/s with 1, 4, 8 concurrent streams (`--parallel` = the largest);
3. single-stream decode through the API (client-side: tokens between first and last streamed
   chunk) against `hydra-engine bench` decode on the same model, device and dtype.

    python benchmarks/bench_api.py [--model PATH] [--device cpu] [--dtype auto] [-n 64] [--streams 1,4,8]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time

import httpx

PROMPTS = [
    "The history of the city begins",
    "In the morning the fishermen",
    "A short guide to baking bread:",
    "The committee met on Tuesday to",
    "Once upon a time in a small village",
    "The best way to learn a language is",
    "Scientists announced today that",
    "The old lighthouse keeper said",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args, parallel: int) -> tuple[subprocess.Popen, str, dict]:
    port = free_port()
    cmd = [sys.executable, "-m", "hydra_console.engine.cli", "serve", "--port", str(port), "--rpc-port",
           str(free_port()), "--parallel", str(parallel), "--ctx", str(args.ctx), "--device", args.device,
           "--dtype", args.dtype]  # fmt: skip
    if args.model:
        cmd += ["--model", args.model]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    first_answer = None
    deadline = t0 + 300
    while time.perf_counter() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited {proc.returncode}: {proc.stderr.read()}")
        try:
            r = httpx.get(f"{base}/health", timeout=5)
            first_answer = first_answer or time.perf_counter() - t0
            if r.status_code == 200:
                return proc, base, {"port_up_s": round(first_answer, 3), "ready_s": round(time.perf_counter() - t0, 3)}
        except httpx.TransportError:
            pass
        time.sleep(0.01)
    proc.kill()
    raise SystemExit("server not ready after 300 s")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()


def stream_one(base: str, prompt: str, n: int) -> dict:
    """One streamed completion; client-side timestamps of the first and last token chunks."""
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True, "ignore_eos": True}
    t_first = t_last = None
    n_chunks, final = 0, None
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            now = time.perf_counter()
            if obj["choices"][0]["finish_reason"] is None:
                n_chunks += 1
                t_first = t_first or now
                t_last = now
            else:
                final = obj
    return {"t_first": t_first, "t_last": t_last, "chunks": n_chunks, "usage": final["usage"], "timings": final["timings"]}


def concurrent(base: str, n_streams: int, n: int) -> dict:
    results: list[dict] = [None] * n_streams  # type: ignore[list-item]

    def run(i: int) -> None:
        results[i] = stream_one(base, PROMPTS[i % len(PROMPTS)], n)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(n_streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    tokens = sum(r["usage"]["completion_tokens"] for r in results)
    first = min(r["t_first"] for r in results)
    last = max(r["t_last"] for r in results)
    return {
        "streams": n_streams,
        "tokens": tokens,
        "wall_s": round(wall, 3),
        "aggregate_tok_s": round(tokens / wall, 2),
        "aggregate_decode_tok_s": round((tokens - n_streams) / (last - first), 2) if last > first else None,
        "per_stream_tok_s": round(sum(r["timings"]["predicted_per_second"] for r in results) / n_streams, 2),
    }


def engine_bench(args, n: int) -> dict:
    cmd = [sys.executable, "-m", "hydra_console.engine.cli", "bench", "--json", "-p", "16", "-n", str(n), "-r", "3",
           "--device", args.device, "--dtype", args.dtype]  # fmt: skip
    if args.model:
        cmd += ["--model", args.model]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF (default: the Gemma 3 270M package)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("-n", "--n-gen", type=int, default=64)
    ap.add_argument("--streams", default="1,4,8")
    ap.add_argument("--cold-runs", type=int, default=2)
    args = ap.parse_args()
    streams = [int(s) for s in args.streams.split(",")]
    report: dict = {"model": args.model or "default (gemma3 270m q4_k_m)", "device": args.device, "dtype": args.dtype,
                    "cpus": os.cpu_count(), "load_avg_start": os.getloadavg()[0]}  # fmt: skip

    cold = []
    for _ in range(args.cold_runs):
        proc, _, t = start(args, 1)
        stop(proc)
        cold.append(t)
    report["cold_start"] = cold

    proc, base, _ = start(args, max(streams))
    try:
        stream_one(base, PROMPTS[0], 8)  # warm-up
        report["concurrency"] = [concurrent(base, s, args.n_gen) for s in streams]
        single = stream_one(base, PROMPTS[1], args.n_gen * 2)
        api_tok_s = (single["chunks"] - 1) / (single["t_last"] - single["t_first"])
    finally:
        stop(proc)
    bench = engine_bench(args, args.n_gen * 2)
    report["single_stream"] = {
        "api_client_decode_tok_s": round(api_tok_s, 2),
        "api_engine_decode_tok_s": round(single["timings"]["predicted_per_second"], 2),
        "bench_decode_tok_s": bench["decode_tok_s"],
        "ratio_api_over_bench": round(api_tok_s / bench["decode_tok_s"], 3),
    }
    base1 = report["concurrency"][0]["aggregate_decode_tok_s"]
    for row in report["concurrency"]:
        row["speedup_vs_1"] = round(row["aggregate_decode_tok_s"] / base1, 2) if base1 else None
    report["load_avg_end"] = os.getloadavg()[0]
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
