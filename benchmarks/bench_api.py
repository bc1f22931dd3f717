"""Serving benchmarks: what `hydra-engine serve` delivers, against `hydra-engine bench` and llama.cpp.

One run, in this order (prints a table, then the JSON; asserts nothing):
1. `hydra-engine bench` decode on the same model, device and dtype: the engine's fastest path
   (torch.compile'd decode step in CUDA graphs on CUDA);
2. `serve` solo, through the real `openai` client, streaming: one stream; 1 / 8 / 64 concurrent
   streams (aggregate and per-stream decode tok/s); time to first token of a `--ttft-prompt`
   (512) token prompt on the idle server (median of `--ttft-runs`, prompt cache off; over plain
   HTTP, and through the `openai` client, which adds its own request building); each
   worker's memory from its /status (weights, KV, peak);
3. restart → READY of the same server, now with warm prepared-weight and compile caches, the median
   of `--restarts` (issue 15's target: ≤ 15 s on the 1.1B shape);
4. the same single stream and TTFT through a head + peer split on the same device (a `peer`
   process; on one GPU the head reaches it through CUDA IPC), and what the gap to solo is made
   of: `bench_split.py`'s time per part of a decode step, run on the same file (`--no-split-parts`
   skips it).

Ratios are to `bench` decode and to upstream llama.cpp: with `--llama-bench PATH`, its decode
measured in the same run on the same file and device (`llama-bench -o json`, all layers offloaded
on a GPU); without it, issue 15's numbers (an H200 with the synthetic 1.1B F16 llama: llama-bench
879 tok/s solo, its RPC split 546), comparable only on that GPU and shape. The split's llama.cpp
reference is always issue 15's. Client-side rates: tokens between the first and last streamed token of a
stream. Streams are spread over client processes (a busy client would otherwise be the bound).

    python benchmarks/bench_api.py                                 # CPU, default model, quick
    python benchmarks/bench_api.py --synthetic-llama-1b --device cuda -n 256 --ctx 2048   # issue 15's GPU run
    python benchmarks/bench_api.py ... --llama-bench build/bin/llama-bench   # llama.cpp measured beside it
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import httpx
import openai

# Upstream llama.cpp on an NVIDIA H200, synthetic 1.1B F16 llama (issue 15).
LLAMA_CPP_SOLO_TOK_S = 879.0
LLAMA_CPP_SPLIT_TOK_S = 546.0
BENCH_SPLIT = Path(__file__).with_name("bench_split.py")
# One client for the readiness polls and /status reads: `httpx.get` builds a client and an SSL
# context per call (~25 ms of CPU), which every 20 ms took half a core from the server starting.
HTTP = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))

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
ENGINE = [sys.executable, "-m", "hydra_console.engine.cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One `hydra-engine` process (serve or peer) with its stderr in a file, not a pipe nobody drains."""

    def __init__(self, argv: list[str], command: list[str] = ENGINE, rpc: bool = True):
        """`command`: what runs `argv` (another server: llama-server, given `rpc=False`: no --rpc-port)."""
        self.port, self.rpc_port = free_port(), free_port()
        self.argv = [*command, *argv, "--port", str(self.port), *(["--rpc-port", str(self.rpc_port)] if rpc else [])]
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float) -> float:
        """Launch and wait for /health 200; seconds from launch to READY."""
        self.log = tempfile.TemporaryFile("w+")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.DEVNULL, stderr=self.log, text=True)
        while time.perf_counter() < t0 + timeout:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise SystemExit(f"{' '.join(self.argv)} exited {self.proc.returncode}: {self.log.read()[-4000:]}")
            try:
                if HTTP.get(f"{self.base}/health", timeout=5).status_code == 200:
                    return time.perf_counter() - t0
            except httpx.TransportError:
                pass
            time.sleep(0.02)
        self.stop()
        raise SystemExit(f"{' '.join(self.argv)}: not ready after {timeout:.0f} s")

    def status(self) -> dict:
        return HTTP.get(f"{self.base}/status", timeout=10).json()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# ---- client side: one stream, streams in several processes -----------------------------------------


