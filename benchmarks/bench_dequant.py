"""Dequantization speed, ours (torch) vs `gguf.quants.dequantize` (numpy), and GGUF open time.

    python benchmarks/bench_dequant.py [--elements 4194304] [--device cpu|cuda] [--skip-gguf-reader]

Prints ms per million elements per type, the embedding-row gather, and the time to read
the default model's metadata + tensor table, ours vs `gguf.GGUFReader` (run once: ~12 s).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from gguf import GGUFReader
from gguf import quants as reference_quants
from gguf.constants import GGML_QUANT_SIZES

from hydra_console.engine.default_model import default_model_path
from hydra_console.engine.gguf_file import GGUFFile
from hydra_console.engine.quant import SUPPORTED_TYPES, dequantize, dequantize_rows


def best_of(fn, repeats: int, device: str = "cpu") -> float:
    """Fastest of `repeats` timed calls after one warm-up, in seconds (waiting for the GPU to finish)."""
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    fn()
    best = float("inf")
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t)
    return best


def bench_types(n_elements: int, device: str) -> None:
    rng = np.random.default_rng(0)
    print(
        f"dequantize, {n_elements / 1e6:.1f}M elements per tensor, torch on {device} "
        f"({torch.get_num_threads()} threads), best of 3 (numpy: best of 2)"
    )
    print(f"{'type':<8} {'torch ms/M':>11} {'numpy ms/M':>11} {'speedup':>8}")
    for qt in sorted(SUPPORTED_TYPES, key=lambda t: t.value):
        block, type_size = GGML_QUANT_SIZES[qt]
        row = 4096
        shape = (n_elements // row, row)
        raw = rng.integers(0, 256, shape[0] * row // block * type_size, dtype=np.uint8)
        data = torch.from_numpy(raw).to(device)
        ours = best_of(lambda: dequantize(data, qt, shape), 3, device)
        rows = raw.reshape(shape[0], -1)
        with np.errstate(all="ignore"):  # random bytes make inf/NaN scales: same work, no warnings
            ref = best_of(lambda: reference_quants.dequantize(rows, qt), 2)
        per_m = 1e3 * 1e6 / n_elements
        print(f"{qt.name:<8} {ours * per_m:>11.2f} {ref * per_m:>11.2f} {ref / ours:>7.1f}x")
    print("(F32: numpy returns a view of the bytes; ours returns a copy so the result is writable)")


def bench_model(device: str, run_gguf_reader: bool) -> None:
    path = default_model_path()
    opened = best_of(lambda: GGUFFile(path), 5)
    print(f"\nopen default model ({path.name}): GGUFFile metadata + tensor table {opened * 1e3:.0f} ms (best of 5)")
    if run_gguf_reader:
        t = time.perf_counter()
        GGUFReader(path)
        print(f"                                    gguf.GGUFReader {time.perf_counter() - t:.2f} s (once)")

    g = GGUFFile(path)
    emb = g.tensors["token_embd.weight"]
    raw = torch.from_numpy(g.raw(emb.name)).to(device)
    n_rows, row_len = emb.shape
    for n in (1, 512):
        ids = torch.randint(0, n_rows, (n,), device=device)
        t = best_of(lambda: dequantize_rows(raw, emb.ggml_type, row_len, ids), 5, device)
        print(f"token_embd rows ({emb.ggml_type.name} {n_rows}x{row_len}): {n} rows {t * 1e3:.2f} ms")
    t = best_of(lambda: dequantize(raw, emb.ggml_type, emb.shape), 1, device)
    print(f"token_embd full ({emb.n_elements / 1e6:.0f}M elements): {t * 1e3:.0f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--elements", type=int, default=1 << 22, help="elements per benchmarked tensor (multiple of 4096)")
    ap.add_argument("--device", default="cpu", help="torch device for our dequantizers")
    ap.add_argument("--skip-gguf-reader", action="store_true", help="do not time gguf.GGUFReader (~12 s)")
    args = ap.parse_args()
    if args.elements <= 0 or args.elements % 4096:
        ap.error("--elements must be a positive multiple of 4096")
    bench_types(args.elements, args.device)
    bench_model(args.device, not args.skip_gguf_reader)


if __name__ == "__main__":
    main()
