"""Benchmarks of `hydra-engine serve` through HTTP (prints numbers, asserts nothing).

1. cold start: process launch → first /health answer (port up) → /health 200 (model ready);
2. aggregate decode tok/s with 1, 4, 8 concurrent streams (`--parallel` = the largest);
3. single-stream decode through the API (client-side: tokens between first and last streamed
   chunk) against `hydra-engine bench` decode on the same model, device and dtype.

    python benchmarks/bench_api.py [--model PATH] [--device cpu] [--dtype auto] [-n 64] [--streams 1,4,8]
    python benchmarks/bench_api.py --synthetic-llama-1b --device cuda   # the issue's GPU shape
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

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


def start(args, parallel: int, extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str, dict]:
    port = free_port()
    cmd = [sys.executable, "-m", "hydra_console.engine.cli", "serve", "--port", str(port), "--rpc-port",
           str(free_port()), "--parallel", str(parallel), "--ctx", str(args.ctx), "--device", args.device,
           "--dtype", args.dtype, *extra]  # fmt: skip
    if args.model:
        cmd += ["--model", args.model]
    t0 = time.perf_counter()
    # stderr to a file, not a pipe nobody drains: the head logs a line per request.
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, text=True)
    base = f"http://127.0.0.1:{port}"
    first_answer = None
    deadline = t0 + 300
    while time.perf_counter() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise SystemExit(f"server exited {proc.returncode}: {log.read()[-4000:]}")
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


def scheduling(args, n_long: int = 512, n_streams: int = 4) -> list[dict]:
    """In-process: `n_streams` greedy streams decode while an `n_long`-token prompt arrives. Mixed
    steps (prefill chunks ride with the decode tokens) against prefill-only steps (nano-vllm)."""
    from hydra_console.engine.default_model import default_model_path
    from hydra_console.engine.gguf_file import GGUFFile
    from hydra_console.engine.pipeline import Pipeline
    from hydra_console.engine.config import default_cache_dir
    from hydra_console.engine.model import build_stage
    from hydra_console.engine.runtime import Engine, Request
    from hydra_console.engine.sampling import SamplingParams
    from hydra_console.engine.tokenizer import Tokenizer

    g = GGUFFile(args.model or default_model_path())
    tok = Tokenizer.from_gguf(g)
    stage = build_stage(g, device=args.device, dtype=args.dtype, n_slots=n_streams + 1, n_ctx=args.ctx,
                        cache_dir=default_cache_dir(os.environ))  # fmt: skip
    long_prompt = (tok.encode(" ".join(PROMPTS) * 40))[:n_long]

    def one(mixed: bool) -> dict:
        engine = Engine(Pipeline(stage), tok, n_streams + 1, args.ctx, mixed_steps=mixed).start()
        stamps: list[list[float]] = [[] for _ in range(n_streams)]

        def decode(i: int) -> None:
            req = Request(tok.encode(PROMPTS[i]), SamplingParams(temperature=0.0), max_tokens=args.n_gen,
                          ignore_eos=True)  # fmt: skip
            for ev in engine.generate(req):
                if ev.tokens:
                    stamps[i].append(time.perf_counter())

        threads = [threading.Thread(target=decode, args=(i,)) for i in range(n_streams)]
        for t in threads:
            t.start()
        while min(len(s) for s in stamps) < 8:
            time.sleep(0.001)
        t_submit = time.perf_counter()
        first = None
        for ev in engine.generate(Request(long_prompt, SamplingParams(temperature=0.0), max_tokens=4, ignore_eos=True)):
            first = first or (time.perf_counter() if ev.tokens else None)
        for t in threads:
            t.join()
        engine.stop()
        gaps = [b - a for s in stamps for a, b in zip(s, s[1:]) if b > t_submit]
        span = max(s[-1] for s in stamps) - min(s[0] for s in stamps)
        return {
            "mixed_steps": mixed,
            "long_prompt_ttft_ms": round((first - t_submit) * 1e3, 1),
            "decode_max_gap_ms": round(max(gaps) * 1e3, 1),
            "decode_aggregate_tok_s": round(sum(len(s) - 1 for s in stamps) / span, 2),
        }  # fmt: skip

    one(True), one(False)  # warm-up: first use of each batch shape (kernel choice, CUDA graph capture)
    return [one(True), one(False)]


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
    ap.add_argument("--scheduling", action="store_true",
                    help="only compare mixed prefill+decode steps against prefill-only steps (in-process)")  # fmt: skip
    ap.add_argument("--synthetic-llama-1b", action="store_true",
                    help="write and serve a random-weight llama of 1.1B parameters (hidden 2048, 16 layers, "
                         "32 heads, 8 KV heads, FFN 8192, vocab 32000, F16)")  # fmt: skip
    args = ap.parse_args()
    if args.synthetic_llama_1b:
        from hydra_console.engine.synth import write_synthetic

        args.model = str(write_synthetic(Path(tempfile.mkdtemp()) / "llama-1b.gguf", "llama", n_layers=16, n_embd=2048,
                                         n_head=32, n_head_kv=8, n_ff=8192, vocab_size=32000, n_ctx=4096, qtype="F16"))  # fmt: skip
    if args.scheduling:
        print(json.dumps(scheduling(args), indent=2))
        return
    streams = [int(s) for s in args.streams.split(",")]
    report: dict = {"model": args.model or "default (gemma3 270m q4_k_m)", "device": args.device, "dtype": args.dtype,
                    "cpus": os.cpu_count(), "load_avg_start": os.getloadavg()[0]}  # fmt: skip

    cold = []
    for _ in range(args.cold_runs):
        proc, _, t = start(args, 1)
        stop(proc)
        cold.append(t)
        print(f"cold start {len(cold)}: {t}", file=sys.stderr, flush=True)  # progress: compiles can be slow
    report["cold_start"] = cold

    proc, base, _ = start(args, max(streams))
    try:
        report["concurrency"] = []
        for n in streams:
            concurrent(base, n, 8)  # warm-up: first use of a batch size (CUDA graph capture)
            report["concurrency"].append(concurrent(base, n, args.n_gen))
            print(f"streams {n}: {report['concurrency'][-1]}", file=sys.stderr, flush=True)
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
