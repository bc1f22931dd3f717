"""`hydra-engine bench`: prefill and decode throughput of one Stage holding the whole model.

Measured like llama-bench: prefill = one forward over `-p` random prompt tokens (logits of the
last row); decode = `-n` single-token steps from an empty context, greedy argmax on the device
feeding the next step. Each test runs once untimed (warm-up, CUDA graph capture), then `-r`
times; the mean rate is reported. Achieved GB/s = weight bytes read per decoded token × tok/s.
"""

from __future__ import annotations

import gc
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from ..contracts.footprint import model_tensors
from .default_model import model_path
from .errors import UserError
from .gguf_file import GGUFFile
from .model import ModelConfig, NextN, Stage, build_stage, nextn_prefix


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prefill_once(stage: Stage, tokens: torch.Tensor) -> float:
    """Seconds for one prefill of `tokens` into slot 0 (from position 0), last-row logits included."""
    n = tokens.numel()
    stage.kv_clear(0)
    _sync(stage.device)
    t0 = time.perf_counter()
    h = stage.run_layers(stage.embed(tokens), torch.zeros(n, dtype=torch.long), torch.arange(n))
    stage.logits(h[-1:]).argmax(-1)
    _sync(stage.device)
    return time.perf_counter() - t0


def fill_context(stage: Stage, context: torch.Tensor, chunk: int = 2048) -> None:
    """Slot 0 holds `context` (from position 0), prefilled in chunks as the server does."""
    stage.kv_clear(0)
    for p0 in range(0, context.numel(), chunk):
        part = context[p0 : p0 + chunk]
        stage.run_layers(
            stage.embed(part), torch.zeros(part.numel(), dtype=torch.long), torch.arange(p0, p0 + part.numel())
        )


def decode_once(stage: Stage, first_token: int, n_gen: int, context: torch.Tensor | None = None) -> float:
    """Seconds for `n_gen` greedy single-token steps in slot 0, after `context` (llama-bench's `-d`)
    when given, else from position 0. The context's prefill is not timed."""
    depth = 0 if context is None else context.numel()
    slot = torch.zeros(1, dtype=torch.long)
    positions = torch.arange(depth, depth + n_gen).view(n_gen, 1)  # host tensors: no device sync per step
    token = torch.tensor([first_token], device=stage.device if stage.device.type == "cuda" else "cpu")
    if depth:
        fill_context(stage, context)
    else:
        stage.kv_clear(0)
    _sync(stage.device)
    t0 = time.perf_counter()
    for i in range(n_gen):
        h = stage.run_layers(stage.embed(token), slot, positions[i])
        token = stage.logits(h).argmax(-1)
    _sync(stage.device)
    return time.perf_counter() - t0


