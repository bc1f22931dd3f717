"""Embedding throughput of a head (`--embedding`): N inputs in one /v1/embeddings request (they share
forwards, at most --parallel at once) against the same N one request at a time, and optionally the
same against upstream llama-server on the same file. Prints one JSON line per server.

    python benchmarks/bench_embeddings.py [--model GGUF] [--inputs 16] [--parallel 4] [--device cpu]
        [--llama-server /work/llama-cpp/bin/llama-server]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
from ready import wait_ready

TEXT = "Embeddings from the same model: the final hidden state after the output norm, pooled and normalised. "


def measure(port: int, inputs: list[str]) -> dict:
    url = f"http://127.0.0.1:{port}/v1/embeddings"
    post = lambda body: httpx.post(url, json=body, timeout=600).json()  # noqa: E731

    def timed() -> tuple[dict, float, float]:
        t0 = time.perf_counter()
        batched = post({"input": inputs})
        t1 = time.perf_counter()
        for text in inputs:
            post({"input": text})
        return batched, t1 - t0, time.perf_counter() - t1

    timed()  # warm-up: the CPU GEMM libraries build kernels per new row count on first use
    batched, t_batched, t_single = timed()
    tokens = batched["usage"]["prompt_tokens"]
    return {
        "inputs": len(inputs),
        "tokens": tokens,
        "batched_s": round(t_batched, 3),
        "batched_tok_s": round(tokens / t_batched, 1),
        "one_by_one_s": round(t_single, 3),
        "one_by_one_tok_s": round(tokens / t_single, 1),
    }


def run(argv: list[str], port: int, what: str, inputs: list[str], env=None) -> dict:
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        wait_ready(port, what, proc=proc)
        return {"server": what, **measure(port, inputs)}
    finally:
        proc.terminate()
        proc.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--inputs", type=int, default=16)
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--pooling", default="mean")
    ap.add_argument("--port", type=int, default=18961)
    ap.add_argument("--llama-server", default=None, help="also measure upstream llama-server on the same file")
    args = ap.parse_args()
    from hydra_console.engine.default_model import model_path

    model = str(model_path(args.model))
    inputs = [f"{i}: {TEXT * (1 + i % 4)}" for i in range(args.inputs)]
    hydra = [
        sys.executable,
        "-m",
        "hydra_console.engine.cli",
        "serve",
        "--model",
        model,
        "--port",
        str(args.port),
        "--rpc-port",
        str(args.port + 1),
        "--device",
        args.device,
        "--dtype",
        args.dtype,
        "--ctx",
        "1024",
        "--parallel",
        str(args.parallel),
        "--embedding",
        "--pooling",
        args.pooling,
    ]
    print(json.dumps(run(hydra, args.port, "hydra", inputs)))
    if args.llama_server:
        env = {**os.environ, "LD_LIBRARY_PATH": str(Path(args.llama_server).parent)}
        upstream = [
            args.llama_server,
            "-m",
            model,
            "--port",
            str(args.port + 2),
            "--embedding",
            "--pooling",
            args.pooling,
            "-c",
            str(1024 * args.parallel),
            "-np",
            str(args.parallel),
        ]
        print(json.dumps(run(upstream, args.port + 2, "llama-server", inputs, env)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
