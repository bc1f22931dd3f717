"""qwen35 prefill through one Gated DeltaNet layer on CUDA: the torch forms (`_chunked` + the token
loop, model/deltanet.py) against the Triton chunked kernel (`kernels/triton_delta_rule.py`).

    python benchmarks/bench_delta_rule.py [--tokens 512,4096,16384] [--layer] [--json]

The default shape is Qwen3.5-27B's: 48 V heads on 16 Q/K heads, head dims 128 (`--v-heads`,
`--k-heads`, `--dim`). For each prompt length T (one slot, state and checkpoints kept as in serving)
it times `DeltaNet._delta_rule`, the gated delta rule alone, through each path: the torch forms,
the kernel with each of `--precisions` (tl.dot's: tf32, a 16-bit model's; tf32x3 / ieee, float32
ones), and prints the kernel's largest difference from the torch forms (outputs, final state).
`--profile` prints each kernel's time in one call. `--layer` also times the whole layer
(`DeltaNet.__call__`: input product, conv, gates, the rule, gated norm, output product) of a one-layer
synthetic file of the same shape (hidden 5120, BF16 weights) both ways: the torch forms, and on
CUDA `DeltaNet._prefill` (the conv + gates kernel, the rule's kernels with the gated output).
Timings are medians of `--reps` runs after one warm-up (the first kernel call compiles).
`--sweep` first times the kernel's launch settings (`triton_delta_rule.CONFIG`: `wy_solve`, each
kernel's tile, warps and stages, one at a time from the current ones) at each length, prints the
fastest, and uses it for the table.

    python benchmarks/bench_delta_rule.py --layer            # the comparison
    python benchmarks/bench_delta_rule.py --profile --sweep  # where the kernel's time goes; settings
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from hydra_console.engine.model import ROLLBACK, ForwardBatch, deltanet
from hydra_console.engine.model.deltanet import DeltaNet


def timed(fn, reps: int) -> float:
    """Median seconds of fn() after one warm-up."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def rule_inputs(T: int, hv: int, hk: int, dim: int, seed: int = 0):
    """One slot's q, k (L2-normed, Q/K heads), v, gates as DeltaNet computes them: [1, T, ...]."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda")

    q = torch.nn.functional.normalize(randn(1, T, hk, dim), dim=-1)
    k = torch.nn.functional.normalize(randn(1, T, hk, dim), dim=-1)
    v = randn(1, T, hv, dim)
    g = torch.nn.functional.softplus(randn(1, T, hv)) * -torch.rand(hv, generator=gen, device="cuda").exp()
    b = torch.sigmoid(randn(1, T, hv))
    return q, k, v, g, b


def bench_rule(T: int, args) -> dict:
    hv, hk, dim = args.v_heads, args.k_heads, args.dim
    q, k, v, g, b = rule_inputs(T, hv, hk, dim)
    state0 = 0.1 * torch.randn(1, hv, dim, dim, device="cuda")
    net = SimpleNamespace(ssm_state=state0.clone(), ssm_ckpt=torch.zeros(1, ROLLBACK, hv, dim, dim, device="cuda"))
    slots = torch.zeros(1, dtype=torch.long, device="cuda")

    def run(kernel: bool, precision: str = ""):
        def go():
            deltanet.TRITON_PREFILL = kernel
            net.ssm_state.copy_(state0)
            return DeltaNet._delta_rule(net, q, k, v, g, b, slots, [T], torch.bfloat16)

        return go

    row = {"tokens": T}
    results = {}
    choose = deltanet._precision
    variants = [("torch", False, "")] if T <= args.torch_max else []
    for name, kernel, precision in variants + [(p, True, p) for p in args.precisions]:
        deltanet._precision = lambda dtype, p=precision: p
        row[f"{name}_ms"] = timed(run(kernel, precision), args.reps) * 1e3
        out = run(kernel, precision)()
        results[name] = (out.clone(), net.ssm_state.clone(), net.ssm_ckpt.clone())
    deltanet._precision = choose
    if "torch" in results:
        o, s, c = results["torch"]
        for name in args.precisions:
            ko, ks, kc = results[name]
            row[f"{name}_max_abs_out"] = float((ko - o).abs().max())
            row[f"{name}_max_abs_state"] = float((ks - s).abs().max())
            row[f"{name}_max_abs_ckpt"] = float((kc - c).abs().max())
    deltanet.TRITON_PREFILL = None
    return row


def sweep(T: int, args) -> dict:
    """The fastest `CONFIG` at T tokens (TF32), one setting varied at a time from the current one."""
    from hydra_console.engine.kernels import triton_delta_rule as tdr

    q, k, v, g, b = rule_inputs(T, args.v_heads, args.k_heads, args.dim)
    state = torch.zeros(1, args.v_heads, args.dim, args.dim, device="cuda")
    n = torch.tensor([T], dtype=torch.int32, device="cuda")
    options = {
        "wy_solve": ("rows", "blocks"),
        "state_stages": (1, 2, 3),
        "state_bv": (16, 32, 64),
        "state_warps": (4, 8),
        "out_bv": (32, 64, 128),
        "out_warps": (4, 8),
        "out_stages": (1, 2, 3),
        "wy_warps": (1, 2, 4),
        "wy_stages": (1, 2, 3),
    }
    best = dict(tdr.CONFIG)
    for key, values in options.items():
        times = {}
        for value in values:
            tdr.CONFIG = {**best, key: value}
            try:
                times[value] = timed(
                    lambda: tdr.chunk_gated_delta_rule(q, k, v, g, b, state, n, ROLLBACK, "tf32"), args.reps
                )
            except Exception as err:  # a setting that does not fit (shared memory) or compile here
                print(f"  T={T} {key}={value}: {type(err).__name__}: {str(err)[:200]}")
                times[value] = float("inf")
        best[key] = min(times, key=times.get)
        print(f"  T={T} {key}: " + ", ".join(f"{x}: {t * 1e3:.3f} ms" for x, t in times.items()))
    tdr.CONFIG = best
    print(f"T={T} fastest: CONFIG = {best}")
    return best


def profile(T: int, args, precision: str = "tf32") -> None:
    """CUDA time of each kernel of one call at T tokens (torch.profiler)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from hydra_console.engine.kernels.triton_delta_rule import chunk_gated_delta_rule

    q, k, v, g, b = rule_inputs(T, args.v_heads, args.k_heads, args.dim)
    state = torch.zeros(1, args.v_heads, args.dim, args.dim, device="cuda")
    n = torch.tensor([T], dtype=torch.int32, device="cuda")
    chunk_gated_delta_rule(q, k, v, g, b, state, n, ROLLBACK, precision)
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            chunk_gated_delta_rule(q, k, v, g, b, state, n, ROLLBACK, precision)
        torch.cuda.synchronize()
    print(f"T={T} {precision}: per call")
    for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total):
        if e.device_time_total > 0:
            print(f"  {e.key[:60]:<60} {e.device_time_total / 3e3:8.3f} ms")


