"""Where a GPU stage's device memory goes, phase by phase (issue 14's peak VRAM).

    python benchmarks/memory_phases.py M.gguf [--ctx 2048] [--slots 1] [--eager-prefill] [--history]

Builds the Stage as `bench` does (all layers, graphs without torch.compile), then prints allocated /
reserved / peak bytes (torch's caching allocator) and the process's NVML reading (the CUDA context
included; `/status`'s `process_info`) after each phase: built; decode and prefill graphs warmed up; three prefills of 512
tokens; 64 decode steps. Last, the allocator's segments by pool (the graphs' private pools apart)
and the six with the most unused bytes; with `--history`, the blocks still allocated by the
source line that took them (torch's allocation history, recorded from the start). CUDA only.
"""

from __future__ import annotations

import argparse
import os

import torch
from memory_owners import allocated_by_origin  # benchmarks/ is the script's directory

from hydra_console.engine.bench import decode_once, prefill_once
from hydra_console.engine.config import cuda_env
from hydra_console.engine.gguf_file import GGUFFile
from hydra_console.engine.model import ModelConfig, build_stage
from hydra_console.engine.status import process_info

GB = 1e9


def show(phase: str) -> None:
    torch.cuda.synchronize()
    proc = process_info()  # the worker's own reading: NVML's per-process bytes, else torch's
    print(
        f"{phase:14s} allocated {torch.cuda.memory_allocated() / GB:6.3f}  reserved {torch.cuda.memory_reserved() / GB:6.3f}  "
        f"peak allocated {torch.cuda.max_memory_allocated() / GB:6.3f}  peak reserved {torch.cuda.max_memory_reserved() / GB:6.3f}  "
        f"{proc.gpu_source} {(proc.gpu_memory or 0) / GB:6.3f} GB",
        flush=True,
    )


def segments() -> None:
    segs = torch.cuda.memory_snapshot()
    pools: dict[tuple, list[int]] = {}
    for s in segs:
        key = ("graphs' pool" if tuple(s.get("segment_pool_id", (0, 0))) != (0, 0) else "default", s["segment_type"])
        n, total, used = pools.get(key, (0, 0, 0))
        pools[key] = [n + 1, total + s["total_size"], used + s["allocated_size"]]
    for (pool, kind), (n, total, used) in sorted(pools.items()):
        print(f"{pool:13s} {kind:5s}: {n:4d} segments, {total / GB:6.3f} GB, allocated {used / GB:6.3f} GB")
    for s in sorted(segs, key=lambda s: s["allocated_size"] - s["total_size"])[:6]:
        print(
            f"  segment {s['total_size'] / 1e6:8.1f} MB, allocated {s['allocated_size'] / 1e6:8.1f} MB, pool {s.get('segment_pool_id')}"
        )


def by_origin(top: int = 14) -> None:
    """Allocated bytes at the end by the source line that allocated them, per pool: what each of
    the work memory's pieces is (memory_owners.py's grouping)."""
    totals, _ = allocated_by_origin()
    for (pool, where), n in sorted(totals.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {pool:8s} {n / 1e6:9.1f} MB  {where}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--ctx", type=int, default=2048, help="context (KV positions) per slot")
    ap.add_argument("--slots", type=int, default=1)
    ap.add_argument("--eager-prefill", action="store_true", help="without the prefill graphs")
    ap.add_argument("--history", action="store_true", help="record allocations' sources (slower) and list them")
    args = ap.parse_args()
    for name, value in cuda_env().items():  # as a worker's entry point sets them
        os.environ.setdefault(name, value)
    if not torch.cuda.is_available():
        raise SystemExit("memory_phases.py measures a CUDA device; none is here")
    if args.history:
        torch.cuda.memory._record_memory_history(stacks="python", max_entries=200_000)
    g = GGUFFile(args.model)
    show("start")
    stage = build_stage(g, device="cuda", n_slots=args.slots, n_ctx=args.ctx)
    print(
        f"weights held {stage.held_weight_bytes / GB:.3f} GB (read per token {stage.weight_bytes / GB:.3f}), "
        f"KV {stage.kv_bytes / GB:.3f} GB ({stage.n_slots} slots of {stage.n_ctx} + {stage.kv_blocks.padding} padding positions)"
    )
    show("built")
    if args.eager_prefill:
        stage.prefill_graphs = None
        stage.packed_graphs = None
    stage.warm_up(prefill_tokens=0 if args.eager_prefill else 512)
    show("warmed up")
    prompt = torch.randint(0, ModelConfig.from_gguf(g).n_vocab, (512,))
    print("prefill(512) ms", [round(prefill_once(stage, prompt) * 1e3, 2) for _ in range(3)])
    show("prefill 512")
    print(f"decode {64 / decode_once(stage, 1, 64):.1f} tok/s")
    show("decode 64")
    segments()
    if args.history:
        by_origin()


if __name__ == "__main__":
    main()
