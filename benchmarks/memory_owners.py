"""`hydra-engine` with torch's allocation history on: what holds a worker's device memory, by the source line that allocated it.

    python benchmarks/memory_owners.py OUT.txt serve --model M.gguf --device cuda ...   (any hydra-engine command)

Runs the command as `hydra-engine` would, recording every CUDA allocation's Python stack from the
start. On SIGUSR1 it writes OUT.txt: the bytes still allocated, per pool (the CUDA graphs' private
pools apart from the default one), by the innermost frame of this project that allocated them, and
the allocator's reserved-but-free bytes per pool. `bench_fit.py --owners DIR` runs the head and the
peer this way and signals them after its decode. CUDA only; the history costs CPU time per allocation.
"""

from __future__ import annotations

import signal
import sys
import traceback

import torch


def allocated_by_origin() -> tuple[dict[tuple[str, str], int], dict[str, int]]:
    """Bytes still allocated by (pool, the innermost frame of this project that allocated them, else
    of any Python file), the graphs' pools apart from the default one; and each pool's reserved but
    free bytes. Needs the allocation history recorded from the start."""
    totals: dict[tuple[str, str], int] = {}
    free: dict[str, int] = {}
    for seg in torch.cuda.memory._snapshot()["segments"]:
        pool = "graphs" if tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0) else "default"
        free[pool] = free.get(pool, 0) + seg["total_size"] - seg["allocated_size"]
        for blk in seg["blocks"]:
            if blk["state"] != "active_allocated":
                continue
            frames = blk.get("frames", [])
            ours = [f for f in frames if "hydra_console" in f["filename"] or "/benchmarks/" in f["filename"]]
            pick = ours or [f for f in frames if f["filename"].endswith(".py")] or frames
            where = (
                f"{pick[0]['filename'].split('hydra_console/')[-1]}:{pick[0]['line']} {pick[0]['name']}"
                if pick
                else "?"
            )
            totals[pool, where] = totals.get((pool, where), 0) + blk["size"]
    return totals, free


def owners(path: str) -> None:
    totals, free = allocated_by_origin()
    with open(path, "w") as f:
        for (pool, where), n in sorted(totals.items(), key=lambda kv: -kv[1]):
            f.write(f"{pool:8s} {n / 2**20:10.1f} MiB  {where}\n")
        for pool, n in sorted(free.items()):
            f.write(f"{pool:8s} {n / 2**20:10.1f} MiB  (reserved, free)\n")


def safely(path: str) -> None:
    """`owners`, or what went wrong written where the table would be (a signal handler's exception
    would otherwise end in the worker's log, or end the worker)."""
    try:
        owners(path)
    except Exception:
        with open(path, "w") as f:
            f.write(traceback.format_exc())


def main() -> None:
    out, argv = sys.argv[1], sys.argv[2:]
    torch.cuda.memory._record_memory_history(stacks="python", max_entries=1_000_000)
    signal.signal(signal.SIGUSR1, lambda *_: safely(out))
    from hydra_console.engine.cli import main as engine

    sys.argv = ["hydra-engine", *argv]
    engine()


if __name__ == "__main__":
    main()
