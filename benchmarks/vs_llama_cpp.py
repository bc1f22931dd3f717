"""Hydra against upstream llama.cpp's server, side by side on one file and one device (issue 38).

    python benchmarks/vs_llama_cpp.py --llama-cpp DIR --model M.gguf [--spec mtp] [--streams 1,4]
        [--ctx 8192] [-n 256] [--prompt-tokens 4096] [--cache-type q8_0] [--device cuda] [-- serve flags]

Starts `llama-server` (DIR/bin/llama-server or DIR/llama-server) and `hydra-engine serve` in turn,
each with the same context, slots (the largest stream count), KV type and unified KV pool; with
`--spec mtp` each server is started twice, without speculation and with MTP drafting (llama.cpp:
`--spec-type draft-mtp --spec-draft-n-max K --draft-p-min 0`; ours: `--spec-type mtp --draft-max K
--draft-p-min 0`). One client drives both (benchmarks/bench_api.py's: the `openai` client, streams
spread over processes, temperature 0, ignore_eos): per server, seconds to READY, its process's
device memory after the runs (NVML), time to first token of a `--prompt-tokens` prompt on the idle
server (median of 3, prompt cache off) and the prompt rate it implies, and per stream count the
summed decode rate of the streams; with MTP, the acceptance the server reports (`timings.draft_n`,
`draft_n_accepted` summed over the prompts' `/completion`s, greedy and at `--sampled-acceptance`
temperature with fixed seeds). For ours also where a start went (`startup_s`), how the passes over
the layers ran (`steps`) and, per stream count, an average step's milliseconds by phase
(`step_ms_N`: schedule with drafting, forward, read, emit; `decode_step_ms_N`: of the steps that held
no prompt rows; `steps_N`: their passes over the layers by path). Prints a table of both and their ratio
(ours / llama.cpp; higher is better except for time and memory), then the JSON. Asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import httpx
from bench_api import PROMPTS, Server, concurrency, ttft_prompts  # benchmarks/ is the script's directory

from hydra_console.contracts.gguf_header import GGUFHeader
from hydra_console.contracts.status import Throughput


def llama_server(root: str) -> list[str]:
    for candidate in (Path(root) / "bin" / "llama-server", Path(root) / "llama-server"):
        if candidate.exists():
            return [str(candidate)]
    raise SystemExit(f"no llama-server under {root} (bin/llama-server or llama-server)")


def flags(engine: str, args, spec: bool) -> list[str]:
    """The same setting, spelled for each server."""
    slots = max(args.streams)
    common = ["-c", str(args.ctx * slots), "-np", str(slots), "-ctk", args.cache_type, "-ctv", args.cache_type]
    if engine == "llama.cpp":
        gpu = ["-ngl", "99"] if args.device.startswith("cuda") else ["-ngl", "0"]
        mtp = ["--spec-type", "draft-mtp", "--spec-draft-n-max", str(args.draft_max), "--draft-p-min", "0"]
        return ["-m", args.model, *gpu, *common, "-kvu", *(mtp if spec else [])]
    mtp = ["--spec-type", "mtp", "--draft-max", str(args.draft_max), "--draft-p-min", "0"]
    serve = ["serve", "--model", args.model, "--device", args.device, *common, "--kv-unified"]
    return [*serve, *(mtp if spec else []), *args.hydra_flags]


def device_memory(pid: int) -> int | None:
    """The process's bytes on the GPU as NVML reports them (the CUDA context included)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        for i in range(pynvml.nvmlDeviceGetCount()):
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(pynvml.nvmlDeviceGetHandleByIndex(i)):
                if proc.pid == pid:
                    return proc.usedGpuMemory
    except Exception:  # no NVML here (a CPU run): the column stays empty
        return None
    return None


