"""Adaptive vs fixed MTP draft lengths vs no speculation, by acceptance and number of streams.

    python benchmarks/bench_spec_adaptive.py [--acceptance 0.3 0.6 0.9] [--streams 1 4] [--n-gen 96]
                                             [--draft-max 3] [--reps 3] [--threads N] [--json]

bench_spec.py's companion for issue 37's item 4. Per acceptance level a, a synthetic qwen35 whose
MTP block is right with probability a (`write_synthetic(..., bigram=True, nextn=True,
mtp_accuracy=a)`, `SHAPE`); per number of streams, greedy requests of `--n-gen` tokens run together
in three engines: `off` (no speculator: the trunk alone), `fixed` (MTP, --draft-max every step,
p-min 0) and `adaptive` (MTP, k per slot and step, spec/adaptive.py). The modes alternate rep by rep,
so load from other processes hits them alike. Prints per row: tok/s over all streams (median) and
CPU ms per token (this process's CPU time, which other processes barely move: on a shared machine
the number to trust), each with its ratio to `off` (median of paired ratios), acceptance, drafted
tokens per verify step, and the share of (sampled) moments the adaptive slots drafted nothing; then the step costs the adaptive engine measured (a step of n slots verifying
T tokens over a plain step of n), and a summary table. Every output must equal `off`'s (`same`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

from hydra_console.engine.config import ModelSettings, SpecConfig
from hydra_console.engine.gguf_file import GGUFFile
from hydra_console.engine.model import build_stage
from hydra_console.engine.pipeline import Pipeline
from hydra_console.engine.serving.runtime import Engine, Request
from hydra_console.engine.serving.sampling import SamplingParams
from hydra_console.engine.spec import build_speculator
from hydra_console.engine.synth import write_synthetic
from hydra_console.engine.text.tokenizer import Tokenizer

# Weights read per step dominate a step here (memory bound on a CPU), so a verify of k + 1 tokens
# costs much less than k + 1 steps (the adaptive engine's table prints how much).
SHAPE = dict(
    n_layers=16,
    n_embd=512,
    n_head=8,
    n_head_kv=2,
    head_dim=64,
    n_ff=1536,
    vocab_size=8192,
    ssm_state=64,
    ssm_groups=2,
    ssm_v_heads=4,
    full_attention_interval=4,
)
CTX = 512
MODES = ("off", "fixed", "adaptive")


def engine(path: Path, mode: str, n_slots: int, draft_max: int) -> Engine:
    g = GGUFFile(path)
    settings = ModelSettings(None, "cpu", "float32", CTX)
    stage = build_stage(g, device="cpu", dtype="float32", n_slots=n_slots, n_ctx=CTX)
    spec = None
    if mode != "off":
        cfg = SpecConfig("mtp", n_max=draft_max, p_min=0.0, adaptive=mode == "adaptive")
        spec = build_speculator(cfg, None, g, settings, n_slots, head=stage)
    return Engine(Pipeline(stage), Tokenizer.from_gguf(g), n_slots, CTX, speculator=spec).start()


def run(eng: Engine, prompts: list[list[int]], n_gen: int) -> dict:
    """The prompts as concurrent greedy requests: their outputs and tok/s over all of them (from
    the first submit to the last token), with the engine's draft counters over the run."""
    before = (eng.spec_stats.drafts, eng.spec_stats.draft_tokens, eng.spec_stats.accepted, eng.stats.steps)
    idle = [0, 0]  # (slot-steps an adaptive slot drafted nothing, slot-steps)
    outs: dict[int, list[int]] = {}
    stop = threading.Event()

    def one(i: int) -> None:
        req = Request(prompts[i], SamplingParams(temperature=0.0), max_tokens=n_gen, ignore_eos=True)
        outs[i] = [t.id for ev in eng.generate(req, timeout=600) for t in ev.tokens]

    def watch() -> None:  # the per-slot k /status shows, sampled
        while not stop.wait(0.01):
            for s in eng.spec.adaptive.snapshot():
                idle[0] += s["k"] == 0
                idle[1] += 1

    t0, c0 = time.perf_counter(), time.process_time()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    watcher = threading.Thread(target=watch)
    for t in [*threads, watcher]:
        t.start()
    for t in threads:
        t.join()
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    stop.set()
    watcher.join()
    drafts, drafted, accepted = (
        x - y for x, y in zip((eng.spec_stats.drafts, eng.spec_stats.draft_tokens, eng.spec_stats.accepted), before)
    )
    return {
        "ids": [outs[i] for i in range(len(prompts))],
        "tok_s": sum(len(o) for o in outs.values()) / dt,
        "cpu_ms_per_tok": 1e3 * cpu / sum(len(o) for o in outs.values()),
        "acceptance": accepted / drafted if drafted else None,
        "k_mean": drafted / drafts if drafts else 0.0,
        "k0_share": idle[0] / idle[1] if idle[1] else None,
    }