async def _stream(client: openai.AsyncOpenAI, prompt, n: int, cache: bool, start_at: float) -> dict:
    """One streamed completion (`cache`: the server's prompt cache may serve a prefix); perf_counter
    stamps (CLOCK_MONOTONIC: comparable across processes)."""
    await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
    t0 = time.perf_counter()
    stream = await client.completions.create(
        model="hydra",
        prompt=prompt,
        max_tokens=n,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "cache_prompt": cache},
    )
    t_first = t_last = None
    tokens, server = 0, {}
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.choices and (chunk.choices[0].text or chunk.choices[0].finish_reason):
            t_first = t_first or now
            if chunk.choices[0].text:
                t_last = now
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
        server = (chunk.model_extra or {}).get("timings") or server
    return {
        "t_start": t0,
        "t_first": t_first,
        "t_last": t_last or t_first,
        "t_end": time.perf_counter(),
        "tokens": tokens,
        "server_prompt_ms": server.get("prompt_ms"),
        "server_decode_tok_s": server.get("predicted_per_second"),
    }


def _client_process(base: str, jobs: list[tuple], start_at: float) -> list[dict]:
    async def run() -> list[dict]:
        limits = httpx.Limits(max_connections=len(jobs) + 4)
        async with openai.AsyncOpenAI(
            base_url=f"{base}/v1",
            api_key="none",
            max_retries=0,
            http_client=openai.DefaultAsyncHttpxClient(limits=limits, timeout=600),
        ) as client:
            return await asyncio.gather(*(_stream(client, *job, start_at) for job in jobs))

    return asyncio.run(run())


def streams(base: str, jobs: list[tuple], clients: int) -> list[dict]:
    """Run `jobs` (prompt, max_tokens, cache_prompt) at once, spread over `clients` processes started beforehand."""
    clients = max(1, min(clients, len(jobs)))
    shares = [jobs[i::clients] for i in range(clients)]
    with ProcessPoolExecutor(clients) as pool:
        list(pool.map(time.sleep, [0] * clients))  # every client process up before the clock starts
        start_at = time.perf_counter() + 0.2
        return [r for part in pool.map(_client_process, [base] * clients, shares, [start_at] * clients) for r in part]


def decode_rate(r: dict) -> float | None:
    """Client-side decode tok/s of one stream: tokens after the first over their span."""
    span = r["t_last"] - r["t_first"]
    return (r["tokens"] - 1) / span if r["tokens"] > 1 and span > 0 else None


def concurrency(base: str, n_streams: int, n: int, clients: int) -> dict:
    results = streams(base, [(PROMPTS[i % len(PROMPTS)], n, True) for i in range(n_streams)], clients)
    tokens = sum(r["tokens"] for r in results)
    wall = max(r["t_end"] for r in results) - min(r["t_start"] for r in results)
    rates = [x for x in map(decode_rate, results) if x]
    return {
        "streams": n_streams,
        "tokens": tokens,
        "wall_s": round(wall, 3),
        "aggregate_tok_s": round(tokens / wall, 2),  # prompts and queueing included
        "aggregate_decode_tok_s": round(sum(rates), 2),  # the streams' own decode rates, summed
        "per_stream_tok_s": round(statistics.mean(rates), 2) if rates else None,
        "per_stream_server_tok_s": round(statistics.mean(r["server_decode_tok_s"] for r in results), 2),
    }


def single(base: str, n: int) -> dict:
    (r,) = streams(base, [(PROMPTS[1], n, True)], 1)
    return {
        "tokens": r["tokens"],
        "client_tok_s": round(decode_rate(r), 2),
        "server_tok_s": round(r["server_decode_tok_s"], 2),
    }


def ttft_prompts(base: str, n_tokens: int, runs: int) -> list[list[int]]:
    """`runs` prompts of exactly `n_tokens` ids, each starting at a different token (no shared prefix)."""
    text = " ".join(PROMPTS)
    ids: list[int] = []
    while len(ids) < n_tokens + runs:
        text += " " + text
        ids = httpx.post(f"{base}/tokenize", json={"content": text}, timeout=60).json()["tokens"]
    return [ids[i : i + n_tokens] for i in range(runs)]


async def _raw_first_token(client: httpx.AsyncClient, base: str, prompt: list[int]) -> dict:
    """One streamed one-token completion over plain HTTP (the JSON body and SSE lines by hand)."""
    t0, t_first, server = time.perf_counter(), None, {}
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True, "cache_prompt": False}
    async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            t_first = t_first or time.perf_counter()
            server = json.loads(line[6:]).get("timings") or server
    return {"t_start": t0, "t_first": t_first, "server_prompt_ms": server.get("prompt_ms")}