def acceptance(base: str, n: int, temperature: float = 0.0) -> dict:
    """Drafts made and taken over `PROMPTS` (each `n` tokens), greedy or sampled at `temperature`
    with a fixed seed per prompt (the same on both servers)."""
    drafted = accepted = 0
    for i, prompt in enumerate(PROMPTS):
        body = {"prompt": prompt, "n_predict": n, "temperature": temperature, "seed": 1000 + i, "ignore_eos": True}
        # the same sampler on both: llama-server's defaults (top-k 40, top-p 0.95, min-p 0.05) are not ours
        body |= {"top_k": 0, "top_p": 1.0, "min_p": 0.0}
        t = httpx.post(f"{base}/completion", json=body | {"cache_prompt": False}, timeout=600).json().get("timings", {})
        drafted += t.get("draft_n") or 0
        accepted += t.get("draft_n_accepted") or 0
    return {"drafted": drafted, "accepted": accepted, "rate": round(accepted / drafted, 3) if drafted else None}


def step_phases(before: dict, after: dict, decode_only: bool = False) -> dict | None:
    """Milliseconds an average step spent in each phase between two /status `throughput`s (schedule:
    drafting included; forward: queueing the layers; read: waiting for the tokens; emit), and how
    many steps; `decode_only`: of the steps that held no prompt rows."""
    before, after = Throughput.from_json(before), Throughput.from_json(after)
    ms = after.step_ms_since(before, decode_only)
    if ms is None:
        return None
    return {k: round(v, 2) for k, v in ms.items()} | {"steps": after.steps_since(before, decode_only)}


def step_paths(before: dict, after: dict) -> dict:
    """The head stage's passes over its layers between two /status answers, by path (a graph
    replayed, or eager and why)."""
    was = before["stages"][0].get("steps") or {}
    now = after["stages"][0].get("steps") or {}
    return {path: n - was.get(path, 0) for path, n in now.items() if n > was.get(path, 0)}


def measure(engine: str, args, spec: bool) -> dict:
    theirs = engine == "llama.cpp"
    server = Server(flags(engine, args, spec), *((llama_server(args.llama_cpp), False) if theirs else ()))
    out = {"ready_s": round(server.start(timeout=args.timeout), 1)}
    try:
        if not theirs:  # where our start went: /status's phases, seconds from the process's start
            out["startup_s"] = server.status().get("startup_s")
        if not spec:  # the prompt does not depend on drafting
            prompts = ttft_prompts(server.base, args.prompt_tokens, 3)
            concurrency(server.base, 1, 8, 1)  # warm: the first request of a process pays for more than its tokens
            ms = []
            for p in prompts:
                r = httpx.post(
                    f"{server.base}/v1/completions",
                    json={"prompt": p, "max_tokens": 1, "temperature": 0, "cache_prompt": False},
                    timeout=600,
                )
                if r.status_code == 200:
                    ms.append(r.elapsed.total_seconds() * 1e3)
                else:  # said, and the other measurements still run
                    out["ttft_error"] = f"{r.status_code} {r.text[:300]}"
            if ms:
                out["ttft_ms"] = round(statistics.median(ms), 1)
                out["prompt_tok_s"] = round(args.prompt_tokens / statistics.median(ms) * 1e3, 1)
        else:
            concurrency(server.base, 1, 8, 1)
            out["acceptance"] = acceptance(server.base, args.n)
            if args.sampled_acceptance:
                out["acceptance_t"] = acceptance(server.base, args.n, args.sampled_acceptance)
        for s in args.streams:
            before = None if theirs else server.status()
            runs = [concurrency(server.base, s, args.n, min(s, 8)) for _ in range(args.reps)]
            out[f"decode_{s}"] = max(r["aggregate_decode_tok_s"] for r in runs)
            if not theirs:  # where our steps' wall time went meanwhile: ms a step, by phase, and their paths
                after = server.status()
                out[f"step_ms_{s}"] = step_phases(before["throughput"], after["throughput"])
                out[f"decode_step_ms_{s}"] = step_phases(before["throughput"], after["throughput"], decode_only=True)
                out[f"steps_{s}"] = step_paths(before, after)
        out["device_gib"] = None if (b := device_memory(server.proc.pid)) is None else round(b / 2**30, 2)
        if not theirs:  # how our passes over the layers ran: graphs replayed, or eager and why
            out["steps"] = server.status()["stages"][0].get("steps")
    finally:
        server.stop()
    return out


