"""Decode attention and KV memory on the 1.1B shape (hidden 2048, 16 layers, 32/8 heads, head size 64).

    python benchmarks/bench_kv.py [--batches 1,8,64] [--contexts 512,2048,8192,32768] [--types f16,q8_0]
    python benchmarks/bench_kv.py --serve [--model PATH]   # + 64 streams through `serve`, reserved and pooled

Attention (CUDA only; prints "skipped" elsewhere): one layer's decode step (K/V scatter + attention)
through the Triton kernel (`attend_decode`) and through the torch path (`attend_batched`: every slot
over the whole context under a mask), each a replayed CUDA graph; "attn" is the kernel alone. "full": every slot at the end of
the context; "mixed": slot lengths uniform in 1..context, which the kernel walks and the torch path
pads. GB/s counts the K/V bytes the slots really hold.

Memory: the KV cache of `--parallel 64` at an 8,192-token context per slot, reserved per slot and
pooled (`--kv-unified`): the blocks 64 streams of mixed length take, and fixed `-c` pools.

`--serve` (CUDA): `hydra-engine serve --parallel 64 --ctx 8192 --no-compile` on the 1.1B shape (a
synthetic F16 llama unless `--model`), reserved and with `-c 262144 --kv-unified`; 64 concurrent
requests of random-token prompts of 1..7,000 tokens, 64 generated tokens each. Prints the wall time,
generated tok/s and the KV bytes /status reports.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from hydra_console.contracts.footprint import cache_positions
from hydra_console.engine.model.attention import attend_batched, attend_decode, decode_bias
from hydra_console.engine.model.kv_blocks import KV_BLOCK, KVBlocks
from hydra_console.engine.model.kv_cache import KVCache

N_LAYERS, N_HEAD, N_KV, HEAD_DIM = 16, 32, 8, 64
CFG = SimpleNamespace(n_head=N_HEAD, n_head_kv=N_KV, head_dim=HEAD_DIM, attn_scale=HEAD_DIM**-0.5)


def _layer(batch: int, n_ctx: int, kind: str) -> SimpleNamespace:
    """One attention layer of `batch` slots whose cache holds random values (the layout a Stage keeps)."""
    kv = KVCache(
        KVBlocks.reserved(batch, n_ctx, "cuda"),
        N_KV,
        HEAD_DIM,
        compute=torch.bfloat16,
        device="cuda",
        k_type=kind,
        v_type=kind,
    )
    for store in (kv.k, kv.v):
        if store.scale is None:
            store.codes.normal_()
        else:
            store.codes.random_(-127, 128)
            store.scale.fill_(0.01)
    return SimpleNamespace(kv=kv, window=0)


def _time(fn) -> float:
    """Median seconds of one call, replayed from a CUDA graph."""
    import triton

    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return triton.testing.do_bench(graph.replay, warmup=10, rep=50, return_mode="median") * 1e-3


def attention(batches: list[int], contexts: list[int], kinds: list[str]) -> None:
    if not torch.cuda.is_available():
        print("decode attention: skipped (no CUDA device)")
        return
    from hydra_console.engine.kernels.triton_attention import decode_attention, default_splits

    print(f"decode attention, one layer ({N_HEAD}/{N_KV} heads x {HEAD_DIM}), bf16 compute: microseconds per step")
    print(
        f"{'kv':>5} {'batch':>5} {'context':>7} {'lengths':>7} | {'attn':>7} {'GB/s':>6} | {'kernel':>8} | {'torch':>8} | speedup"
    )
    g = torch.Generator().manual_seed(0)
    for kind in kinds:
        per_token = 2 * N_KV * HEAD_DIM * KVCache.bytes_per_value(kind, torch.bfloat16)
        for batch in batches:
            for n_ctx in contexts:
                layer = _layer(batch, n_ctx, kind)
                q = torch.randn(batch, N_HEAD, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
                k, v = (torch.randn(batch, N_KV, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2))
                slots = torch.arange(batch, device="cuda")
                for mix in ("full", "mixed"):
                    lengths = (
                        torch.full((batch,), n_ctx)
                        if mix == "full"
                        else torch.randint(1, n_ctx + 1, (batch,), generator=g)
                    )
                    positions = (lengths - 1).cuda()
                    held = float(lengths.sum()) * per_token

                    def torch_path():
                        bias = decode_bias(CFG, positions, n_ctx, 0, torch.bfloat16)
                        return attend_batched(CFG, layer.kv, q, k, v, slots, positions, n_ctx, bias)

                    def attn():
                        kv = layer.kv
                        return decode_attention(
                            q,
                            *kv.stored(),
                            slots,
                            positions,
                            kv.blocks.table,
                            n_ctx,
                            0,
                            CFG.attn_scale,
                            default_splits(batch, N_KV, n_ctx, HEAD_DIM, q.device),
                        )

                    t_attn = _time(attn)
                    t_kernel = _time(lambda: attend_decode(CFG, layer.kv, layer.window, q, k, v, slots, positions))
                    t_torch = _time(torch_path)
                    print(
                        f"{kind:>5} {batch:>5} {n_ctx:>7} {mix:>7} | {t_attn * 1e6:7.1f} {held / t_attn / 1e9:6.0f} | "
                        f"{t_kernel * 1e6:8.1f} | {t_torch * 1e6:8.1f} | {t_torch / t_kernel:5.1f}x"
                    )
                layer = None  # free the cache before the next size
                torch.cuda.empty_cache()


def memory(parallel: int = 64, n_ctx: int = 8192) -> None:
    """Reserved: every slot at full context. Pooled: the blocks `KVBlocks` hands out to `parallel` streams of
    mixed length (uniform in 1..n_ctx), and a fixed `-c` pool as a server would be started with."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, n_ctx + 1, (parallel,), generator=g).tolist()
    blocks = KVBlocks.pool(parallel, n_ctx, parallel * n_ctx, "cpu")
    blocks.fit(dict(enumerate(lengths)))
    mixed = (sum(len(h) for h in blocks.held) + 1) * KV_BLOCK  # + block 0
    print(
        f"KV memory, --parallel {parallel} at {n_ctx} positions per slot, {N_LAYERS} layers x {N_KV} KV heads x {HEAD_DIM}"
        f" (GiB; mixed: {parallel} streams of 1..{n_ctx} positions, {sum(lengths)} in all):"
    )
    print(f"{'kv':>5} | {'reserved':>8} | {'pooled, mixed':>13} | {'-c 131072 -kvu':>14} | {'-c 262144 -kvu':>14}")
    for kind in ("f16", "q8_0"):
        per_pos = N_LAYERS * 2 * N_KV * HEAD_DIM * KVCache.bytes_per_value(kind, torch.bfloat16) / 2**30
        pools = [cache_positions(parallel, n_ctx, pool) for pool in (None, None, 131072, 262144)]
        pools[1] = mixed
        print(
            f"{kind:>5} | {pools[0] * per_pos:8.2f} | {pools[1] * per_pos:13.2f} | {pools[2] * per_pos:14.2f} | "
            f"{pools[3] * per_pos:14.2f}"
        )


