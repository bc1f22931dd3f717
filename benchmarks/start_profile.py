"""Where a head's start goes: `HeadWorker.load()` (file, stage, MTP block, warm-up, engine: what
`serve`'s loader thread runs before READY) in this process's main thread under cProfile, then the
startup phases (`/status` `startup_s`), dynamo's compile times and cProfile's tables (cumulative,
then own time).

    python benchmarks/start_profile.py [--top 40] -- --model M.gguf --device cuda -np 4 -ctk q8_0 -ctv q8_0 \
        --kv-unified --spec-type mtp --draft-max 3

Run it twice on a machine: the first start fills the compile caches (cold), the second is a warm
restart's. No HTTP port is served; the RPC port is bound as `serve` binds it.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import time

T0 = time.perf_counter()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--top", type=int, default=40, help="rows of each cProfile table")
    args, serve = ap.parse_known_args()
    serve = [a for a in serve if a != "--"]

    from hydra_console.engine.cli import build_parser
    from hydra_console.engine.cli_config import head_config
    from hydra_console.engine.config import worker_env

    for name, value in worker_env(os.environ).items():
        os.environ.setdefault(name, value)  # as `hydra-engine` sets them, before torch is imported
    import torch

    from hydra_console.engine.workers.head import HeadWorker

    print(f"imports: {time.perf_counter() - T0:.2f} s", flush=True)
    worker = HeadWorker(head_config(build_parser().parse_args(["serve", *serve]), os.environ))
    profile = cProfile.Profile()
    t = time.perf_counter()
    profile.enable()
    try:
        worker.load()
    finally:
        profile.disable()
        print(f"load: {time.perf_counter() - t:.2f} s")
        print("startup_s:", worker.status.startup_s)
        print(torch._dynamo.utils.compile_times(repr="str"))
        stats = pstats.Stats(profile)
        stats.sort_stats("cumulative").print_stats(args.top)
        stats.sort_stats("tottime").print_stats(args.top)
        worker.stop()


if __name__ == "__main__":
    main()