def _ttft_process(base: str, prompts: list[list[int]]) -> tuple[list[dict], list[dict]]:
    """One client, one prompt at a time, each prompt twice: over plain HTTP, then through the `openai`
    client (which spends milliseconds of its own turning a list of token ids into its request body,
    before anything is sent). A first one-token request warms each client and its connection (a fresh
    process's first request also pays for imports, the pool and the TCP handshake)."""

    async def run() -> tuple[list[dict], list[dict]]:
        async with (
            httpx.AsyncClient(timeout=600) as raw,
            openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0) as client,
        ):
            await _raw_first_token(raw, base, prompts[0][:8])
            await _stream(client, prompts[0][:8], 1, False, 0.0)
            # reversed for the second: no prefix in common with the one just computed
            pairs = [
                (await _raw_first_token(raw, base, p), await _stream(client, p[::-1], 1, False, 0.0)) for p in prompts
            ]
        return [a for a, _ in pairs], [b for _, b in pairs]

    return asyncio.run(run())


def ttft(base: str, prompts: list[list[int]]) -> dict:
    """Time to first token, one prompt at a time on the idle server (prompt cache off), client-side:
    over plain HTTP (the server's share) and through the `openai` client."""
    with ProcessPoolExecutor(1) as pool:
        raw, client = pool.submit(_ttft_process, base, prompts).result()

    def ms(results: list[dict]) -> list[float]:
        return [(r["t_first"] - r["t_start"]) * 1e3 for r in results]

    return {
        "prompt_tokens": len(prompts[0]),
        "runs": len(prompts),
        "median_ms": round(statistics.median(ms(raw)), 2),
        "min_ms": round(min(ms(raw)), 2),
        "openai_median_ms": round(statistics.median(ms(client)), 2),
        "server_prompt_median_ms": round(statistics.median(r["server_prompt_ms"] for r in raw + client), 2),
    }


def memory(status: dict) -> dict:
    """A worker's memory from its /status: its stages' weights and KV, the process's device use and peak."""
    process = status.get("process") or {}
    own = [s for s in status.get("stages", []) if s.get("weight_bytes") is not None or s.get("kv_bytes") is not None]
    own = own[:1] if status.get("role") == "head" else own  # the head's other entries are its peers
    return {
        "weight_bytes": sum(s.get("weight_bytes") or 0 for s in own),
        "kv_bytes": sum(s.get("kv_bytes") or 0 for s in own),
        "peak_device_bytes": process.get("peak_device_bytes"),
        "device_bytes": process.get("gpu_memory"),
        "device_bytes_source": process.get("gpu_source"),
        "rss": process.get("rss"),
    }


# ---- the run -----------------------------------------------------------------------------------


def engine_bench(args) -> dict:
    cmd = [
        *ENGINE,
        "bench",
        "--json",
        "-p",
        "16",
        "-n",
        str(args.n_gen),
        "-r",
        "3",
        "--model",
        args.model,
        "--device",
        args.device,
        "--dtype",
        args.dtype,
    ]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"hydra-engine bench failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def llama_cpp(args) -> dict:
    """llama.cpp's decode rate: llama-bench on the same file and device when given (`tg` of n_gen
    tokens, three repetitions), else issue 15's H200 number."""
    if args.llama_bench is None:
        return {"decode_tok_s": LLAMA_CPP_SOLO_TOK_S, "source": "issue 15 (H200, synthetic 1.1B F16)"}
    cmd = [
        args.llama_bench,
        "-m",
        args.model,
        "-p",
        "0",
        "-n",
        str(args.n_gen),
        "-r",
        "3",
        "-o",
        "json",
        "-ngl",
        "99" if args.device.startswith("cuda") else "0",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"llama-bench failed: {out.stderr[-2000:]}")
    tg = [r for r in json.loads(out.stdout) if r["n_prompt"] == 0 and r["n_gen"] > 0]
    if not tg:
        raise SystemExit(f"llama-bench reported no decode test: {out.stdout[-2000:]}")
    return {
        "decode_tok_s": round(tg[0]["avg_ts"], 2),
        "stddev_tok_s": round(tg[0]["stddev_ts"], 2),
        "source": "llama-bench, this run",
        "command": " ".join(cmd),
    }


