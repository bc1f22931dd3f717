"""The dense 16-bit GEMV (`hydra::dmm`) against cuBLAS (`F.linear`) at decode's row counts, CUDA.

    python benchmarks/bench_dense_gemv.py [--sweep] [--rows 1,2,4,8] [--shapes 1b|7b|all]

Shapes are out x in, bf16 weight and x: the synthetic 1.1B llama's matrices (its Q/K/V joined, gate
and up joined, the output head) and the 7.2B's. Timings as `bench_qkernels.py` (a CUDA graph over
weight copies well past the L2 cache; the median replay over the copies is one call); GB/s counts the
weight's bytes. Every configuration is checked against float32 first. `--sweep` times
(BLOCK_N, BLOCK_K, warps, programs per SM) over a grid at each row count and prints the fastest over
all shapes (summed time) as a DENSE_GEMV_CONFIGS line, then uses it for the table; without it, row
counts past DENSE_GEMV_CONFIGS (left to cuBLAS) are timed with its last configuration.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F
import triton
from bench_qkernels import ROTATE_BYTES, time_per_call

from hydra_console.engine.kernels.triton_dense import DENSE_GEMV_CONFIGS, dense_gemv

SHAPES = {
    "1b": ((3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (32000, 2048)),
    "7b": ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (32000, 4096)),
}
GRID = list(itertools.product((2, 4, 8), (512, 1024, 2048), (4, 8), (2, 4, 8)))


def _weights(n: int, k: int) -> list[torch.Tensor]:
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    return [w.clone() for _ in range(max(1, ROTATE_BYTES // w.nbytes))]


def _check(x: torch.Tensor, w: torch.Tensor, config) -> None:
    ref = x.float() @ w.float().T
    got = dense_gemv(x, w, config).float()
    err = ((got - ref).abs().max() / ref.abs().max()).item()
    if err > 1e-2:
        raise AssertionError(f"dense GEMV {config} on {tuple(w.shape)} x {x.shape[0]} rows: relative error {err:.2e}")


def _time(rows: int, ws: list[torch.Tensor], config, rep: int = 100) -> float:
    x = torch.randn(rows, ws[0].shape[1], device="cuda", dtype=torch.bfloat16)
    if config == "cublas":
        return time_per_call([lambda w=w: F.linear(x, w) for w in ws], rep)
    _check(x, ws[0], config)
    return time_per_call([lambda w=w: dense_gemv(x, w, config) for w in ws], rep)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--shapes", default="1b", choices=[*SHAPES, "all"])
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    shapes = [s for name, group in SHAPES.items() if args.shapes in (name, "all") for s in group]
    weights = {s: _weights(*s) for s in shapes}
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    configs = dict(DENSE_GEMV_CONFIGS)
    if args.sweep:
        for rows in rows_list:
            totals = {}
            for config in GRID:
                totals[config] = sum(_time(rows, weights[s], config, rep=25) for s in shapes)
            best = min(totals, key=totals.get)
            for config, t in sorted(totals.items(), key=lambda kv: kv[1])[:5]:
                print(f"sweep rows={rows} {config}: {t * 1e6:8.1f} us over the shapes")
            configs[triton.next_power_of_2(rows)] = best
        print("DENSE_GEMV_CONFIGS = {" + ", ".join(f"{r}: {c}" for r, c in sorted(configs.items())) + "}")
    print(f"{'rows':>4} {'out x in':>13} {'cuBLAS us':>10} {'GB/s':>6} {'GEMV us':>9} {'GB/s':>6} {'speedup':>7}")
    for rows in rows_list:
        sum_c = sum_g = 0.0
        for n, k in shapes:
            ws = weights[n, k]
            t_c = _time(rows, ws, "cublas")
            t_g = _time(rows, ws, configs.get(triton.next_power_of_2(rows), configs[max(configs)]))
            sum_c, sum_g = sum_c + t_c, sum_g + t_g
            gb = ws[0].nbytes / 1e9
            print(
                f"{rows:>4} {f'{n}x{k}':>13} {t_c * 1e6:10.1f} {gb / t_c:6.0f} {t_g * 1e6:9.1f} {gb / t_g:6.0f} "
                f"{t_c / t_g:7.2f}"
            )
        print(f"{rows:>4} {'all':>13} {sum_c * 1e6:10.1f} {'':>6} {sum_g * 1e6:9.1f} {'':>6} {sum_c / sum_g:7.2f}")


if __name__ == "__main__":
    main()
