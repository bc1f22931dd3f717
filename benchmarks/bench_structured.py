"""Per-token cost of structured output: a JSON-schema request vs the same request unconstrained.

    python benchmarks/bench_structured.py [--device cpu|cuda] [--dtype auto] [--tokens 64] [--batch 1] [--repeats 5] [--model GGUF]

Runs the default model (or `--model`) in an in-process Engine (the server's engine, without HTTP). Each round
first runs `--batch` greedy requests under a JSON schema whose one long string field lets the model
write up to `--tokens` tokens, then the same requests unconstrained for exactly as many tokens
each. Prints decode ms/token both ways (the engine's own `predicted_per_token_ms`, median of the
rounds) and the difference, plus the mask's own parts timed alone: host bitmask per sequence and
its device copy + unpack + apply on a `[batch, vocab]` logits tensor. The first request also
builds the model's llguidance tokenizer once (printed; the server does it on first use).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch

from hydra_console.engine.default_model import default_model_path
from hydra_console.engine.gguf_file import GGUFFile
from hydra_console.engine.model import build_stage
from hydra_console.engine.pipeline import Pipeline
from hydra_console.engine.serving.runtime import Engine, Request
from hydra_console.engine.serving.sampling_params import SamplingParams
from hydra_console.engine.text.structured import apply_bitmask, compile_grammar
from hydra_console.engine.text.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {"title": {"type": "string"}, "year": {"type": "integer"}, "summary": {"type": "string"}},
    "required": ["title", "year", "summary"],
}
PROMPT = "<start_of_turn>user\nDescribe a famous film as JSON with a title, a year and a long summary.<end_of_turn>\n<start_of_turn>model\n"


def run_batch(eng: Engine, prompt: list[int], constraints: list, max_tokens: list[int]) -> list[tuple[int, float]]:
    """(tokens generated, decode ms/token) of each request, all submitted together."""
    out: dict[int, tuple[int, float]] = {}

    def one(i: int) -> None:
        req = Request(
            prompt,
            SamplingParams(temperature=0.0),
            max_tokens=max_tokens[i],
            ignore_eos=constraints[i] is None,
            constraint=constraints[i],
            cache_prompt=False,
        )
        n, final = 0, None
        for ev in eng.generate(req, timeout=600):
            n += len(ev.tokens)
            final = ev
        out[i] = (final.usage["completion_tokens"], final.timings["predicted_per_token_ms"])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(constraints))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [out[i] for i in range(len(constraints))]


def time_mask_parts(
    eng: Engine, constraint, batch: int, device: torch.device, repeats: int = 200
) -> tuple[float, float]:
    """(host bitmask ms per sequence, device apply ms per batch) for `batch` rows."""
    V = eng.tok.vocab_size
    logits = torch.randn(batch, V, device=device)
    cs = [constraint.copy() for _ in range(batch)]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    t = time.perf_counter()
    for _ in range(repeats):
        mask = eng.grammars.bitmask(cs, pinned=device.type == "cuda")
    host = (time.perf_counter() - t) / repeats / batch * 1e3
    apply_bitmask(logits, mask)
    sync()
    t = time.perf_counter()
    for _ in range(repeats):
        apply_bitmask(logits, mask)
    sync()
    return host, (time.perf_counter() - t) / repeats * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--model", default=None, help="GGUF (default: the default model)")
    args = ap.parse_args()

    g = GGUFFile(args.model or default_model_path())
    tok = Tokenizer.from_gguf(g)
    n_ctx = 512
    stage = build_stage(g, device=args.device, dtype=args.dtype, n_slots=args.batch, n_ctx=n_ctx)
    eng = Engine(Pipeline(stage), tok, args.batch, n_ctx).start()
    device = stage.device if hasattr(stage, "device") else torch.device(args.device)
    prompt = tok.encode(PROMPT)
    grammar = compile_grammar("json_schema", SCHEMA, "json_schema")
    try:
        t = time.perf_counter()
        eng.grammars.constraint(grammar, "json_schema")
        print(
            f"llguidance tokenizer for {tok.vocab_size} tokens built in {time.perf_counter() - t:.2f} s (once per model)"
        )
        run_batch(eng, prompt, [None] * args.batch, [8] * args.batch)  # warm-up
        constrained, free = [], []
        for _ in range(args.repeats):
            cons = run_batch(
                eng,
                prompt,
                [eng.grammars.constraint(grammar, "json_schema") for _ in range(args.batch)],
                [args.tokens] * args.batch,
            )
            plain = run_batch(eng, prompt, [None] * args.batch, [n for n, _ in cons])
            constrained += [ms for _, ms in cons]
            free += [ms for _, ms in plain]
        n_tokens = [n for n, _ in cons]
        c_ms, f_ms = statistics.median(constrained), statistics.median(free)
        host, apply = time_mask_parts(
            eng, eng.grammars.constraint(grammar, "json_schema"), args.batch, torch.device(device)
        )
        print(f"device {device}, batch {args.batch}, {n_tokens} tokens per request, median of {args.repeats} rounds")
        print(f"unconstrained: {f_ms:.2f} ms/token")
        print(f"json schema:   {c_ms:.2f} ms/token")
        print(f"difference:    {c_ms - f_ms:+.2f} ms/token ({(c_ms / f_ms - 1) * 100:+.1f} %)")
        print(f"mask parts alone: host bitmask {host:.3f} ms per sequence, device apply {apply:.3f} ms per step")
    finally:
        eng.stop()


if __name__ == "__main__":
    main()