def split_parts(args) -> dict:
    """bench_split.py on the same file: split/solo decode and the median ms of each part of a step."""
    with tempfile.TemporaryDirectory() as tmp:
        out_path = Path(tmp) / "split.json"
        cmd = [
            sys.executable,
            str(BENCH_SPLIT),
            "--model",
            args.model,
            "--device",
            args.device,
            "--dtype",
            args.dtype,
            "--block",
            "16",
            "-r",
            "2",
            "--prefill",
            "0",
            "--no-resplit",
            "--json",
            str(out_path),
        ]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"bench_split.py failed: {done.stderr[-2000:]}")
        return json.loads(out_path.read_text())


def ratio(a, b) -> float | None:
    return round(a / b, 3) if a and b else None


def run(args) -> dict:
    serve = ["serve", "--model", args.model, "--device", args.device, "--dtype", args.dtype, "--ctx", str(args.ctx)]
    counts = [int(s) for s in args.streams.split(",")]
    report: dict = {
        "model": args.model,
        "device": args.device,
        "dtype": args.dtype,
        "n_gen": args.n_gen,
        "ctx": args.ctx,
        "cpus": os.cpu_count(),
        "load_avg_start": round(os.getloadavg()[0], 2),
    }
    report["llama_cpp"] = llama_cpp(args)
    print("bench …", file=sys.stderr, flush=True)
    bench = engine_bench(args)
    report["bench"] = {
        k: bench.get(k)
        for k in (
            "decode_tok_s",
            "weights",
            "weight_bytes",
            "held_weight_bytes",
            "kv_bytes",
            "estimate",
            "peak_device_bytes",
            "peak_rss",
        )
    }

    solo = Server([*serve, "--parallel", str(max(counts))])
    report["solo"] = {"first_start_ready_s": round(solo.start(args.timeout), 3)}
    try:
        single(solo.base, min(args.n_gen, 8))  # warm-up (first request's shapes, kernel choices)
        report["solo"]["single"] = single(solo.base, args.n_gen)
        report["solo"]["concurrency"] = []
        for n in counts:
            concurrency(solo.base, n, min(args.n_gen, 8), args.clients)  # warm-up: the batch size's first use
            report["solo"]["concurrency"].append(concurrency(solo.base, n, args.n_gen, args.clients))
            print(f"streams {n}: {report['solo']['concurrency'][-1]}", file=sys.stderr, flush=True)
        prompts = ttft_prompts(solo.base, args.ttft_prompt, args.ttft_runs + 1)
        ttft(solo.base, prompts[:1])  # warm-up: the prompt length's first use
        report["solo"]["ttft"] = ttft(solo.base, prompts[1:])
        status = solo.status()
        report["solo"]["memory"] = memory(status)
        report["solo"]["first_start_stages_s"] = status.get("startup_s")
    finally:
        solo.stop()
    restarts = []  # caches warm now; a start's time moves with the host, hence `--restarts`
    for _ in range(args.restarts):
        ready = round(solo.start(args.timeout), 3)
        try:  # where the restart's time went: seconds from the process's start to each startup stage
            restarts.append({"ready_s": ready, "stages_s": solo.status().get("startup_s")})
        finally:
            solo.stop()
    middle = sorted(restarts, key=lambda r: r["ready_s"])[(len(restarts) - 1) // 2]
    report["solo"]["restart_ready_s"], report["solo"]["restart_stages_s"] = middle["ready_s"], middle["stages_s"]
    report["solo"]["restarts"] = restarts
    # Without cached bytecode (PYTHONDONTWRITEBYTECODE and a torch installed without __pycache__, as
    # on the lent GPU machines) every start compiles torch's compiler stack from source: ~8 s more.
    report["solo"]["bytecode_cached"] = not sys.dont_write_bytecode
    print(f"solo: {report['solo']}", file=sys.stderr, flush=True)

    if not args.no_split:
        peer = Server(["peer", "--model", args.model, "--device", args.device, "--dtype", args.dtype])
        peer.start(args.timeout)
        n_layers = httpx.get(f"{peer.base}/status", timeout=10).json()["model"]["n_layers"]
        head = Server(
            [
                *serve,
                "--parallel",
                "1",
                "--peer",
                f"127.0.0.1:{peer.rpc_port}",
                "--split",
                f"{n_layers - n_layers // 2}/{n_layers // 2}",
            ]
        )
        try:
            report["split"] = {"ready_s": round(head.start(args.timeout), 3)}
            report["split"]["transport"] = (head.status().get("peers") or [{}])[0].get("transport")
            single(head.base, min(args.n_gen, 8))
            report["split"]["single"] = single(head.base, args.n_gen)
            ttft(head.base, prompts[:1])
            report["split"]["ttft"] = ttft(head.base, prompts[1:])
            report["split"]["memory"] = {"head": memory(head.status()), "peer": memory(peer.status())}
        finally:
            head.stop()
            peer.stop()
        if not args.no_split_parts:
            print("bench_split.py (time per part) …", file=sys.stderr, flush=True)
            report["split"]["parts"] = split_parts(args)
        print(f"split: {report['split']}", file=sys.stderr, flush=True)

    bench_tok_s = report["bench"]["decode_tok_s"]
    report["ratios"] = {
        "single_over_bench": ratio(report["solo"]["single"]["client_tok_s"], bench_tok_s),
        "single_over_llama_cpp": ratio(report["solo"]["single"]["client_tok_s"], report["llama_cpp"]["decode_tok_s"]),
        "bench_over_llama_cpp": ratio(bench_tok_s, report["llama_cpp"]["decode_tok_s"]),
    }
    if "split" in report:
        split_tok_s = report["split"]["single"]["client_tok_s"]
        report["ratios"] |= {
            "split_over_solo_single": ratio(split_tok_s, report["solo"]["single"]["client_tok_s"]),
            "split_over_bench": ratio(split_tok_s, bench_tok_s),
            "split_over_llama_cpp_split": ratio(split_tok_s, LLAMA_CPP_SPLIT_TOK_S),
        }
    report["load_avg_end"] = round(os.getloadavg()[0], 2)
    return report


def mib(mem: dict) -> tuple[str, str]:
    """A worker's memory row: weights + KV its stage holds; the process's device reading and peak, RSS."""
    f = lambda n: f"{n / (1 << 20):.1f} MiB" if n is not None else "—"  # noqa: E731
    return (
        f"{f(mem['weight_bytes'])} + KV {f(mem['kv_bytes'])}",
        f"device {f(mem['device_bytes'])} ({mem['device_bytes_source'] or '—'}), peak {f(mem['peak_device_bytes'])}; "
        f"RSS {f(mem['rss'])}",
    )


def table(report: dict) -> str:
    r, solo, bench = report["ratios"], report["solo"], report["bench"]
    ref = report["llama_cpp"]
    rows = [("llama.cpp decode (the ratios' reference)", f"{ref['decode_tok_s']:.1f} tok/s", ref["source"])]
    rows.append(
        ("hydra-engine bench decode", f"{bench['decode_tok_s']:.1f} tok/s", f"llama.cpp {r['bench_over_llama_cpp']}")
    )
    rows.append(
        (
            "serve, 1 stream (openai, streaming)",
            f"{solo['single']['client_tok_s']:.1f} tok/s",
            f"bench {r['single_over_bench']}  llama.cpp {r['single_over_llama_cpp']}",
        )
    )
    for c in solo["concurrency"]:
        rows.append(
            (
                f"serve, {c['streams']} streams",
                f"{c['aggregate_decode_tok_s']} tok/s aggregate",
                f"{c['per_stream_tok_s']} per stream; {c['aggregate_tok_s']} with prompts",
            )
        )
    rows.append(
        (
            f"serve TTFT, {solo['ttft']['prompt_tokens']}-token prompt (HTTP)",
            f"{solo['ttft']['median_ms']} ms",
            f"median of {solo['ttft']['runs']}; openai client {solo['ttft']['openai_median_ms']} ms; "
            f"server prompt {solo['ttft']['server_prompt_median_ms']} ms",
        )
    )
    rows.append(
        (
            "serve start → READY",
            f"{solo['first_start_ready_s']} s",
            f"restart (warm caches) {solo['restart_ready_s']} s"
            + (
                f" (median of {', '.join(str(r['ready_s']) for r in solo['restarts'])})"
                if len(solo["restarts"]) > 1
                else ""
            )
            + (
                ""
                if solo["bytecode_cached"]
                else "; PYTHONDONTWRITEBYTECODE is set: every start compiles Python sources"
            ),
        )
    )
    for when in ("first_start", "restart"):
        rows.append(
            (
                f"  {when.replace('_', ' ')}: stage reached at",
                "",
                ", ".join(f"{k} {v} s" for k, v in (solo[f"{when}_stages_s"] or {}).items()),
            )
        )
    rows.append(("serve memory", *mib(solo["memory"])))
    if "split" in report:
        sp = report["split"]
        rows.append(
            (
                f"head + peer, 1 stream ({sp['transport']})",
                f"{sp['single']['client_tok_s']:.1f} tok/s",
                f"solo {r['split_over_solo_single']}  llama.cpp split {r['split_over_llama_cpp_split']}",
            )
        )
        rows.append(
            (
                "head + peer TTFT (HTTP)",
                f"{sp['ttft']['median_ms']} ms",
                f"openai client {sp['ttft']['openai_median_ms']} ms; server prompt {sp['ttft']['server_prompt_median_ms']} ms",
            )
        )
        for role in ("head", "peer"):
            rows.append((f"  {role} memory", *mib(sp["memory"][role])))
        if "parts" in sp:
            for mode in ("solo", "split"):
                parts = sp["parts"]["decode_parts_ms"][mode]
                rows.append(
                    (
                        f"  {mode} decode step parts (bench_split)",
                        f"{parts['total']:.3f} ms",
                        ", ".join(f"{k} {v:.3f}" for k, v in parts.items() if k != "total"),
                    )
                )
            solo_ms, split_ms = (sp["parts"]["decode_parts_ms"][m] for m in ("solo", "split"))
            exchange = sum(
                split_ms[k] - split_ms[k.replace("round trip", "compute")] for k in split_ms if "round trip" in k
            )
            rows.append(
                (
                    "  split step - solo step",
                    f"{split_ms['total'] - solo_ms['total']:.3f} ms",
                    f"exchange (round trips - peer compute) {exchange:.3f} ms, the rest: compute in two processes",
                )
            )
    w = max(len(a) for a, _, _ in rows)
    v = max(len(b) for _, b, _ in rows)
    return "\n".join(f"{a:<{w}}  {b:>{v}}  {c}" for a, b, c in rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF (default: the Gemma 3 270M package)")
    ap.add_argument(
        "--synthetic-llama-1b",
        action="store_true",
        help="write and serve issue 15's random-weight 1.1B llama (hidden 2048, 16 layers, 32/8 heads, "
        "FFN 8192, vocab 32000, F16)",
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--ctx", type=int, default=1024, help="context per slot (≥ the TTFT prompt + 1)")
    ap.add_argument("-n", "--n-gen", type=int, default=32, help="tokens per stream")
    ap.add_argument(
        "--streams", default="1,8,64", help="concurrent stream counts (the server gets --parallel = the largest)"
    )
    ap.add_argument("--clients", type=int, default=max(1, (os.cpu_count() or 2) // 4), help="client processes")
    ap.add_argument("--ttft-prompt", type=int, default=512, help="prompt tokens of the TTFT test")
    ap.add_argument("--ttft-runs", type=int, default=5)
    ap.add_argument(
        "--llama-bench",
        default=None,
        metavar="PATH",
        help="llama.cpp's llama-bench: its decode on the same file and device is the ratios' reference",
    )
    ap.add_argument("--no-split", action="store_true", help="skip the head + peer section")
    ap.add_argument("--no-split-parts", action="store_true", help="skip bench_split.py's time per part")
    ap.add_argument("--restarts", type=int, default=1, help="warm restarts timed (the table shows the median's stages)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds a worker may take to become ready")
    ap.add_argument("--json", dest="json_path", default=None, help="also write the JSON report to this file")
    args = ap.parse_args()
    if args.ctx <= args.ttft_prompt:
        ap.error(f"--ctx {args.ctx} must exceed --ttft-prompt {args.ttft_prompt}")
    if args.restarts < 1:
        ap.error(f"--restarts must be at least 1, got {args.restarts}")
    tmp = tempfile.TemporaryDirectory()
    if args.synthetic_llama_1b:
        from hydra_console.engine.synth import write_synthetic

        args.model = str(
            write_synthetic(
                Path(tmp.name) / "llama-1b.gguf",
                "llama",
                n_layers=16,
                n_embd=2048,
                n_head=32,
                n_head_kv=8,
                n_ff=8192,
                vocab_size=32000,
                n_ctx=8192,
                qtype="F16",
            )
        )
    elif args.model is None:
        from hydra_console.engine.default_model import default_model_path

        args.model = str(default_model_path())
    report = run(args)
    print(table(report))
    print(json.dumps(report, indent=2))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