def cost_table(eng: Engine) -> dict[str, float]:
    """The adaptive engine's measured step costs, each over the plain step of as many slots."""
    table = eng.spec.adaptive.costs.table()
    return {f"n={n} T={t}": round(s / table[(n, n)], 3) for (n, t), s in sorted(table.items()) if (n, n) in table}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--acceptance", type=float, nargs="+", default=[0.3, 0.6, 0.9])
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--n-gen", type=int, default=96)
    ap.add_argument("--draft-max", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="bench-adaptive-"))
    rows = []
    for a in args.acceptance:
        path = write_synthetic(tmp / f"a{a}.gguf", "qwen35", nextn=True, bigram=True, mtp_accuracy=a, **SHAPE)
        for n in args.streams:
            engines = {m: engine(path, m, n, args.draft_max) for m in MODES}
            try:
                prompts = [[11 + 997 * i, 5 + 131 * i] for i in range(n)]
                for e in engines.values():  # warm-up (the adaptive one learns its costs on the way)
                    run(e, prompts, args.n_gen)
                runs = {m: [] for m in MODES}
                for _ in range(args.reps):
                    for m, e in engines.items():
                        runs[m].append(run(e, prompts, args.n_gen))
                costs = cost_table(engines["adaptive"])
            finally:
                for e in engines.values():
                    e.stop()
            for m in MODES:
                rs = runs[m]
                ratios = [x["tok_s"] / o["tok_s"] for x, o in zip(rs, runs["off"])]
                cpu_ratios = [o["cpu_ms_per_tok"] / x["cpu_ms_per_tok"] for x, o in zip(rs, runs["off"])]
                row = {
                    "acceptance_asked": a,
                    "streams": n,
                    "mode": m,
                    "tok_s": round(statistics.median(x["tok_s"] for x in rs), 2),
                    "vs_off": round(statistics.median(ratios), 3),
                    "cpu_ms_per_tok": round(statistics.median(x["cpu_ms_per_tok"] for x in rs), 2),
                    "vs_off_cpu": round(statistics.median(cpu_ratios), 3),
                    "acceptance": None if rs[-1]["acceptance"] is None else round(rs[-1]["acceptance"], 3),
                    "k_mean": round(statistics.median(x["k_mean"] for x in rs), 2),
                    "k0_share": None if m != "adaptive" else round(statistics.median(x["k0_share"] for x in rs), 2),
                    "same": all(x["ids"] == runs["off"][0]["ids"] for x in rs),
                    "reps_tok_s": [round(x["tok_s"], 1) for x in rs],
                }
                rows.append(row)
                if not args.json:
                    print(
                        f"a={a} streams={n} {m:8} {row['tok_s']:7.1f} tok/s x{row['vs_off']:.2f} "
                        f"{row['cpu_ms_per_tok']:6.1f} CPU ms/tok x{row['vs_off_cpu']:.2f} acc {row['acceptance']} "
                        f"k {row['k_mean']} k0 {row['k0_share']} same={row['same']} reps={row['reps_tok_s']}",
                        flush=True,
                    )
            if not args.json:
                print(f"a={a} streams={n} adaptive's measured step cost / plain step: {costs}", flush=True)
            rows[-1]["costs"] = costs
    if args.json:
        print(json.dumps({"shape": SHAPE, "loadavg": os.getloadavg(), "rows": rows}, indent=1))
        return
    print(
        "| acceptance asked | measured | streams | off tok/s | fixed n-max | adaptive "
        "| off CPU ms/tok | fixed n-max | adaptive | adaptive: steps at k=0 |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for i in range(0, len(rows), 3):
        off, fixed, ad = rows[i : i + 3]
        print(
            f"| {off['acceptance_asked']} | {fixed['acceptance']} | {off['streams']} | {off['tok_s']:.1f} "
            f"| {fixed['tok_s']:.1f} (x{fixed['vs_off']:.2f}) | {ad['tok_s']:.1f} (x{ad['vs_off']:.2f}) "
            f"| {off['cpu_ms_per_tok']:.1f} | {fixed['cpu_ms_per_tok']:.1f} (x{fixed['vs_off_cpu']:.2f}) "
            f"| {ad['cpu_ms_per_tok']:.1f} (x{ad['vs_off_cpu']:.2f}) | {ad['k0_share']} |"
        )
    print(f"load average after: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