def serve(model: str | None, parallel: int = 64, n_ctx: int = 8192, pool: int = 262144) -> None:
    if not torch.cuda.is_available():
        print("serve: skipped (no CUDA device)")
        return
    import httpx
    from bench_api import start, stop  # this folder's: the server process and its readiness

    if model is None:
        from hydra_console.engine.synth import write_synthetic

        model = str(
            write_synthetic(
                Path(tempfile.mkdtemp()) / "llama-1b.gguf",
                "llama",
                n_layers=N_LAYERS,
                n_embd=2048,
                n_head=N_HEAD,
                n_head_kv=N_KV,
                n_ff=8192,
                vocab_size=32000,
                n_ctx=n_ctx,
                qtype="F16",
            )
        )
    g = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(1, 32000, (int(n),), generator=g).tolist()
        for n in torch.randint(1, 7001, (parallel,), generator=g)
    ]
    args = SimpleNamespace(ctx=n_ctx, device="cuda", dtype="auto", model=model)
    print(
        f"serve --parallel {parallel} --ctx {n_ctx}: {parallel} requests at once, prompts of "
        f"{sum(map(len, prompts))} tokens in all, 64 generated each"
    )
    for label, extra in (("reserved", ()), (f"-c {pool} --kv-unified", ("-c", str(pool), "--kv-unified"))):
        proc, base, ready = start(args, parallel, ("--no-compile", *extra))
        try:

            def one(prompt, out):
                body = {"prompt": prompt, "max_tokens": 64, "temperature": 0, "ignore_eos": True}
                r = httpx.post(f"{base}/v1/completions", json=body, timeout=600)
                out.append(r.json()["usage"]["completion_tokens"] if r.status_code == 200 else r.text[:200])

            done: list = []
            threads = [threading.Thread(target=one, args=(p, done)) for p in prompts]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - t0
            kv = httpx.get(f"{base}/status", timeout=10).json()["stages"][0]["kv_bytes"]
        finally:
            stop(proc)
        failed = [x for x in done if not isinstance(x, int)]
        print(
            f"  {label:>24}: ready in {ready['ready_s']:.0f} s, KV {kv / 2**30:.2f} GiB, {len(done) - len(failed)} done "
            f"in {wall:.1f} s ({sum(x for x in done if isinstance(x, int)) / wall:.0f} generated tok/s)"
            + (f", {len(failed)} failed: {failed[0]}" if failed else "")
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--contexts", default="512,2048,8192,32768")
    p.add_argument("--types", default="f16,q8_0")
    p.add_argument("--serve", action="store_true", help="also serve 64 streams, reserved and pooled")
    p.add_argument("--model", default=None, help="GGUF for --serve (default: a synthetic 1.1B F16 llama)")
    a = p.parse_args()
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    memory()
    attention(ints(a.batches), ints(a.contexts), a.types.split(","))
    if a.serve:
        serve(a.model)


if __name__ == "__main__":
    main()
