"""A completion flood against `hydra-engine serve` with its queue bound (issue 13, HTTP part).

Fires `--requests` completions at `--concurrency` at once and polls /health every 50 ms meanwhile.
Every request must end as a 200, or a 503 with Retry-After: anything else (another code, a 503
without Retry-After, an error or a timeout) is a lost request. Prints one JSON object: lost
(must be 0), counts per status, latency p50/p99 of the 200s and of the 503s, /health p99.

    python benchmarks/attack_http.py [--model PATH] [--parallel 2] [--max-queue 64] [--requests 200] [--concurrency 200]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
from bench_api import start, stop


def pct(xs: list[float], q: float) -> float | None:
    return round(statistics.quantiles(xs, n=100)[q - 1] if len(xs) > 1 else xs[0], 4) if xs else None


async def flood(base: str, args) -> dict:
    limits = httpx.Limits(max_connections=args.concurrency + 1, max_keepalive_connections=args.concurrency + 1)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:
        gate = asyncio.Semaphore(args.concurrency)
        done = asyncio.Event()

        async def one(i: int) -> tuple[str, float]:
            body = {
                "prompt": f"Request {i}: tell a story",
                "max_tokens": args.max_tokens,
                "temperature": 0,
                "ignore_eos": True,
            }
            async with gate:
                t0 = time.perf_counter()
                try:
                    r = await client.post(f"{base}/v1/completions", json=body)
                except httpx.HTTPError as e:
                    return f"lost: {type(e).__name__}", time.perf_counter() - t0
                dt = time.perf_counter() - t0
                if r.status_code == 200 or (r.status_code == 503 and r.headers.get("Retry-After")):
                    return str(r.status_code), dt
                return f"lost: HTTP {r.status_code}", dt

        async def health() -> list[float]:
            out = []
            while not done.is_set():
                t0 = time.perf_counter()
                await client.get(f"{base}/health")
                out.append(time.perf_counter() - t0)
                await asyncio.sleep(0.05)
            return out

        poll = asyncio.create_task(health())
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(i) for i in range(args.requests)))
        wall = time.perf_counter() - t0
        done.set()
        health_s = await poll
    counts = Counter(k for k, _ in results)
    lat = {k: [dt for kk, dt in results if kk == k] for k in ("200", "503")}
    return {
        "requests": args.requests,
        "concurrency": args.concurrency,
        "parallel": args.parallel,
        "max_queue": args.max_queue,
        "max_tokens": args.max_tokens,
        "wall_s": round(wall, 2),
        "lost": sum(n for k, n in counts.items() if k.startswith("lost")),
        "counts": dict(counts),
        "latency_200_p50_s": pct(lat["200"], 50),
        "latency_200_p99_s": pct(lat["200"], 99),
        "latency_503_p50_s": pct(lat["503"], 50),
        "latency_503_p99_s": pct(lat["503"], 99),
        "health_polls": len(health_s),
        "health_p99_s": pct(health_s, 99),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF (default: a tiny synthetic llama)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--max-queue", type=int, default=64)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--timeout", type=float, default=600.0, help="per request: past it, the request counts as lost")
    args = ap.parse_args()
    if args.model is None:
        from hydra_console.engine.synth import write_synthetic

        args.model = str(write_synthetic(Path(tempfile.mkdtemp()) / "tiny-llama.gguf", "llama"))
    proc, base, _ = start(args, args.parallel, ("--max-queue", str(args.max_queue)))
    try:
        print(json.dumps({"model": args.model, **asyncio.run(flood(base, args))}, indent=1))
    finally:
        stop(proc)


if __name__ == "__main__":
    main()
