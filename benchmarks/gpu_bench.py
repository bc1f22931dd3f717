"""GPU throughput on the 1.1B llama shape (hidden 2048, 16 layers, 32 heads, 8 KV heads, FFN 8192,
vocab 32000, F16 GGUF) written by `write_synthetic`: CUDA graphs, torch.compile + graphs, eager.

    python benchmarks/gpu_bench.py [--out /tmp/llama-1.1b-f16.gguf] [-p 512] [-n 128] [-r 3] [--json PATH]

Prints one table; decode is single-slot greedy (argmax on the device), as `hydra-engine bench`;
"batched" decodes 4 slots per step (tokens/s summed over slots).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from hydra_console.engine.bench import decode_once, run_bench
from hydra_console.engine.gguf_file import GGUFFile
from hydra_console.engine.model import Stage, build_stage
from hydra_console.engine.synth import write_synthetic

SHAPE = dict(n_layers=16, n_embd=2048, n_head=32, n_head_kv=8, n_ff=8192, vocab_size=32000, n_ctx=2048, qtype="F16")


def batched_decode_tok_s(stage: Stage, batch: int, n_gen: int) -> float:
    slots = torch.arange(batch)
    tokens = torch.full((batch,), 1, device=stage.device)
    for s in range(batch):
        stage.kv_clear(s)
    positions = torch.arange(n_gen).repeat_interleave(batch).view(n_gen, batch)
    for warm in (True, False):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(n_gen if not warm else 4):
            tokens = stage.logits(stage.run_layers(stage.embed(tokens), slots, positions[i])).argmax(-1)
        torch.cuda.synchronize()
    return batch * n_gen / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/llama-1.1b-f16.gguf")
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-r", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    print(f"torch {torch.__version__}  {torch.cuda.get_device_name(0)}", flush=True)
    path = Path(args.out)
    if not path.exists():
        t0 = time.perf_counter()
        write_synthetic(path, "llama", **SHAPE)
        print(f"wrote {path} ({path.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - t0:.1f} s", flush=True)
    rows = {"graphs": run_bench(path, "cuda", "bfloat16", args.p, args.n, args.r)}
    print(json.dumps(rows["graphs"]), flush=True)

    g = GGUFFile(path)
    stage = build_stage(g, device="cuda", dtype="bfloat16", n_slots=4, n_ctx=args.p + args.n)
    rows["batched4"] = {"decode_tok_s": round(batched_decode_tok_s(stage, 4, args.n), 1)}
    graph = stage.graphs.graphs[1, 1][0] if (1, 1) in stage.graphs.graphs else None
    if graph is None:
        decode_once(stage, 1, 4)
        graph = stage.graphs.graphs[1, 1][0]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(100):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    rows["graph_replay_ms"] = round(start.elapsed_time(end) / 100, 4)  # the layer stack alone, one slot
    stage.graphs = None  # plain eager torch: one launch per op, Python in the loop
    decode_once(stage, 1, 8)
    rows["eager"] = {"decode_tok_s": round(args.n / decode_once(stage, 1, args.n), 1)}

    try:
        rows["compiled"] = run_bench(path, "cuda", "bfloat16", args.p, args.n, args.r, compile_decode=True)
    except Exception as e:  # report, keep the other rows
        rows["compiled"] = {"error": f"{type(e).__name__}: {e}"[:500]}
    print(json.dumps(rows["compiled"]), flush=True)
    print(f"\n{'variant':<28}{'prefill tok/s':>15}{'decode tok/s':>14}{'GB/s':>8}")
    r = rows["graphs"]
    print(f"{'bf16 + CUDA graphs':<28}{r['prefill_tok_s']:>15,.0f}{r['decode_tok_s']:>14,.1f}{r['decode_gb_s']:>8,.0f}")
    r = rows["compiled"]
    if "decode_tok_s" in r:
        print(
            f"{'bf16 + compile + graphs':<28}{r['prefill_tok_s']:>15,.0f}{r['decode_tok_s']:>14,.1f}{r['decode_gb_s']:>8,.0f}"
        )
    print(f"{'bf16 eager (no graphs)':<28}{'':>15}{rows['eager']['decode_tok_s']:>14,.1f}")
    print(f"{'bf16 + graphs, 4 slots':<28}{'':>15}{rows['batched4']['decode_tok_s']:>14,.1f}")
    print(f"layer-stack graph replay alone: {rows['graph_replay_ms']:.3f} ms per token")
    print("llama.cpp (upstream, H200):   prefill 68,700   decode 879")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