def bench_layer(T: int, stage, args) -> dict:
    net = stage.recurrent[0]
    x = torch.randn(T, stage.cfg.n_embd, device="cuda", dtype=torch.bfloat16)
    batch = ForwardBatch.of_runs(
        torch.zeros(T, dtype=torch.long, device="cuda"), torch.arange(T, device="cuda"), [(0, 0, T)]
    )
    row = {"tokens": T}
    for name, kernel in (("layer_torch", False), ("layer_kernel", True)):
        if not kernel and T > args.torch_max:
            continue

        def go(kernel=kernel):
            deltanet.TRITON_PREFILL = kernel
            net.clear(0)
            return net(x, batch)

        row[f"{name}_ms"] = timed(go, args.reps) * 1e3
    deltanet.TRITON_PREFILL = None
    return row


def layer_stage(args):
    from hydra_console.engine.gguf_file import GGUFFile
    from hydra_console.engine.model import build_stage
    from hydra_console.engine.synth import write_synthetic

    path = Path(tempfile.mkdtemp()) / "q35-deltanet.gguf"
    write_synthetic(
        path,
        "qwen35",
        n_layers=2,  # layer 0 Gated DeltaNet, layer 1 full attention
        n_embd=5120,
        n_head=24,
        n_head_kv=4,
        head_dim=256,
        n_ff=256,
        n_ctx=max(args.tokens) + 64,
        qtype="BF16",
        ssm_state=args.dim,
        ssm_groups=args.k_heads,
        ssm_v_heads=args.v_heads,
    )
    return build_stage(
        GGUFFile(path), device="cuda", dtype="bfloat16", n_slots=1, n_ctx=max(args.tokens) + 64, cache_dir=None
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="512,4096,16384", help="prompt lengths")
    ap.add_argument("--v-heads", type=int, default=48)
    ap.add_argument("--k-heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128, help="head_k_dim = head_v_dim")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--torch-max", type=int, default=1 << 20, help="skip the torch forms past this length")
    ap.add_argument("--layer", action="store_true", help="also time the whole DeltaNet layer")
    ap.add_argument("--layers", type=int, default=48, help="DeltaNet layers of the model (per-prompt totals)")
    ap.add_argument("--sweep", action="store_true", help="time the kernel's launch settings first")
    ap.add_argument("--profile", action="store_true", help="print each kernel's time at every length")
    ap.add_argument("--precisions", default="tf32,tf32x3,ieee", help="the kernel's products to time")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    args.tokens = [int(t) for t in args.tokens.split(",")]
    args.precisions = args.precisions.split(",")
    torch.backends.cuda.matmul.allow_tf32 = False  # the torch forms in float32, as served

    print(torch.cuda.get_device_name(), f"V heads {args.v_heads}, Q/K heads {args.k_heads}, dims {args.dim}")
    if args.profile:
        for T in args.tokens:
            profile(T, args)
    if args.sweep:
        for T in args.tokens:
            sweep(T, args)
    rows = [bench_rule(T, args) for T in args.tokens]
    if args.layer:
        stage = layer_stage(args)
        for row, T in zip(rows, args.tokens):
            row.update(bench_layer(T, stage, args))
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    first = args.precisions[0]
    print(f"{'T':>6} {'torch ms':>10} " + " ".join(f"{p + ' ms':>10}" for p in args.precisions), end="")
    print(f" {'speedup':>8} {'x layers ms':>12}  max |Δ| out / state")
    for r in rows:
        t = r.get("torch_ms", float("nan"))
        d = ", ".join(
            f"{p} {r.get(p + '_max_abs_out', float('nan')):.1e} / {r.get(p + '_max_abs_state', float('nan')):.1e}"
            for p in args.precisions
        )
        times = " ".join(f"{r[p + '_ms']:>10.3f}" for p in args.precisions)
        print(
            f"{r['tokens']:>6} {t:>10.2f} {times} {t / r[first + '_ms']:>7.1f}x {r[first + '_ms'] * args.layers:>12.1f}  {d}"
        )
        if "layer_kernel_ms" in r:
            lt = r.get("layer_torch_ms", float("nan"))
            print(
                f"{'':>6} whole layer: torch forms {lt:.2f} ms, kernel {r['layer_kernel_ms']:.2f} ms "
                f"({r['tokens'] / r['layer_kernel_ms'] * 1e3:,.0f} tok/s per layer)"
            )


if __name__ == "__main__":
    main()