def run_bench(
    model: Path, device: str, dtype: str, n_prompt: int, n_gen: int, repetitions: int, depth: int = 0, **stage_options
) -> dict:
    g = GGUFFile(model)
    cfg = ModelConfig.from_gguf(g)
    t0 = time.perf_counter()
    stage = build_stage(
        g, device=device, dtype=dtype, n_slots=1, n_ctx=max(n_prompt, depth + n_gen, 1), **stage_options
    )
    load_s = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, cfg.n_vocab, (n_prompt,), generator=gen)
    context = torch.randint(0, cfg.n_vocab, (depth,), generator=gen) if depth else None
    first = int(g.get("tokenizer.ggml.bos_token_id", 1))
    result = {
        "model": str(model),
        "arch": cfg.arch,
        "device": str(stage.device),
        "dtype": str(stage.dtype).removeprefix("torch."),
        "weights": "int8"
        if stage.int8
        else "gguf-quantized"
        if stage.weights.quantized
        else str(stage.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "n_prompt": n_prompt,
        "n_gen": n_gen,
        "depth": depth,
        "repetitions": repetitions,
        "load_s": round(load_s, 3),
        "weight_bytes": stage.weight_bytes,  # read per decoded token
        "kv_bytes": stage.kv_bytes,  # KV + recurrent state with its checkpoints
        # contracts/footprint.py's estimate of the two (what the console's split editor shows)
        "estimate": _estimate(g, stage),
        "state_bytes": stage.state_bytes,
        "mtp_kv_bytes": NextN(stage).kv_bytes if nextn_prefix(g, cfg.n_layers) else 0,  # the MTP block's own KV
        "load_avg": round(os.getloadavg()[0], 2),  # other processes on the cores make every rate a lower bound
    }
    if n_prompt:
        prefill_once(stage, prompt)
        times = [prefill_once(stage, prompt) for _ in range(repetitions)]
        rates = [n_prompt / t for t in times]
        result["prefill_tok_s"] = round(statistics.mean(rates), 2)
        result["prefill_tok_s_std"] = round(statistics.pstdev(rates), 2)
    if n_gen:
        decode_once(stage, first, min(n_gen, 8), context)
        times = [decode_once(stage, first, n_gen, context) for _ in range(repetitions)]
        rates = [n_gen / t for t in times]
        result["decode_tok_s"] = round(statistics.mean(rates), 2)
        result["decode_tok_s_std"] = round(statistics.pstdev(rates), 2)
        # Significant digits, not decimals: a tiny model on a loaded box reads well under 0.01 GB/s.
        result["decode_gb_s"] = float(f"{stage.weight_bytes * result['decode_tok_s'] / 1e9:.4g}")
    # Every weight kept on the device, after the runs: a CPU layer keeps a bfloat16 copy from its
    # first prefill of more than 16 tokens on (the estimate counts it).
    result["held_weight_bytes"] = stage.held_weight_bytes
    if stage.device.type == "cuda":  # the allocator's high-water mark (NVML adds the CUDA context)
        result["peak_device_bytes"] = torch.cuda.max_memory_reserved(stage.device)
    result["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return result


def _estimate(g: GGUFFile, stage: Stage) -> dict:
    est = model_tensors(g.metadata, g.tensors).stage(
        0,
        stage.cfg.n_layers,
        head=True,
        device=stage.device.type,
        dtype=str(stage.dtype).removeprefix("torch."),
        n_slots=stage.n_slots,
        n_ctx=stage.n_ctx,
        kv_types=stage.kv_types,
        gpu_weights="quantized" if stage.weights.quantized else "dense",
        kv_pool=stage.kv_pool,
    )
    return {
        "weight_bytes": est.weight_bytes,
        "kv_bytes": est.kv_bytes,
        "work_bytes": est.work_bytes,
        "runtime_bytes": est.runtime_bytes,
    }


def find_llama_bench(exe: str) -> str:
    path = shutil.which(exe) or (exe if Path(exe).is_file() else None)
    if path is None:
        raise UserError(f"llama-bench not found at {exe!r}: build llama.cpp (target llama-bench) and pass its path")
    return path


def run_llama_bench(
    path: str,
    model: Path,
    device: torch.device,
    n_prompt: int,
    n_gen: int,
    repetitions: int,
    kv_types: tuple[str, str] = ("auto", "auto"),
    depth: int = 0,
) -> dict:
    """Upstream llama-bench on the same file, with our KV cache types (llama-bench's default is f16,
    ours `auto` = the compute dtype): {"prefill_tok_s", "decode_tok_s"} from its JSON output."""
    cmd = [path, "-m", str(model), "-p", str(n_prompt), "-n", str(n_gen), "-r", str(repetitions), "-o", "json"]
    cmd += ["-d", str(depth)] if depth else []
    cmd += ["-ngl", "99" if device.type == "cuda" else "0", "-t", str(torch.get_num_threads())]
    for flag, kind in zip(("-ctk", "-ctv"), kv_types):
        if kind != "auto":
            cmd += [flag, kind]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    except OSError as e:
        raise UserError(f"cannot run llama-bench {path}: {e.strerror}") from None
    if done.returncode != 0:
        raise UserError(f"llama-bench failed (exit {done.returncode}): {done.stderr.strip()[-500:]}")
    try:
        rows = json.loads(done.stdout)
    except json.JSONDecodeError:
        raise UserError("llama-bench printed no JSON (is it a recent build with `-o json`?)") from None
    out = {}
    for row in rows:
        key = "decode_tok_s" if row.get("n_gen") else "prefill_tok_s"
        out[key] = float(row["avg_ts"])
    return out


def main(args, cache_dir: Path | None) -> int:
    for flag in ("n_prompt", "n_gen", "repetitions", "depth"):
        if getattr(args, flag) < 0 or (flag == "repetitions" and args.repetitions < 1):
            raise UserError(f"--{flag.replace('_', '-')} must be {'≥ 1' if flag == 'repetitions' else '≥ 0'}")
    if args.depth and args.n_prompt:  # llama-bench would prefill at depth too; ours does not
        raise UserError("--depth applies to the decode test only: pass -p 0 with it")
    model = model_path(args.model)
    llama_bench = find_llama_bench(args.llama_bench) if args.llama_bench else None  # fail before our run
    # On CUDA the decode step is compiled before graph capture (fused element-wise kernels: ~1.6x decode).
    options = {
        "cache_dir": cache_dir,
        "quantized": None if args.gpu_weights == "quantized" else False,
        "compile_decode": not args.no_compile,
        "kv_types": (args.cache_type_k, args.cache_type_v),
        "deterministic": args.deterministic,
    }
    result = run_bench(
        model, args.device, args.dtype, args.n_prompt, args.n_gen, args.repetitions, args.depth, **options
    )
    if llama_bench:
        if torch.cuda.is_available():  # our stage is gone: its cached blocks would starve llama-bench's load
            gc.collect()  # the stage's graphs hold it in reference cycles
            torch.cuda.empty_cache()
        theirs = run_llama_bench(
            llama_bench,
            model,
            torch.device(result["device"]),
            args.n_prompt,
            args.n_gen,
            args.repetitions,
            options["kv_types"],
            args.depth,
        )
        result["llama_bench"] = theirs
        for key, value in theirs.items():
            if key in result and value:
                result[key.replace("_tok_s", "_ratio")] = round(result[key] / value, 3)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"model   {result['model']} ({result['arch']})")
    print(
        f"device  {result['device']}  dtype {result['dtype']}  weights {result['weights']}  threads {result['threads']}"
    )
    print(f"load    {result['load_s']:.2f} s   weights read per token {result['weight_bytes'] / 1e6:.1f} MB")
    if result["load_avg"] > 0.5 * (os.cpu_count() or 1):
        print(
            f"note    load average {result['load_avg']} on {os.cpu_count()} cores: other processes compete, rates are lower bounds"
        )
    if "prefill_tok_s" in result:
        line = f"prefill {result['prefill_tok_s']:10.1f} ± {result['prefill_tok_s_std']:.1f} tok/s  (p={args.n_prompt})"
        if "prefill_ratio" in result:
            line += f"   llama-bench {result['llama_bench']['prefill_tok_s']:.1f}  ours/theirs {result['prefill_ratio']:.2f}"
        print(line)
    if "decode_tok_s" in result:
        line = f"decode  {result['decode_tok_s']:10.1f} ± {result['decode_tok_s_std']:.1f} tok/s  (n={args.n_gen}, d={args.depth})  {result['decode_gb_s']:.1f} GB/s"
        if "decode_ratio" in result:
            line += (
                f"   llama-bench {result['llama_bench']['decode_tok_s']:.1f}  ours/theirs {result['decode_ratio']:.2f}"
            )
        print(line)
    sys.stdout.flush()
    return 0
