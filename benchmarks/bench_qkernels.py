"""Quantized-weight matmuls on CUDA against bf16 cuBLAS on the dequantized weight.

    python benchmarks/bench_qkernels.py [--sweep] [--types Q4_K,Q6_K] [--rows 1,4,16,512]

Shapes are out x in. x is bf16. Each timing replays a CUDA graph that runs the op once over
each of several weight copies (together well over the L2 cache), so launches and cache hits
stay out of the numbers; the median of the replays over the copies is one call.
Decode rows report weight GB/s, prefill rows TFLOP/s. From 8 to 16 rows both the fused GEMV and
dequantize-into-scratch + cuBLAS are timed; beyond, scratch + cuBLAS.
`--sweep` first times GEMV configurations (`_sweep_grid`: today's, and the int8-x dp4a variant over
tiles and warps) on every type of `--types` at each of `--rows` over `SWEEP_SHAPES` (the 7.2B's and
the 27B's matrices), each checked against the reference; prints GB/s per configuration and shape and
the fastest per row count as a `GEMV_CONFIGS` line, and uses them for the table (`--sweep-only`: no table).

    python benchmarks/bench_qkernels.py --sweep-only --types Q4_K,Q5_K,Q6_K --rows 1,4,8

`--qmma` times the tensor-core GEMM (triton_qmma.py) instead, over `_qmma_grid`'s QMMA_CONFIGS tiles on
the 27B's matrices (`QMMA_SHAPES`; add the 248320x5120 output head with --shapes), Q5_K and Q6_K at 4,
8, 16 and 32 rows, beside the GEMV (8 rows a pass) and scratch + cuBLAS, every path checked against the
reference first; prints GB/s per configuration and shape, each row count's cost against a one-row GEMV
step, the fastest tile per row count as a QMMA_CONFIGS line and the QMMA_MIN_ROWS from which it beats
the GEMV. About 200 s on an H100 (--budget-s, compiles included):

    python benchmarks/bench_qkernels.py --qmma
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import triton
from gguf.constants import GGMLQuantizationType as T

from hydra_console.engine.kernels import LAYOUTS, QuantWeight
from hydra_console.engine.kernels.qlinear import dense
from hydra_console.engine.kernels.triton_qmatmul import GEMV_CONFIGS, GEMV_MAX_ROWS, fused_matmul
from hydra_console.engine.kernels.triton_qmma import QMMA_CONFIGS, qmma_launch
from hydra_console.engine.kernels.triton_qplanes import planes_args
from hydra_console.engine.synth.blocks import random_blocks

SHAPES = ((4096, 4096), (14336, 4096), (4096, 14336), (2048, 8192), (32000, 4096))
ROTATE_BYTES = 256 << 20  # several times the H200's 50 MB L2
DEVICE = "cuda"


def time_per_call(fns, rep: int = 100) -> float:
    """Median seconds of one call, each of `fns` (one per weight copy) run once per graph replay."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    return triton.testing.do_bench(graph.replay, warmup=10, rep=rep, return_mode="median") * 1e-3 / len(fns)


