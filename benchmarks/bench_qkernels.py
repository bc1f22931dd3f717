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


def _sweep(types: list[T], row_counts: list[int], shapes, rng: np.random.Generator, budget_s: float) -> None:
    """Time each configuration of `_sweep_grid` on every type and shape (each checked against the
    reference first); print GB/s per configuration and shape, then the fastest per row count over all
    types and shapes (summed time) as the line for GEMV_CONFIGS. Each row count gets an equal share
    of `budget_s` (compiles included): its grid stops at 70 % of it, the refinements at 100 %."""
    began = time.monotonic()
    weights = {}
    for qt in types:
        for n, k in shapes:
            raw = random_blocks((n, k), qt, 1 / 64, rng)
            w = QuantWeight.from_gguf(raw, qt, (n, k), device=DEVICE)
            weights[qt, n, k] = _copies(w)
    best: dict[int, tuple] = {}
    for n_done, rows in enumerate(row_counts):
        start = time.monotonic()
        share = (budget_s - (start - began)) / (len(row_counts) - n_done)
        mr = triton.next_power_of_2(rows)
        saved = GEMV_CONFIGS[mr]
        xs = {k: torch.randn(rows, k, device=DEVICE, dtype=torch.bfloat16) for _, k in shapes}
        refs = {key: xs[key[2]].float() @ dense(ws[0], torch.float32).T for key, ws in weights.items()}
        totals: dict[tuple, float] = {}
        per_type: dict[tuple, dict[T, float]] = {}

        def measure(cfg, until: float) -> None:
            if time.monotonic() - start > until * share:
                print(f"| {rows} | {cfg} | skipped: the sweep's time budget (--budget-s) is spent |", flush=True)
                return
            GEMV_CONFIGS[mr] = cfg
            cells = []
            total = 0.0
            mine: dict[T, float] = {}
            for qt in types:
                for n, k in shapes:
                    ws, x, ref = weights[qt, n, k], xs[k], refs[qt, n, k]
                    try:
                        err = float((fused_matmul(x, ws[0]).float() - ref).abs().max() / ref.abs().max())
                    except Exception as e:  # a variant that does not build here is reported, the sweep goes on
                        print(f"| {rows} | {cfg} | FAILED: {type(e).__name__}: {str(e)[:300]} |", flush=True)
                        return
                    if not err < 2e-2:
                        print(f"| {rows} | {cfg} | WRONG for {qt.name} {n}x{k}: max rel err {err:.2e} |", flush=True)
                        return
                    t = time_per_call([lambda w=w: fused_matmul(x, w) for w in ws], rep=20)
                    total += t
                    mine[qt] = mine.get(qt, 0.0) + t
                    cells.append(f"{ws[0].nbytes / t / 1e9:.0f}")
            totals[cfg], per_type[cfg] = total, mine
            print(f"| {rows} | {cfg} | " + " | ".join(cells) + f" | {total * 1e6:.1f} |", flush=True)

        cols = [f"{qt.name} {n}x{k}" for qt in types for n, k in shapes]
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


def _scratch(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    return x @ dense(w, x.dtype).T


def _copy_bandwidth() -> float:
    a = torch.empty(1 << 30, dtype=torch.uint8, device=DEVICE)
    b = torch.empty_like(a)
    t = triton.testing.do_bench(lambda: b.copy_(a), warmup=20, rep=100, return_mode="median") * 1e-3
    return 2 * a.numel() / t / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--types", default=",".join(t.name for t in (T.Q4_K, T.Q6_K, T.Q5_K, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1))
    )
    ap.add_argument("--rows", default="1,4,8,16,512")
    ap.add_argument("--sweep", action="store_true", help="time GEMV configurations first (see --sweep-only)")
    ap.add_argument("--sweep-only", action="store_true", help="the sweep and its GEMV_CONFIGS line, no table")
    ap.add_argument("--shapes", default="", help="out x in list for the sweep, e.g. 4096x4096,28672x4096")
    ap.add_argument("--budget-s", type=float, default=480, help="the sweep's time, shared by its row counts")
    args = ap.parse_args()
    types = [T[name] for name in args.types.split(",")]
    row_counts = [int(r) for r in args.rows.split(",")]
    rng = np.random.default_rng(0)
    print(f"{torch.cuda.get_device_name()}: device copy {_copy_bandwidth():.0f} GB/s (read + write)")
    if args.sweep or args.sweep_only:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")] if args.shapes else SWEEP_SHAPES
        _sweep([t for t in types if t in LAYOUTS], row_counts, shapes, rng, args.budget_s)
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
