"""Pipelined prefill through the engine: `serve` + one `peer`, each pinned to its own core by
`taskset`, a long prompt (token ids) through llama-server's /completion, the head started with
`--prefill-pipeline N` and with `0` in turn (the peer stays up), prompt tok/s from the response's
`timings`, and the ratio. `bench_split.py --prefill-chunk` times the same at the pipeline's level.

    python benchmarks/bench_prefill_pipeline.py [--model PATH] [--prompt 2048] [-r 3] [--rounds 2]
        [--device cuda] [--cores 0-7,8-15] [-- serve flags]

On one GPU the two processes share it (`HYDRA_CUDA_IPC=0` keeps their hidden states on the socket);
`--cores` gives each its CPUs (taskset lists, head's then peer's).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys

import httpx
from ready import wait_ready


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cores: str, *argv: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    cmd = ["taskset", "-c", cores, sys.executable, "-m", "hydra_console.engine.cli", *argv, "--port", str(port)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, port


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF (default: the embedded Gemma 3 270M)")
    ap.add_argument("--prompt", type=int, default=2048, help="prompt tokens")
    ap.add_argument("--depth", default="4", help="--prefill-pipeline of the pipelined head")
    ap.add_argument("-r", "--repetitions", type=int, default=3, help="prompts per head")
    ap.add_argument("--rounds", type=int, default=2, help="pipelined / unpipelined heads, alternating")
    ap.add_argument("--device", default="cpu", help="both processes' device")
    ap.add_argument(
        "--cores",
        default="0,1",
        help="taskset CPU lists of the head and the peer, comma-separated (one torch thread each)",
    )
    ap.add_argument("extra", nargs="*", help="more serve flags (after --), e.g. -- -b 128")
    args = ap.parse_args()
    model = ["--model", args.model] if args.model else []
    head_cores, peer_cores = args.cores.split(",")
    rpc = free_port()
    peer, peer_port = start(peer_cores, "peer", *model, "--device", args.device, "--rpc-port", str(rpc))
    prompt = None
    rates: dict[str, list[float]] = {args.depth: [], "0": []}
    try:
        wait_ready(peer_port, "peer", 300, peer)
        for _ in range(args.rounds):
            for depth in rates:
                head, port = start(
                    head_cores,
                    "serve",
                    *model,
                    "--device",
                    args.device,
                    "--peer",
                    f"127.0.0.1:{rpc}",
                    "--rpc-port",
                    str(free_port()),
                    "--parallel",
                    "1",
                    "--ctx",
                    str(args.prompt + 64),
                    "--prefill-pipeline",
                    depth,
                    *args.extra,
                )
                try:
                    wait_ready(port, "head", 300, head)
                    if prompt is None:  # token ids the model has (a synthetic vocabulary may be small)
                        meta = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=60).json()["data"][0]["meta"]
                        n_vocab = meta["n_vocab"]
                        prompt = [2] + [(i * 7919) % (n_vocab - 100) + 100 for i in range(args.prompt - 1)]
                    for _ in range(args.repetitions):
                        body = {"prompt": prompt, "n_predict": 1, "cache_prompt": False, "temperature": 0}
                        r = httpx.post(f"http://127.0.0.1:{port}/completion", json=body, timeout=900).json()
                        rates[depth].append(r["timings"]["prompt_per_second"])
                finally:
                    stop(head)
    finally:
        stop(peer)
    for depth, r in rates.items():
        print(
            f"--prefill-pipeline {depth}: prompt tok/s best {max(r):.1f}, median {statistics.median(r):.1f} ({len(r)} prompts)"
        )
    on, off = rates[args.depth], rates["0"]
    print(
        f"pipelined/unpipelined: best {max(on) / max(off):.3f}, median {statistics.median(on) / statistics.median(off):.3f}"
    )


if __name__ == "__main__":
    main()
