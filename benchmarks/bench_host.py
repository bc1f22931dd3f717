"""Host time per decode step: the engine loop's own work apart from the model's forward.

    python benchmarks/bench_host.py [--model PATH] [--device cpu] [--dtype auto] [--streams 1 4]
                                    [--n-gen 64] [--sampling greedy sampled penalised] [--threads N]
                                    [--overlap | --no-overlap] [--compile]

Runs `--streams` concurrent requests through the real Engine and times each `Engine.step` and the
`Pipeline.forward` inside it; host ms per step = step - forward (scheduling, sampling, postprocess,
detokenizing, stop strings, events). On a CPU the sampler runs in the engine's thread, so its cost
counts as host time; on a GPU the forward only queues kernels and the time spent waiting for them
shows up wherever the host first reads a result. Prints only: compare runs of two trees (e.g. this
one and the main checkout, through PYTHONPATH) on the same machine. Samplings: greedy; sampled =
temperature 0.8, top-k 40, top-p 0.95, min-p 0.05 (llama-server's defaults); penalised = sampled +
repeat penalty 1.1 over the last 64 tokens. First, the device sampler alone (`sampling.sample` on
random `[B, vocab]` logits, 200-token histories, read back): ms per call, median of 20 (a tree
without it says so).
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import threading
import time

import torch

from hydra_console.engine.default_model import model_path
from hydra_console.engine.gguf_file import GGUFFile
from hydra_console.engine.model import build_stage
from hydra_console.engine.pipeline import Pipeline
from hydra_console.engine.serving import sampling
from hydra_console.engine.serving.runtime import Engine, Request
from hydra_console.engine.serving.sampling_params import SamplingParams
from hydra_console.engine.text.tokenizer import Tokenizer

SAMPLINGS = {
    "greedy": dict(temperature=0.0),
    "sampled": dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
    "penalised": dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.1),
}
PROMPT = "The history of the printing press begins"


def measure(engine: Engine, tok, streams: int, n_gen: int, sampling: str) -> dict:
    """Per-step (step ms, forward ms) over the decode steps of `streams` requests run together."""
    steps: list[tuple[float, float]] = []
    forward_s = [0.0]
    inner_forward, inner_step = engine.pipeline.forward, engine.step

    def timed_forward(*a, **kw):
        t = time.perf_counter()
        out = inner_forward(*a, **kw)
        forward_s[0] += time.perf_counter() - t
        return out

    def timed_step():
        forward_s[0] = 0.0
        t = time.perf_counter()
        inner_step()
        steps.append(((time.perf_counter() - t) * 1e3, forward_s[0] * 1e3))

    engine.pipeline.forward, engine.step = timed_forward, timed_step
    try:
        ids = tok.encode(PROMPT)
        reqs = [
            Request(ids, SamplingParams(seed=i, **SAMPLINGS[sampling]), max_tokens=n_gen, ignore_eos=True)
            for i in range(streams)
        ]
        threads = [threading.Thread(target=lambda r=r: list(engine.generate(r, timeout=600))) for r in reqs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        engine.pipeline.forward, engine.step = inner_forward, inner_step
    decode = steps[len(steps) // 4 :]  # past the prompts and the first tokens
    return {
        "steps": len(decode),
        "step_ms": statistics.median(s for s, _ in decode),
        "forward_ms": statistics.median(f for _, f in decode),
        "host_ms": statistics.median(s - f for s, f in decode),
    }


def sampler_ms(vocab: int, device: torch.device, batch: int, sampling_name: str) -> float:
    """Median ms of one `sampling.sample` call + read over `batch` rows."""
    x = torch.randn(batch, vocab, device=device)
    histories = [list(range(i, i + 200)) for i in range(batch)]
    times = []
    for _ in range(20):
        t = time.perf_counter()
        samplers = [sampling.Sampler(SamplingParams(seed=i, **SAMPLINGS[sampling_name])) for i in range(batch)]
        sampling.sample(x, sampling.Rows.build(samplers, histories, device)).read()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF (default: Gemma 3 270M)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--n-gen", type=int, default=64)
    ap.add_argument("--sampling", nargs="+", choices=list(SAMPLINGS), default=list(SAMPLINGS))
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the decode graphs, as `serve` does on CUDA: a GPU step then takes less than the host's part",
    )
    ap.add_argument(
        "--overlap",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the engine's overlap (default: its own; an engine without it ignores the flag)",
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    g = GGUFFile(model_path(args.model))
    tok = Tokenizer.from_gguf(g)
    n_slots = max(args.streams)
    n_ctx = len(tok.encode(PROMPT)) + args.n_gen + 8
    stage = build_stage(
        g, device=args.device, dtype=args.dtype, n_slots=n_slots, n_ctx=n_ctx, compile_decode=args.compile
    )
    stage.warm_up()  # captured (and compiled) before any step is timed
    kw = (
        {"overlap": args.overlap}
        if "overlap" in inspect.signature(Engine).parameters and args.overlap is not None
        else {}
    )
    engine = Engine(Pipeline(stage), tok, n_slots, stage.n_ctx, **kw).start()
    print(
        f"engine {Engine.__module__} ({inspect.getsourcefile(Engine)}), overlap {getattr(engine, 'overlap', 'n/a')}, "
        f"{g.architecture} vocab {tok.vocab_size}, {args.device}"
    )
    if hasattr(sampling, "Rows"):
        print(f"{'sampling':<10} {'rows':>7} {'sampler ms':>10}")
        for name in args.sampling:
            for streams in args.streams:
                print(f"{name:<10} {streams:>7} {sampler_ms(tok.vocab_size, stage.device, streams, name):>10.2f}")
    else:
        print("(this tree has no batched device sampler: engine steps only)")
    print(f"{'sampling':<10} {'streams':>7} {'steps':>6} {'step ms':>8} {'forward ms':>10} {'host ms':>8}")
    try:
        measure(engine, tok, 1, 8, "greedy")  # warm-up
        for name in args.sampling:
            for streams in args.streams:
                r = measure(engine, tok, streams, args.n_gen, name)
                print(
                    f"{name:<10} {streams:>7} {r['steps']:>6} {r['step_ms']:>8.2f} {r['forward_ms']:>10.2f} "
                    f"{r['host_ms']:>8.2f}"
                )
    finally:
        engine.stop()


if __name__ == "__main__":
    main()