def table(results: dict) -> None:
    rows = []
    for mode, by_engine in results.items():
        theirs, ours = by_engine.get("llama.cpp", {}), by_engine.get("hydra", {})
        for key in sorted(set(theirs) | set(ours)):
            a, b = theirs.get(key), ours.get(key)
            if "error" in key:
                continue
            if isinstance(a, dict) or isinstance(b, dict):
                if "rate" not in (a or b):  # startup phases, step paths and phases: in the JSON below
                    continue
                a, b, key = a and a.get("rate"), b and b.get("rate"), key + "_rate"
            ratio = round(b / a, 2) if isinstance(a, int | float) and isinstance(b, int | float) and a else None
            rows.append((mode, key, a, b, ratio))
    print(f"{'mode':6s} {'metric':16s} {'llama.cpp':>10s} {'hydra':>10s} {'ratio':>6s}")
    for mode, key, a, b, ratio in rows:
        print(f"{mode:6s} {key:16s} {a!s:>10s} {b!s:>10s} {ratio!s:>6s}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-cpp", required=True, help="llama.cpp's build directory (with bin/llama-server)")
    ap.add_argument("--model", required=True)
    ap.add_argument("--spec", choices=["mtp"], help="also compare MTP drafting")
    ap.add_argument("--draft-max", type=int, default=3)
    ap.add_argument("--no-plain", action="store_true", help="with --spec: its runs only (no plain decode server)")
    ap.add_argument("--streams", type=lambda s: [int(x) for x in s.split(",")], default=[1])
    ap.add_argument("--ctx", type=int, default=8192, help="context per slot")
    ap.add_argument("-n", type=int, default=256, help="tokens per stream")
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--cache-type", default="q8_0", help="KV cache type of both servers (K and V)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--reps", type=int, default=2, help="runs per stream count; the best is kept")
    ap.add_argument("--timeout", type=float, default=600, help="seconds a server may take to be ready")
    ap.add_argument(
        "--sampled-acceptance",
        type=float,
        default=0.7,
        metavar="T",
        help="with --spec: also the acceptance sampled at temperature T, fixed seeds (0: greedy only)",
    )
    ap.add_argument("--only", choices=["llama.cpp", "hydra"], help="one server only (its column alone)")
    args, extra = ap.parse_known_args()
    args.hydra_flags = [a for a in extra if a != "--"]
    engines = [e for e in ("llama.cpp", "hydra") if args.only in (None, e)]
    header = GGUFHeader(args.model)
    trained = header.get(f"{header.architecture}.context_length")
    if "llama.cpp" in engines and trained and trained < max(args.ctx, args.prompt_tokens + 1):
        # llama-server caps a slot at the file's training context: its TTFT would be a 400
        raise SystemExit(
            f"{args.model} says its training context is {trained} tokens, under --ctx {args.ctx} / "
            f"--prompt-tokens {args.prompt_tokens}: llama-server caps a slot there (write the file with a "
            "larger n_ctx, e.g. write_synthetic(..., n_ctx=262144))"
        )
    results: dict[str, dict] = {}
    modes = (["mtp"] if args.no_plain else ["plain", "mtp"]) if args.spec else ["plain"]
    for mode in modes:
        for engine in engines:
            results.setdefault(mode, {})[engine] = measure(engine, args, mode == "mtp")
            print(json.dumps({"mode": mode, "engine": engine, **results[mode][engine]}), flush=True)
    table(results)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
