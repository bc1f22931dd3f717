"""What a start pays to compile one decode layer, per layer kind, each mode in a fresh process:

    python benchmarks/bench_compile.py M.gguf [--device cuda] [--rows 4]

`jit`: torch.compile's first call (dynamo traces it on every start; inductor's and Triton's caches
may hold its kernels), `save`: `CompiledBlock` compiling and saving it, `load`: a `CompiledBlock`
over the same folder, which loads it (engine/model/compiled_block.py). Run it twice: the first
run's `jit` and `save` are cold. The first four layers of the file (a qwen35 stage: three recurrent,
one attention), `--rows` slots decoding one token each. Prints one line per mode and kind.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def child(path: str, device: str, rows: int, mode: str, folder: str) -> None:
    import torch

    from hydra_console.engine.gguf_file import GGUFFile
    from hydra_console.engine.model import build_stage
    from hydra_console.engine.model.attention import decode_bias
    from hydra_console.engine.model.compiled_block import CompiledBlock
    from hydra_console.engine.model.forward_batch import ForwardBatch
    from hydra_console.engine.model.layer import block

    kv = ("q8_0", "q8_0") if device == "cuda" else ("auto", "auto")
    st = build_stage(GGUFFile(path), (0, 4), device=device, n_slots=rows, n_ctx=8192, kv_types=kv)
    layers = list(st.layers.values())
    kinds = {"recurrent" if layer.deltanet is not None else "attention": layer for layer in layers}
    positions = torch.arange(3, 3 + rows, device=device)
    batch = ForwardBatch.batched(torch.arange(rows, device=device), positions, 1, kv_len=8192)
    cos, sin = st._rope_global
    rope = (cos[positions, None], sin[positions, None])
    compiled = torch.compile(block, dynamic=False) if mode == "jit" else CompiledBlock(Path(folder))
    for name, layer in kinds.items():
        bias = (
            None
            if device == "cuda" or layer.deltanet is not None
            else decode_bias(st.cfg, positions, 8192, 0, st.dtype)
        )
        h = torch.randn(rows, st.cfg.n_embd, device=device)
        t = time.perf_counter()
        compiled(layer, h, rope, batch, bias)
        if device == "cuda":
            torch.cuda.synchronize()
        print(f"{mode:5s} {name:9s} {time.perf_counter() - t:7.2f} s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.model, args.device, args.rows, *args.child)
    with tempfile.TemporaryDirectory() as folder:
        for mode in ("jit", "save", "load"):
            argv = [sys.executable, __file__, args.model, "--device", args.device, "--rows", str(args.rows)]
            subprocess.run([*argv, "--child", mode, folder], check=True)


if __name__ == "__main__":
    main()
