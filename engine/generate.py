"""`hydra-engine generate`: one prompt through the same Engine the server uses, streamed to stdout.

Kept free of the HTTP stack (FastAPI, uvicorn) so the path to the first token stays short.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from .errors import UserError


def main(args, cache_dir: Path | None) -> int:
    t0 = time.perf_counter()
    from .cli_config import slot_ctx
    from .default_model import model_path
    from .gguf_file import GGUFFile
    from .model import build_stage
    from .pipeline import Pipeline
    from .serving.runtime import Engine, Request
    from .serving.sampling_params import SamplingParams
    from .text.tokenizer import Tokenizer

    path = model_path(args.model)
    params = SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repeat_penalty=args.repeat_penalty,
        seed=args.seed,
    )
    if any(not s for s in args.stop):
        raise UserError("--stop strings must not be empty")
    g = GGUFFile(path)
    tok = Tokenizer.from_gguf(g)
    text = args.prompt
    if args.chat:
        from .text.chat import apply_chat_template

        text = apply_chat_template(tok, g, [{"role": "user", "content": args.prompt}], add_generation_prompt=True)
    ids = tok.encode(text, add_special=True, parse_special=True)
    if args.n_predict < -1:
        raise UserError(f"-n must be >= -1 (-1 = until the context is full), got {args.n_predict}")
    ctx = slot_ctx(args)
    if len(ids) >= ctx:
        raise UserError(f"the prompt is {len(ids)} tokens, the context only {ctx} (--ctx)")
    n_predict = ctx - len(ids) if args.n_predict == -1 else args.n_predict
    # One slot, sized to this request: no KV memory for context it will never use.
    n_ctx = min(ctx, len(ids) + n_predict)
    stage = build_stage(
        g,
        device=args.device,
        dtype=args.dtype,
        n_slots=1,
        n_ctx=n_ctx,
        cache_dir=cache_dir,
        quantized=None if args.gpu_weights == "quantized" else False,
        kv_types=(args.cache_type_k, args.cache_type_v),
        deterministic=args.deterministic,
    )
    engine = Engine(Pipeline(stage), tok, 1, n_ctx, overlap=args.overlap)
    engine.check(len(ids), n_predict)
    engine.start()
    final = None
    t_first = None
    try:
        for ev in engine.generate(Request(ids, params, max_tokens=n_predict, stop=list(args.stop))):
            if ev.text:
                if t_first is None:
                    t_first = time.perf_counter()
                sys.stdout.write(ev.text)
                sys.stdout.flush()
            if ev.finish_reason is not None:
                final = ev
    finally:
        engine.stop()
    sys.stdout.write("\n")
    sys.stdout.flush()
    if final is not None and final.finish_reason == "error":
        raise final.error
    t = final.timings
    first = f"{(t_first - t0):.2f} s" if t_first is not None else "n/a"
    print(
        f"[prompt {t['prompt_n']} tok at {t['prompt_per_second']:.1f} tok/s, generated {t['predicted_n']} tok at "
        f"{t['predicted_per_second']:.1f} tok/s, first token after {first}, finish: {final.finish_reason}]",
        file=sys.stderr,
    )
    return 0