def _copies(w: QuantWeight) -> list[QuantWeight]:
    return [
        QuantWeight(w.qtype, w.shape, {p: t.clone() for p, t in w.planes.items()})
        for _ in range(max(1, ROTATE_BYTES // w.nbytes))
    ]


SWEEP_SHAPES = ((4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336), (5120, 5120), (34816, 5120), (5120, 17408))


def _sweep_grid(rows: int) -> list[tuple]:
    """GEMV configurations to time at `rows`: today's tile with float x, then the int8-x (dp4a) variant over
    (BLOCK_N, warps, 32-element tiles per thread and step): BLOCK_K = tiles * 32 * threads / BLOCK_N."""
    grid = [GEMV_CONFIGS[rows][:4] + (0,)]
    shapes = [(bn, 4, 1) for bn in (2, 4, 8, 16)] + [(bn, 4, 2) for bn in (2, 4, 8)] + [(bn, 8, 1) for bn in (2, 4, 8)]
    if rows > 1:  # fewer rows per program: x's rows are in registers already
        shapes = [(2, 4, 1), (4, 4, 1), (8, 4, 1), (4, 4, 2), (8, 4, 2), (4, 8, 1), (8, 8, 1)]
    return grid + [(bn, tiles * 32 * warps * 32 // bn, warps, 8, 1) for bn, warps, tiles in shapes]


def _sweep_weights(types: list[T], shapes, rng: np.random.Generator) -> dict[tuple, list[QuantWeight]]:
    """(type, out, in) -> copies of one random weight (together over the L2 cache)."""
    return {
        (qt, n, k): _copies(QuantWeight.from_gguf(random_blocks((n, k), qt, 1 / 64, rng), qt, (n, k), device=DEVICE))
        for qt in types
        for n, k in shapes
    }


def _sweep_inputs(weights: dict, shapes, rows: int) -> tuple[dict, dict]:
    """bf16 x of `rows` rows per input width, and each weight's float32 reference product."""
    xs = {k: torch.randn(rows, k, device=DEVICE, dtype=torch.bfloat16) for _, k in shapes}
    return xs, {key: xs[key[2]].float() @ dense(ws[0], torch.float32).T for key, ws in weights.items()}


def _checked_times(op, weights: dict, xs: dict, refs: dict) -> tuple[float, dict[T, float], list[str]] | str:
    """`op(x, w)` over every weight, each checked against its reference before it is timed: (summed
    seconds, seconds by type, GB/s cells), or why it was not timed."""
    total, by_type, cells = 0.0, {}, []
    for (qt, n, k), ws in weights.items():
        x, ref = xs[k], refs[qt, n, k]
        try:
            err = float((op(x, ws[0]).float() - ref).abs().max() / ref.abs().max())
        except Exception as e:  # a variant that does not build here is reported, the sweep goes on
            return f"FAILED: {type(e).__name__}: {str(e)[:300]}"
        if not err < 2e-2:
            return f"WRONG for {qt.name} {n}x{k}: max rel err {err:.2e}"
        t = time_per_call([lambda w=w: op(x, w) for w in ws], rep=20)
        total += t
        by_type[qt] = by_type.get(qt, 0.0) + t
        cells.append(f"{ws[0].nbytes / t / 1e9:.0f}")
    return total, by_type, cells


def _sweep(types: list[T], row_counts: list[int], shapes, rng: np.random.Generator, budget_s: float) -> None:
    """Time each configuration of `_sweep_grid` on every type and shape (each checked against the
    reference first); print GB/s per configuration and shape, then the fastest per row count over all
    types and shapes (summed time) as the line for GEMV_CONFIGS. Each row count gets an equal share
    of `budget_s` (compiles included): its grid stops at 70 % of it, the refinements at 100 %."""
    began = time.monotonic()
    weights = _sweep_weights(types, shapes, rng)
    best: dict[int, tuple] = {}
    for n_done, rows in enumerate(row_counts):
        start = time.monotonic()
        share = (budget_s - (start - began)) / (len(row_counts) - n_done)
        mr = triton.next_power_of_2(rows)
        saved = GEMV_CONFIGS[mr]
        xs, refs = _sweep_inputs(weights, shapes, rows)
        totals: dict[tuple, float] = {}
        per_type: dict[tuple, dict[T, float]] = {}

        def measure(cfg, until: float) -> None:
            if time.monotonic() - start > until * share:
                print(f"| {rows} | {cfg} | skipped: the sweep's time budget (--budget-s) is spent |", flush=True)
                return
            GEMV_CONFIGS[mr] = cfg
            result = _checked_times(fused_matmul, weights, xs, refs)
            if isinstance(result, str):
                print(f"| {rows} | {cfg} | {result} |", flush=True)
                return
            total, per_type[cfg], cells = result
            totals[cfg] = total
            print(f"| {rows} | {cfg} | " + " | ".join(cells) + f" | {total * 1e6:.1f} |", flush=True)

        cols = [f"{qt.name} {n}x{k}" for qt, n, k in weights]
        print(f"\nsweep, {rows} rows: GB/s of weight bytes per type and shape (out x in); last column the summed µs")
        print("| rows | (BLOCK_N, BLOCK_K, warps, programs/SM, x int8 terms) | " + " | ".join(cols) + " | µs |")
        print("|---" * (len(cols) + 3) + "|")
        grid = _sweep_grid(mr)
        for cfg in grid:
            measure(cfg, 0.7)
        if not totals:
            GEMV_CONFIGS[mr] = saved
            continue
        top = min(totals, key=totals.get)
        for per_sm in (2, 4, 16):  # then how many programs split-K aims for, around the best tile
            if top[:3] + (per_sm,) + top[4:] not in totals:
                measure(top[:3] + (per_sm,) + top[4:], 1.0)
        top = min(totals, key=totals.get)
        if top[4] == 1:  # and x in two int8 terms (~15 bits, near bf16's 8-bit rounding error away)
            measure(top[:4] + (2,) + top[5:], 1.0)
        best[mr] = min(totals, key=totals.get)
        if grid[0] in totals:
            print(f"best for {rows} rows: {best[mr]}, {totals[grid[0]] / totals[best[mr]]:.2f}x float x {grid[0]}")
        for qt in types:
            alone = min(per_type, key=lambda c: per_type[c][qt])
            print(
                f"  {qt.name} alone: best {alone}, {per_type[alone][qt] * 1e6:.1f} µs over the shapes "
                f"(float x {per_type.get(grid[0], {}).get(qt, float('nan')) * 1e6:.1f})"
            )
        GEMV_CONFIGS[mr] = saved
    GEMV_CONFIGS.update(best)
    if 2 not in best and 4 in best:
        GEMV_CONFIGS[2] = best[4]
    print(f"GEMV_CONFIGS = {GEMV_CONFIGS}")


QMMA_SHAPES = ((34816, 5120), (5120, 17408), (12288, 5120))  # the 27B's gate+up, down, attention's qkv


def _qmma_grid(block_m: int) -> list[tuple]:
    """QMMA_CONFIGS tiles to time first: (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, programs/SM, SWAP).
    Each compiles once a type and BLOCK_M (a few seconds): few enough for the budget. The decoded
    [BLOCK_N, BLOCK_K] tile sits in registers as float32 before its rounding: 8 warps where it is 32K
    elements."""
    swapped = [(64, 256, 4, 1, 4), (128, 256, 8, 1, 4), (64, 128, 4, 1, 4), (64, 512, 8, 1, 4), (64, 256, 4, 3, 4)]
    plain = [(64, 256, 4, 1, 4), (32, 256, 4, 1, 4), (128, 128, 4, 1, 4)]
    return [(block_m, *t, True) for t in swapped] + [(block_m, *t, False) for t in plain]


def _qmma_sweep(types: list[T], row_counts: list[int], shapes, rng: np.random.Generator, budget_s: float) -> None:
    """Per row count: the GEMV (GEMV_MAX_ROWS rows a pass) and scratch + cuBLAS, then `_qmma_grid`'s
    tiles and refinements around the fastest (programs per SM, stages), on every type and shape, each
    checked against the reference before it is timed. Row counts share what is left of `budget_s`
    after the set-up equally; a row count's grid stops at 75 % of its share, its refinements at 100 %."""
    began = time.monotonic()
    weights = _sweep_weights(types, shapes, rng)
    nbytes = sum(ws[0].nbytes for ws in weights.values())
    cols = [f"{qt.name} {n}x{k}" for qt, n, k in weights]
    one = _checked_times(fused_matmul, weights, *_sweep_inputs(weights, shapes, 1))
    step = one[0] if isinstance(one, tuple) else float("nan")
    print(f"\none-row GEMV step over the {len(cols)} matrices: {step * 1e6:.1f} µs, {nbytes / step / 1e9:.0f} GB/s")
    best: dict[int, tuple] = {}
    gemv: dict[int, float] = {}
    qmma: dict[int, float] = {}
    for n_done, rows in enumerate(row_counts):
        start = time.monotonic()
        share = (budget_s - (start - began)) / (len(row_counts) - n_done)
        xs, refs = _sweep_inputs(weights, shapes, rows)
        print(f"\n{rows} rows: GB/s of weight bytes per type and shape (out x in); µs summed; × the one-row step")
        print("| path | " + " | ".join(cols) + " | µs | × step |")
        print("|---" * (len(cols) + 3) + "|")
        totals: dict[tuple, float] = {}

        def report(path, result) -> float | None:
            if isinstance(result, str):
                print(f"| {path} | {result} |", flush=True)
                return None
            total, _, cells = result
            print(f"| {path} | " + " | ".join(cells) + f" | {total * 1e6:.1f} | {total / step:.2f} |", flush=True)
            return total

        gemv[rows] = report("GEMV", _checked_times(fused_matmul, weights, xs, refs)) or float("inf")
        report("scratch+cuBLAS", _checked_times(_scratch, weights, xs, refs))

        def measure(cfg, until: float) -> None:
            if cfg in totals:
                return
            if time.monotonic() - start > until * share:
                print(f"| {cfg} | skipped: this row count's share of --budget-s is spent |", flush=True)
                return
            t = report(cfg, _checked_times(lambda x, w, c=cfg: qmma_launch(x, planes_args(w), c), weights, xs, refs))
            if t is not None:
                totals[cfg] = t

        for cfg in _qmma_grid(triton.next_power_of_2(max(rows, 8))):
            measure(cfg, 0.75)
        if not totals:
            print(f"| {rows} rows: no tile timed (the budget, --budget-s, or every tile failed) |")
            continue
        top = min(totals, key=totals.get)
        for per_sm in (2, 8, 16):  # then how many programs split-K aims for (no compile), and pipelining
            measure(top[:5] + (per_sm,) + top[6:], 1.0)
        top = min(totals, key=totals.get)
        for stages in (1, 2, 3):
            measure(top[:4] + (stages,) + top[5:], 1.0)
        best[rows], qmma[rows] = min(totals, key=totals.get), min(totals.values())
        print(
            f"best for {rows} rows: {best[rows]}, {qmma[rows] * 1e6:.1f} µs ({qmma[rows] / step:.2f}× the one-row"
            f" step), {gemv[rows] / qmma[rows]:.2f}× the GEMV"
        )
    configs = dict(QMMA_CONFIGS)
    for mr in configs:  # each row count's tile from the fewest measured rows it serves (BLOCK_M >= rows)
        if serving := [r for r in best if triton.next_power_of_2(r) >= mr]:
            configs[mr] = best[min(serving)]
    print(f"QMMA_CONFIGS = {configs}")
    wins = [r for r in row_counts if r in qmma and qmma[r] < gemv[r]]
    first = next((r for r in sorted(wins) if all(q in wins for q in row_counts if q >= r)), None)
    verdict = (
        f"the tensor-core GEMM beats the GEMV from {first} of rows {row_counts}"
        if first
        else "it beat the GEMV at no timed row count"
    )
    print(f"QMMA_MIN_ROWS = {first or 33}  # {verdict}")
    print(f"sweep took {time.monotonic() - began:.0f} s (budget {budget_s:.0f} s)")


def _scratch(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    return x @ dense(w, x.dtype).T


def _copy_bandwidth() -> float:
    a = torch.empty(1 << 30, dtype=torch.uint8, device=DEVICE)
    b = torch.empty_like(a)
    t = triton.testing.do_bench(lambda: b.copy_(a), warmup=20, rep=100, return_mode="median") * 1e-3
    return 2 * a.numel() / t / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    every = ",".join(t.name for t in (T.Q4_K, T.Q6_K, T.Q5_K, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1))
    ap.add_argument("--types", help=f"default {every}; with --qmma Q5_K,Q6_K")
    ap.add_argument("--rows", help="default 1,4,8,16,512; with --qmma 4,8,12,16,32")
    ap.add_argument("--sweep", action="store_true", help="time GEMV configurations first (see --sweep-only)")
    ap.add_argument("--sweep-only", action="store_true", help="the sweep and its GEMV_CONFIGS line, no table")
    ap.add_argument("--qmma", action="store_true", help="sweep the tensor-core GEMM's tiles (module doc), no table")
    ap.add_argument("--shapes", default="", help="out x in list for the sweeps, e.g. 4096x4096,28672x4096")
    ap.add_argument("--budget-s", type=float, help="the sweep's time, shared by its row counts (480 s; --qmma 200)")
    args = ap.parse_args()
    types = [T[name] for name in (args.types or ("Q5_K,Q6_K" if args.qmma else every)).split(",")]
    row_counts = [int(r) for r in (args.rows or ("4,8,12,16,32" if args.qmma else "1,4,8,16,512")).split(",")]
    rng = np.random.default_rng(0)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")] if args.shapes else None
    print(f"{torch.cuda.get_device_name()}: device copy {_copy_bandwidth():.0f} GB/s (read + write)")
    if args.qmma:
        _qmma_sweep([t for t in types if t in LAYOUTS], row_counts, shapes or QMMA_SHAPES, rng, args.budget_s or 200)
        return
    if args.sweep or args.sweep_only:
        _sweep([t for t in types if t in LAYOUTS], row_counts, shapes or SWEEP_SHAPES, rng, args.budget_s or 480)
        if args.sweep_only:
            return
    print("| type | shape (out x in) | rows | path | µs | GB/s | TFLOP/s | bf16 cuBLAS µs | bf16 TFLOP/s | speed-up |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for qt in types:
        if qt not in LAYOUTS:
            raise SystemExit(f"no kernel for {qt.name}")
        for n, k in SHAPES:
            raw = random_blocks((n, k), qt, 1 / 64, rng)
            w0 = QuantWeight.from_gguf(raw, qt, (n, k), device=DEVICE)
            ws = _copies(w0)
            dense_w = dense(w0, torch.bfloat16)
            denses = [dense_w] + [dense_w.clone() for _ in range(max(1, ROTATE_BYTES // (dense_w.numel() * 2)) - 1)]
            for rows in row_counts:
                x = torch.randn(rows, k, device=DEVICE, dtype=torch.bfloat16)
                t_ref = time_per_call([lambda d=d: x @ d.T for d in denses])
                paths = {"fused": fused_matmul} if rows <= GEMV_MAX_ROWS else {}
                if rows >= 4:  # where one dequantization shared by all rows may beat the GEMV
                    paths["scratch+cuBLAS"] = _scratch
                for path, op in paths.items():
                    t = time_per_call([lambda w=w: op(x, w) for w in ws])
                    flops = 2 * rows * n * k
                    print(
                        f"| {qt.name} | {n}x{k} | {rows} | {path} | {t * 1e6:.1f} | {w0.nbytes / t / 1e9:.0f} | "
                        f"{flops / t / 1e12:.1f} | {t_ref * 1e6:.1f} | {flops / t_ref / 1e12:.1f} | {t_ref / t:.2f} |",
                        flush=True,
                    )
            del ws, denses, dense_w, w0
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
