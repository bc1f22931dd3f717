"""Quantized-weight matmuls on CUDA against bf16 cuBLAS on the dequantized weight.

    python benchmarks/bench_qkernels.py [--sweep] [--types Q4_K,Q6_K] [--rows 1,4,16,512]

Shapes are out x in. x is bf16. Each timing replays a CUDA graph that runs the op once over
each of several weight copies (together well over the L2 cache), so launches and cache hits
stay out of the numbers; the median of the replays over the copies is one call.
Decode rows report weight GB/s, prefill rows TFLOP/s. From 8 to 16 rows both the fused GEMV and
dequantize-into-scratch + cuBLAS are timed; beyond, scratch + cuBLAS.
`--sweep` first times GEMV tile configurations on Q4_K shapes (each checked against the reference),
uses the fastest for the table and prints them for `GEMV_CONFIGS`.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
import triton
from gguf.constants import GGMLQuantizationType as T

from hydra_console.engine.kernels import LAYOUTS, QuantWeight
from hydra_console.engine.kernels.triton_qmatmul import GEMV_CONFIGS, GEMV_MAX_ROWS, fused_matmul
from hydra_console.engine.synth import random_blocks

SHAPES = ((4096, 4096), (14336, 4096), (4096, 14336), (2048, 8192), (32000, 4096))
ROTATE_BYTES = 256 << 20  # several times the H200's 50 MB L2


def _time_per_call(fns, rep: int = 100) -> float:
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
    return [QuantWeight(w.qtype, w.shape, {p: t.clone() for p, t in w.planes.items()})
            for _ in range(max(1, ROTATE_BYTES // w.nbytes))]


def _gemv_time(weights: list[list[QuantWeight]], rows: int) -> float:
    """Seconds of the GEMV over all the sweep's shapes, after checking it against the reference."""
    total = 0.0
    for ws in weights:
        x = torch.randn(rows, ws[0].shape[1], device="cuda", dtype=torch.bfloat16)
        ref = x.float() @ ws[0].dequantize().T
        err = float((fused_matmul(x, ws[0]).float() - ref).abs().max() / ref.abs().max())
        if not err < 1e-2:
            raise SystemExit(f"GEMV {GEMV_CONFIGS[rows]} for {rows} rows is wrong: max rel err {err:.2e}")
        total += _time_per_call([lambda w=w: fused_matmul(x, w) for w in ws], rep=30)
    return total


def _sweep(rng: np.random.Generator) -> None:
    """Time GEMV tiles per row count on Q4_K shapes; keep the fastest in GEMV_CONFIGS."""
    weights = []
    for n, k in ((4096, 4096), (14336, 4096)):
        raw = random_blocks((n, k), T.Q4_K, 1 / 64, rng)
        weights.append(_copies(QuantWeight.from_gguf(raw, T.Q4_K, (n, k), device="cuda")))
    grids = {  # (BLOCK_N, BLOCK_K, num_warps, programs per SM)
        1: [(bn, bk, nw, 8) for bn in (4, 8, 16, 32) for bk in (256, 512, 1024) for nw in (4, 8)],
        4: [(bn, bk, 4, 8) for bn in (4, 8, 16) for bk in (256, 512, 1024)],
        8: [(bn, bk, nw, 8) for bn in (4, 8) for bk in (256, 512) for nw in (4, 8)],
    }
    for rows, grid in grids.items():
        results = {}

        def measure(cfg):
            GEMV_CONFIGS[rows] = cfg
            results[cfg] = _gemv_time(weights, rows)
            print(f"sweep rows={rows} {cfg}: {results[cfg] * 1e6:.1f} µs", flush=True)

        for cfg in grid:
            measure(cfg)
        best = min(results, key=results.get)
        for per_sm in (2, 4, 16):  # then how many programs split-K aims for, around the best tile
            measure(best[:3] + (per_sm,))
        GEMV_CONFIGS[rows] = min(results, key=results.get)
    GEMV_CONFIGS[2] = GEMV_CONFIGS[4]
    print(f"GEMV_CONFIGS = {GEMV_CONFIGS}")


def _scratch(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    return x @ w.dequantize(x.dtype).T


def _copy_bandwidth() -> float:
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    t = triton.testing.do_bench(lambda: b.copy_(a), warmup=20, rep=100, return_mode="median") * 1e-3
    return 2 * a.numel() / t / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default=",".join(t.name for t in (T.Q4_K, T.Q6_K, T.Q5_K, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1)))
    ap.add_argument("--rows", default="1,4,8,16,512")
    ap.add_argument("--sweep", action="store_true", help="tune GEMV tiles first")
    args = ap.parse_args()
    types = [T[name] for name in args.types.split(",")]
    row_counts = [int(r) for r in args.rows.split(",")]
    rng = np.random.default_rng(0)
    print(f"{torch.cuda.get_device_name()}: device copy {_copy_bandwidth():.0f} GB/s (read + write)")
    if args.sweep:
        _sweep(rng)
    print("| type | shape (out x in) | rows | path | µs | GB/s | TFLOP/s | bf16 cuBLAS µs | bf16 TFLOP/s | speed-up |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for qt in types:
        if qt not in LAYOUTS:
            raise SystemExit(f"no kernel for {qt.name}")
        for n, k in SHAPES:
            raw = random_blocks((n, k), qt, 1 / 64, rng)
            w0 = QuantWeight.from_gguf(raw, qt, (n, k), device="cuda")
            ws = _copies(w0)
            dense = w0.dequantize(torch.bfloat16)
            denses = [dense] + [dense.clone() for _ in range(max(1, ROTATE_BYTES // (dense.numel() * 2)) - 1)]
            for rows in row_counts:
                x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
                t_ref = _time_per_call([lambda d=d: x @ d.T for d in denses])
                paths = {"fused": fused_matmul} if rows <= GEMV_MAX_ROWS else {}
                if rows >= 4:  # where one dequantization shared by all rows may beat the GEMV
                    paths["scratch+cuBLAS"] = _scratch
                for path, op in paths.items():
                    t = _time_per_call([lambda w=w: op(x, w) for w in ws])
                    flops = 2 * rows * n * k
                    print(f"| {qt.name} | {n}x{k} | {rows} | {path} | {t * 1e6:.1f} | {w0.nbytes / t / 1e9:.0f} | "
                          f"{flops / t / 1e12:.1f} | {t_ref * 1e6:.1f} | {flops / t_ref / 1e12:.1f} | {t_ref / t:.2f} |",
                          flush=True)
            del ws, denses, dense, w0
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
