"""Where a served prompt's time goes: the Engine exactly as `serve` builds it (no HTTP), the
request's wall time, then torch.profiler's kernel table (by device time) and host table (by CPU
time) for one request. A device busy for a small part of the wall time means a host-bound prefill.

    python benchmarks/prompt_profile.py M.gguf [--device cuda] [--prompt-tokens 512] [--eager-prefill] [-- SERVE_ARGS...]

SERVE_ARGS go to `serve`'s own parser (e.g. `-b 256`, `--cache-type-k q8_0`); the defaults here
are `--parallel 4 --ctx 2048 --no-compile` (torch.compile covers the decode step only). On CUDA a prompt
replays its length bucket's prefill graph (a recurrent stage: its packed graph, up to 128 tokens)
unless `--eager-prefill`.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from hydra_console.engine.cli import build_parser
from hydra_console.engine.cli_config import head_config
from hydra_console.engine.gguf_file import GGUFFile
from hydra_console.engine.model import ModelConfig
from hydra_console.engine.serving.runtime import Engine, Request
from hydra_console.engine.text.tokenizer import Tokenizer
from hydra_console.engine.workers.head_pipeline import build_pipeline


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--eager-prefill", action="store_true", help="without the prefill graphs (what they buy: run both)")
    own, serve_args = (
        (sys.argv[1 : sys.argv.index("--")], sys.argv[sys.argv.index("--") + 1 :])
        if "--" in sys.argv
        else (sys.argv[1:], [])
    )
    args = ap.parse_args(own)
    argv = ["serve", "--model", args.model, "--device", args.device, "--parallel", "4", "--ctx", "2048", "--no-compile"]
    cfg = head_config(build_parser().parse_args(argv + serve_args), {})
    g = GGUFFile(args.model)
    pipe = build_pipeline(cfg, g, ModelConfig.from_gguf(g))
    if args.eager_prefill:
        pipe.local.prefill_graphs = None
        pipe.local.packed_graphs = None
    pipe.local.warm_up(prefill_tokens=cfg.batch_tokens)
    engine = Engine(
        pipe,
        Tokenizer.from_gguf(g),
        n_slots=cfg.parallel,
        n_ctx=cfg.model.ctx,
        batch_tokens=cfg.batch_tokens,
        overlap=cfg.overlap,
    ).start()

    def request(i: int) -> Request:
        """One distinct prompt up to its first token (no prompt cache)."""
        return Request(
            prompt=[(7 * i + j) % 1000 + 5 for j in range(args.prompt_tokens)], max_tokens=1, cache_prompt=False
        )

    def one(i: int) -> float:
        t = time.perf_counter()
        events = list(engine.generate(request(i)))
        if events and events[-1].error is not None:
            raise SystemExit(f"the request failed: {events[-1].error}")
        return (time.perf_counter() - t) * 1e3

    print("warm-up ms", [round(one(i), 1) for i in range(3)])
    print(
        f"request ms ({args.prompt_tokens} tokens, -b {cfg.batch_tokens})",
        [round(one(i + 10), 1) for i in range(args.runs)],
    )
    # The profiler records host ops on the thread that starts it: the profiled request is stepped here.
    engine.stop()
    events = []
    req = request(99)
    req.sink = events.append
    activities = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else []
    )
    with torch.profiler.profile(activities=activities) as prof:
        engine.submit(req)
        while not events or events[-1].finish_reason is None:
            engine.step()
    table = prof.key_averages()
    if torch.cuda.is_available():
        print(table.table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=60))
    print(table.table(sort_by="cpu_time_total", row_limit=22, max_name_column_width=60))


if __name__ == "__main__":
    main()
