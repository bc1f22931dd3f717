"""Where a decode step's GPU time goes on the 1.1B llama shape (4 of its layers suffice per layer):
kernel table of eager decode steps, and the M=1 matrix-vector rate of each weight shape.

    python benchmarks/gpu_profile.py
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from hydra_console.engine.gguf_file import GGUFFile
from hydra_console.engine.model import build_stage
from hydra_console.engine.synth import write_synthetic

SHAPE = dict(n_layers=4, n_embd=2048, n_head=32, n_head_kv=8, n_ff=8192, vocab_size=32000, n_ctx=2048, qtype="F16")


def gemv_table() -> None:
    for n, k in ((3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (32000, 2048)):
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(8)]  # beat the 60 MB L2
        xk = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        for w in ws:
            F.linear(xk, w)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(50):
            for w in ws:
                F.linear(xk, w)
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / 400
        print(f"gemv {n}x{k}: {dt * 1e6:7.1f} us  {n * k * 2 / dt / 1e12:5.2f} TB/s")


def main() -> None:
    gemv_table()
    path = write_synthetic("/tmp/llama-4l.gguf", "llama", **SHAPE)
    g = GGUFFile(path)
    st = build_stage(g, device="cuda", dtype="bfloat16", n_slots=1, n_ctx=640)
    st.graphs = None
    slot = torch.zeros(1, dtype=torch.long)
    tok = torch.tensor([1], device="cuda")
    for i in range(4):
        tok = st.logits(st.run_layers(st.embed(tok), slot, torch.tensor([i]))).argmax(-1)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(4, 24):
        tok = st.logits(st.run_layers(st.embed(tok), slot, torch.tensor([i]))).argmax(-1)
    torch.cuda.synchronize()
    print(f"eager step, 4 layers: {(time.perf_counter() - t0) / 20 * 1e3:.2f} ms")
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        for i in range(24, 28):
            tok = st.logits(st.run_layers(st.embed(tok), slot, torch.tensor([i]))).argmax(-1)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12, max_name_column_width=60))


if __name__ == "__main__":
    main()
