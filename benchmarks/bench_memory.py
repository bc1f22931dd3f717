"""The split editor's memory estimate against what each worker process really takes (issue 14 item 4).

Starts `serve` (and with `--split`, a `peer` on the same device), sends one prompt of
`--prompt` tokens (what a served prompt allocates: a CPU layer's prefill copy, prefill
activations), then prints per process: the estimate of contracts/footprint.py for its layers,
flags and device (what the console's split editor shows: weights + KV as held, and on a GPU the
work memory and the CUDA runtime), the stage's held bytes as it counts them (/status: weights +
KV), torch's peak reservation, and NVML's per-process reading. A bare torch process's reading is
measured first and printed beside them: on a GPU, the context alone, which the estimate's runtime
term (context + loaded kernels) must exceed; on a CPU, the interpreter and torch, which the
estimate leaves out (est+base). Prints numbers, asserts nothing.

    python benchmarks/bench_memory.py --synthetic-llama-1b --device cuda --ctx 8192 --parallel 4
    python benchmarks/bench_memory.py --model 26b-q5_k.gguf --device cuda --split 40/24 \\
        --cache-type-k q8_0 --cache-type-v q8_0 --ctx 8192 --parallel 1     # issue 14's pair on one GPU
    python benchmarks/bench_memory.py --device cpu                          # default model, RSS instead of NVML
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
from bench_api import Server  # benchmarks/ is the script's own folder

from hydra_console.contracts.footprint import model_tensors
from hydra_console.engine.gguf_file import GGUFFile

# What a process that has only imported torch takes: its RSS on a CPU; on a GPU, NVML's reading
# once torch has initialised CUDA (the context, which no estimate of tensors holds).
_CPU_PROBE = "import psutil, torch; print(psutil.Process().memory_info().rss)"
_CUDA_PROBE = """
import os, torch, pynvml
torch.zeros(1, device="cuda")
pynvml.nvmlInit()
h = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
print(sum(p.usedGpuMemory or 0 for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h) if p.pid == os.getpid()))
"""


def baseline_bytes(device_kind: str) -> int | None:
    done = subprocess.run(
        [sys.executable, "-c", _CUDA_PROBE if device_kind == "cuda" else _CPU_PROBE], capture_output=True, text=True
    )
    return int(done.stdout.strip()) if done.returncode == 0 and done.stdout.strip().isdigit() else None


def gib(n) -> str:
    return f"{n / (1 << 30):8.3f}" if n is not None else "       —"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--synthetic-llama-1b", action="store_true", help="issue 15's 1.1B llama shape")
    ap.add_argument("--qtype", default="F16", help="weight type of the synthetic model (e.g. Q4_K_M, Q5_K)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--parallel", type=int, default=1)
    ap.add_argument("--split", default=None, help="head/peer layer counts, e.g. 40/24: also run a peer")
    ap.add_argument("--cache-type-k", default="auto")
    ap.add_argument("--cache-type-v", default="auto")
    ap.add_argument("--gpu-weights", default="quantized")
    ap.add_argument("--prompt", type=int, default=512, help="tokens of the one prompt sent before reading")
    args = ap.parse_args()
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
                qtype=args.qtype,
            )
        )
    elif args.model is None:
        from hydra_console.engine.default_model import default_model_path

        args.model = str(default_model_path())
    g = GGUFFile(args.model)
    tensors = model_tensors(g.metadata, g.tensors)
    flags = [
        "--model",
        args.model,
        "--device",
        args.device,
        "--dtype",
        args.dtype,
        "--cache-type-k",
        args.cache_type_k,
        "--cache-type-v",
        args.cache_type_v,
        "--gpu-weights",
        args.gpu_weights,
    ]
    counts = [int(c) for c in args.split.split("/")] if args.split else [tensors.n_layers]
    bounds = [sum(counts[:i]) for i in range(len(counts) + 1)]
    device_kind = "cuda" if args.device.startswith("cuda") or args.device == "auto" and _has_cuda() else "cpu"
    baseline = baseline_bytes(device_kind)

    peer = Server(["peer", *flags]) if args.split else None
    servers: list[tuple[str, Server]] = []
    try:
        if peer:
            peer.start(900)
        extra = ["--peer", f"127.0.0.1:{peer.rpc_port}", "--split", args.split] if peer else []
        head = Server(["serve", *flags, "--ctx", str(args.ctx), "--parallel", str(args.parallel), *extra])
        head.start(900)
        servers = [("head", head)] + ([("peer", peer)] if peer else [])
        prompt = list(range(1, args.prompt + 1))
        httpx.post(
            f"{head.base}/v1/completions", json={"prompt": prompt, "max_tokens": 4}, timeout=600
        ).raise_for_status()
        rows = []
        for i, (role, server) in enumerate(servers):
            st = server.status()
            stage = next(s for s in st["stages"] if s.get("weight_bytes") is not None)
            est = tensors.stage(
                bounds[i],
                bounds[i + 1],
                head=i == 0,
                device=device_kind,
                dtype=args.dtype,
                n_slots=args.parallel,
                n_ctx=args.ctx,
                kv_types=(args.cache_type_k, args.cache_type_v),
                gpu_weights=args.gpu_weights,
            )
            proc = st.get("process") or {}
            reading = proc.get("gpu_memory") if device_kind == "cuda" else proc.get("rss")
            rows.append(
                {
                    "role": role,
                    "layers": [bounds[i], bounds[i + 1]],
                    "estimate_weights": est.weight_bytes,
                    "estimate_kv": est.kv_bytes,
                    "estimate_work": est.work_bytes,
                    "estimate_runtime": est.runtime_bytes,
                    "held_weights": stage["weight_bytes"],
                    "held_kv": stage["kv_bytes"],
                    "peak_device_bytes": proc.get("peak_device_bytes"),
                    "reading": reading,
                    "reading_source": proc.get("gpu_source") if device_kind == "cuda" else "rss",
                    "baseline": baseline,
                }
            )
    finally:
        for _, server in servers or ([("peer", peer)] if peer else []):
            server.stop()
    print(
        f"model {args.model}: {tensors.n_layers} layers; device {args.device}, ctx {args.ctx} x {args.parallel} slots, "
        f"KV {args.cache_type_k}/{args.cache_type_v}, GiB; a bare torch process ({'NVML' if device_kind == 'cuda' else 'RSS'}) "
        f"{gib(baseline)}"
    )
    print(
        f"{'process':8} {'layers':9} {'est held':>9} {'held':>9} {'est/held':>8} {'work':>9} {'runtime':>9} {'peak':>9} "
        f"{'reading':>9} {'estimate':>9} {'estimate/reading':>16}"
    )
    for r in rows:
        est, held = r["estimate_weights"] + r["estimate_kv"], r["held_weights"] + r["held_kv"]
        # A GPU estimate counts the process's runtime itself; a CPU one leaves the interpreter to the baseline.
        whole = est + r["estimate_work"] + (r["estimate_runtime"] if device_kind == "cuda" else baseline or 0)
        print(
            f"{r['role']:8} {str(r['layers']):9} {gib(est)} {gib(held)} {est / held:8.3f} {gib(r['estimate_work'])} "
            f"{gib(r['estimate_runtime'])} {gib(r['peak_device_bytes'])} {gib(r['reading'])} {gib(whole)} "
            f"{whole / r['reading'] if r['reading'] else float('nan'):16.3f}"
        )
    print(json.dumps(rows))


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    main()
