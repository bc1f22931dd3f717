"""Layer split over loopback: decode split/solo ratio (head + 1 peer process) and live re-split time.

    python benchmarks/bench_split.py [--model PATH] [--device cpu] [--dtype auto] [--block 16] [-r 8] [--prefill 128]
    python benchmarks/bench_split.py --synthetic-llama-1b --device cuda   # the H200 run (two processes, one GPU)
    python benchmarks/bench_split.py --pin --prefill 2048 --prefill-chunk 256   # pipelined prefill alone

With --prefill-chunk N only the split's prefill is timed: a --prefill-token prompt in N-token
forwards as the engine's steps run it (logits of the last row only), pipelined (the head computes
chunk i+1 while the peer computes chunk i: --prefill-pipeline) and not, alternating `-r` times,
then both rates, the ratio and whether the last logits are equal.

Decode: single-token greedy steps through `Pipeline.forward` after the same prompt, solo (every
layer here) and split (head [0, L/2) here, [L/2, L) in a `hydra-engine peer` process over the
merged RPC port), in blocks of `--block` steps alternating between the two `-r` times. On CUDA all
three (solo, head, peer) compile the decode step as `serve` and `peer` do (`--no-compile`: none
does). Re-split: boundaries moved back and forth with a slot of `--resplit-ctx` tokens live (its KV
is rebuilt each time). Prints numbers, asserts nothing. This process is the split's head, so it
takes the OpenMP setting of `hydra-engine serve --peer` (engine/openmp.py: a short idle spin, unless
GOMP_SPINCOUNT or OMP_WAIT_POLICY is exported), and the solo blocks run under it too; `GOMP_SPINCOUNT=300000` gives
libgomp's own default to both. With --pin (a core per process), HYDRA_RPC_SPIN_MS=50 makes each
side busy-wait for the other's frame instead of sleeping.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hydra_console.engine.openmp import configure_split_worker

configure_split_worker()  # before torch loads libgomp; the peer inherits it

import torch  # noqa: E402

from hydra_console.engine.cli import build_parser  # noqa: E402
from hydra_console.engine.cli_config import head_config  # noqa: E402
from hydra_console.engine.config import default_cache_dir  # noqa: E402
from hydra_console.engine.device import resolve_device, resolve_dtype  # noqa: E402
from hydra_console.engine.gguf_file import GGUFFile  # noqa: E402
from hydra_console.engine.model import ModelConfig, build_stage  # noqa: E402
from hydra_console.engine.pipeline import Pipeline  # noqa: E402
from hydra_console.engine.workers.head_pipeline import build_pipeline  # noqa: E402

PROMPT_TOKENS = 32


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_peer(model: Path, device: str, cores: set[int] | None, flags: list[str]) -> tuple[subprocess.Popen, str]:
    port, rpc = free_port(), free_port()
    cmd = [
        sys.executable,
        "-m",
        "hydra_console.engine.cli",
        "peer",
        "--model",
        str(model),
        "--device",
        device,
        "--port",
        str(port),
        "--rpc-port",
        str(rpc),
        *flags,
    ]
    pin = (lambda: os.sched_setaffinity(0, cores)) if cores else None
    return subprocess.Popen(cmd, stderr=subprocess.DEVNULL, preexec_fn=pin), f"127.0.0.1:{rpc}"


def device_sync(pipe: Pipeline):
    """Waits for the head's device (timings must include the work they launched)."""
    return torch.cuda.synchronize if pipe.local.device.type == "cuda" else (lambda: None)


def prefill(pipe: Pipeline, slot: int = 0) -> torch.Tensor:
    prompt = torch.arange(1, PROMPT_TOKENS + 1) % pipe.cfg.n_vocab
    logits = pipe.forward(
        prompt, torch.full((PROMPT_TOKENS,), slot), torch.arange(PROMPT_TOKENS), torch.tensor([PROMPT_TOKENS - 1])
    )
    return logits.argmax(-1)


def prefill_tok_s(pipe: Pipeline, n: int, slot: int = 0) -> float:
    """One n-token prompt in one forward (one frame per peer), tokens per second."""
    sync = device_sync(pipe)
    tokens = torch.arange(1, n + 1) % pipe.cfg.n_vocab
    sync()
    t0 = time.perf_counter()
    pipe.forward(tokens, torch.full((n,), slot), torch.arange(n), torch.tensor([n - 1]))
    sync()
    return n / (time.perf_counter() - t0)


def chunked_prefill(pipe: Pipeline, n: int, chunk: int, depth: int, slot: int = 0) -> tuple[float, torch.Tensor]:
    """An n-token prompt in `chunk`-token forwards as the scheduler's steps (logits of the prompt's
    last row only), the last peer holding at most `depth` chunks unanswered (0: each waits):
    (seconds, logits)."""
    for remote in pipe.remotes:
        remote.pipeline_depth = depth
    sync = device_sync(pipe)
    tokens = torch.arange(1, n + 1) % pipe.cfg.n_vocab
    sync()
    t0 = time.perf_counter()
    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        rows = torch.tensor([end - start - 1]) if end == n else torch.zeros(0, dtype=torch.long)
        logits = pipe.forward(tokens[start:end], torch.full((end - start,), slot), torch.arange(start, end), rows)
    sync()
    return time.perf_counter() - t0, logits


def compare_pipelined(split: Pipeline, n: int, chunk: int, reps: int, depth: int) -> None:
    """Chunked prefill through the split, pipelined and not, interleaved (load drifts hit both)."""
    times: dict[str, list[float]] = {"unpipelined": [], "pipelined": []}
    logits = {}
    chunked_prefill(split, n, chunk, depth)  # warm-up (and the peer's one-time work)
    for _ in range(reps):
        for mode, d in (("unpipelined", 0), ("pipelined", depth)):
            t, logits[mode] = chunked_prefill(split, n, chunk, d)
            times[mode].append(t)
    best = {k: n / min(v) for k, v in times.items()}
    med = {k: n / statistics.median(v) for k, v in times.items()}
    print(f"prefill {n} tokens in {chunk}-token chunks through the split, tok/s (best / median of {reps}):")
    for k in times:
        print(f"  {k:11s} {best[k]:8.1f} / {med[k]:8.1f}")
    print(
        f"  pipelined/unpipelined: best {best['pipelined'] / best['unpipelined']:.3f}, "
        f"median {med['pipelined'] / med['unpipelined']:.3f}; last logits equal: "
        f"{torch.equal(logits['pipelined'], logits['unpipelined'])}; chunks pipelined {split.remotes[-1].pipelined}"
    )


def decode_block(
    pipe: Pipeline, tok: torch.Tensor, start: int, n: int, overheads: list, host: bool
) -> tuple[torch.Tensor, float]:
    """n greedy single-token steps from position `start`; (last token, seconds). `host`: each
    token is read back to the host before the next step, as the runtime's sampler does; else it
    stays on the device and the host may run a step ahead. Appends each step's RPC overhead
    (peer round trip minus the peer's own compute) to `overheads`."""
    sync = device_sync(pipe)
    zero = torch.tensor([0])
    sync()
    t0 = time.perf_counter()
    for i in range(n):
        tok = pipe.forward(tok, zero, torch.tensor([start + i]), zero).argmax(-1)
        if host:
            tok = tok.cpu()
        overheads += [r.rtt_ms for r in pipe.remotes]
    sync()
    return tok, time.perf_counter() - t0


def forward_parts(
    pipe: Pipeline, tokens: torch.Tensor, positions: torch.Tensor
) -> tuple[dict[str, float], torch.Tensor]:
    """One forward (slot 0) timed part by part, synchronising the device after each part (so the
    parts add up to more than an unsynchronised forward): the head's layers (embedding included),
    each peer's round trip and, inside it, the peer's own compute (its host<->device copies
    included), and the output head on the last row. Returns (milliseconds per part, next token)."""
    sync = device_sync(pipe)
    slots = torch.zeros_like(positions)
    t = [time.perf_counter()]
    h = pipe.local.run_layers(pipe.local.embed(tokens), slots, positions)
    sync()
    t.append(time.perf_counter())
    computes = []
    for remote in pipe.remotes:
        h = remote.run_layers(h, slots, positions)
        sync()
        t.append(time.perf_counter())
        computes.append(remote.compute_ms)
    tok = pipe.local.logits(h[-1:]).argmax(-1)
    sync()
    t.append(time.perf_counter())
    d = [(b - a) * 1e3 for a, b in zip(t, t[1:])]
    parts = {
        "head layers": d[0],
        **{f"peer {j} round trip": x for j, x in enumerate(d[1:-1])},
        **{f"peer {j} compute": c for j, c in enumerate(computes)},
        "output head": d[-1],
        "total": sum(d),
    }
    return parts, tok


def median_parts(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: round(statistics.median(r[k] for r in runs), 4) for k in runs[0]}


def fmt_parts(parts: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.3f}" for k, v in parts.items())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--synthetic-llama-1b", action="store_true", help="write and use the 1.1B llama shape (GPU run)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--block", type=int, default=16, help="decode steps per timed block")
    ap.add_argument("-r", "--repetitions", type=int, default=8, help="blocks per mode, interleaved")
    ap.add_argument("--resplit-ctx", type=int, default=64, help="tokens live in a slot during re-splits")
    ap.add_argument("--prefill", type=int, default=128, help="prompt length of the prefill comparison (0: skip)")
    ap.add_argument(
        "--pin",
        action="store_true",
        help="head on core 0, peer on core 1, one thread each: two one-core hosts, no contention between them",
    )
    ap.add_argument(
        "--peer-in-process",
        action="store_true",
        help="serve the peer's layers from a thread of this process over the same loopback RPC (one CUDA "
        "context; no CUDA IPC channel opens within one process, so the hidden states take the socket)",
    )
    ap.add_argument("--no-resplit", action="store_true", help="skip the live re-split timings")
    ap.add_argument(
        "--prefill-chunk",
        type=int,
        default=0,
        help="time only the split's --prefill in chunks of this many tokens, pipelined and not",
    )
    ap.add_argument(
        "--no-compile",
        action="store_true",
        help="solo, head and peer replay the uncompiled decode step (as `serve --no-compile`); by default all "
        "three compile it, as serve and peer do, so solo and split compare like with like",
    )
    ap.add_argument(
        "--json",
        dest="json_path",
        default=None,
        help="also write the decode rates and the median time per part to this file (bench_api.py reads it)",
    )
    args = ap.parse_args()
    summary: dict = {"model": str(args.model), "device": args.device, "decode_tok_s": {}, "decode_parts_ms": {}}

    tmp = tempfile.TemporaryDirectory()
    if args.synthetic_llama_1b:
        from hydra_console.engine.synth import write_synthetic

        model = write_synthetic(
            Path(tmp.name) / "llama-1b.gguf",
            "llama",
            n_layers=22,
            n_embd=2048,
            n_head=32,
            n_head_kv=4,
            n_ff=5632,
            vocab_size=32000,
            qtype="F16",
        )
    else:
        from hydra_console.engine.default_model import model_path

        model = model_path(args.model)
    g = GGUFFile(model)
    cfg = ModelConfig.from_gguf(g)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    cache_dir = default_cache_dir(os.environ)
    rpc = head_config(build_parser().parse_args(["serve"]), os.environ).rpc  # the environment serve would see
    part_steps = max(args.block, 32)
    n_ctx = max(PROMPT_TOKENS + part_steps + 8, args.prefill)
    if args.prefill_chunk and not args.prefill:
        ap.error("--prefill-chunk times the --prefill prompt: give it a length")
    half = cfg.n_layers // 2
    compiled = not args.no_compile and device.type == "cuda"  # only CUDA graphs replay a compiled step
    flags = [] if compiled else ["--no-compile"]  # what serve and peer are told
    if args.pin:
        os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the peer
        torch.set_num_threads(1)
        os.sched_setaffinity(0, {0})
    print(
        f"model {model.name}: {cfg.n_layers} layers, n_embd {cfg.n_embd}; device {device}, dtype {dtype}, "
        f"torch threads {torch.get_num_threads()}, cores {os.cpu_count()}, RPC spin {rpc.spin_seconds(device) * 1e3:g} ms, "
        f"GOMP_SPINCOUNT {os.environ.get('GOMP_SPINCOUNT', 'default')}, OMP_WAIT_POLICY {os.environ.get('OMP_WAIT_POLICY', 'default')}"
    )

    if args.peer_in_process:
        from hydra_console.engine.rpc.compute import ComputeServer
        from hydra_console.engine.rpc.listener import RpcListener
        from hydra_console.engine.rpc.resident import StageHost

        host = StageHost(g, cfg, device, cache_dir=cache_dir, compile_decode=compiled)
        listener = RpcListener(
            "127.0.0.1", 0, mode="peer", compute=ComputeServer(host, spin_s=rpc.spin_seconds(device))
        ).start()
        proc, addr = None, f"127.0.0.1:{listener.bound_port}"
    else:
        proc, addr = start_peer(model, args.device, {1} if args.pin else None, flags)
    try:
        argv = [
            "serve",
            "--model",
            str(model),
            "--peer",
            addr,
            "--split",
            f"{half}/{cfg.n_layers - half}",
            "--device",
            args.device,
            "--dtype",
            args.dtype,
            "--parallel",
            "1",
            "--ctx",
            str(max(n_ctx, args.resplit_ctx)),
            "--peer-wait",
            "120",
            *flags,
        ]
        split = build_pipeline(head_config(build_parser().parse_args(argv), os.environ), g, cfg)
        remote = split.remotes[0]
        print(f"peer {addr}: hidden states via {remote.transport}")
        if args.prefill_chunk:
            compare_pipelined(split, args.prefill, args.prefill_chunk, args.repetitions, rpc.prefill_pipeline)
            split.stop()
            return
        solo = Pipeline(
            build_stage(
                g,
                device=device,
                dtype=dtype,
                n_slots=1,
                n_ctx=max(n_ctx, args.resplit_ctx),
                cache_dir=cache_dir,
                compile_decode=compiled,
            )
        )
        summary["transport"] = remote.transport
        # Blocks of `--block` steps, alternating solo / split, so load drifts on a shared machine
        # hit both alike; every block restarts after the same prompt (same positions, same work).
        # On a GPU both ways of feeding tokens are measured (on a CPU they are the same).
        pipes = {"solo": solo, "split": split}
        first = {k: prefill(p) for k, p in pipes.items()}
        overheads: list[float] = []
        for host in [True, False] if device.type == "cuda" else [True]:
            times = {"solo": [], "split": []}
            for k, p in pipes.items():
                decode_block(p, first[k], PROMPT_TOKENS, 4, [], host)  # warm-up
            for _ in range(args.repetitions):
                for k, p in pipes.items():
                    times[k].append(decode_block(p, first[k], PROMPT_TOKENS, args.block, overheads, host)[1])
            feed = "token read back each step (as the runtime)" if host else "token left on the device"
            print(f"decode, {feed}:")
            for k in pipes:
                rates = [args.block / t for t in times[k]]
                if host:  # as the runtime feeds tokens
                    summary["decode_tok_s"][k] = round(len(rates) * args.block / sum(times[k]), 2)
                print(
                    f"  {k:5s} tok/s: overall {len(rates) * args.block / sum(times[k]):.2f}  "
                    f"best block {max(rates):.2f}  median block {statistics.median(rates):.2f}"
                )
            print(
                f"  split/solo ratio: overall {sum(times['solo']) / sum(times['split']):.3f}  "
                f"best blocks {min(times['solo']) / min(times['split']):.3f}  "
                f"median blocks {statistics.median(times['solo']) / statistics.median(times['split']):.3f}"
            )
        if args.prefill:
            rates = {k: [] for k in pipes}
            for _ in range(max(args.repetitions // 4, 2)):
                for k, p in pipes.items():
                    rates[k].append(prefill_tok_s(p, args.prefill))
            print(
                f"prefill {args.prefill} tokens, tok/s: solo best {max(rates['solo']):.1f}, split best {max(rates['split']):.1f}, "
                f"ratio {max(rates['split']) / max(rates['solo']):.3f}"
            )
        for k, p in pipes.items():
            runs, tok = [], first[k]
            for i in range(part_steps):
                parts, tok = forward_parts(p, tok, torch.tensor([PROMPT_TOKENS + i]))
                runs.append(parts)
            summary["decode_parts_ms"][k] = median_parts(runs)
            print(
                f"{k} decode step parts, ms (median, synchronised after each): {fmt_parts(summary['decode_parts_ms'][k])}"
            )
            if args.prefill:
                runs = [
                    forward_parts(p, torch.arange(1, args.prefill + 1) % cfg.n_vocab, torch.arange(args.prefill))[0]
                    for _ in range(4)
                ]
                print(f"{k} prefill {args.prefill} parts, ms: {fmt_parts(median_parts(runs))}")
        pings = [remote.ping() for _ in range(100)]
        print(f"empty PING round trip: median {statistics.median(p for p in pings if p is not None):.3f} ms")
        step_ms = statistics.median(times["split"]) / args.block * 1e3
        rpc_ms = statistics.median(overheads)
        summary["split_over_solo"] = round(summary["decode_tok_s"]["split"] / summary["decode_tok_s"]["solo"], 3)
        summary["rpc_overhead_ms"], summary["step_ms"] = round(rpc_ms, 4), round(step_ms, 4)
        if args.json_path:
            Path(args.json_path).write_text(json.dumps(summary, indent=2))
        if remote.transport == "cuda-ipc":  # the peer replies once its work is queued: the exchange overlaps the GPU
            print(
                f"RPC round trip per step minus the peer's time to queue its work: median {rpc_ms:.3f} ms of a "
                f"{step_ms:.2f} ms step, spent while the GPU runs the head's layers"
            )
        else:
            print(
                f"RPC overhead per step (round trip minus peer compute): median {rpc_ms:.3f} ms of a "
                f"{step_ms:.2f} ms step -> the split's own cost bounds the ratio at ~{1 - rpc_ms / step_ms:.3f}"
            )
        print(f"peer {addr}: sent {remote.bytes_sent} B, received {remote.bytes_recv} B")

        layouts = [
            [(0, half + 3), (half + 3, cfg.n_layers)],
            [(0, half - 3), (half - 3, cfg.n_layers)],
            [(0, half), (half, cfg.n_layers)],
        ]

        def resplits(label: str) -> None:
            times = []
            for layout in layouts * 2:
                t0 = time.perf_counter()
                r = split.resplit(layout)
                times.append(time.perf_counter() - t0)
                print(
                    f"  {label} -> {r['layers']}: {times[-1]:.3f} s (assign {r['assign_s']:.3f} s, rebuilt {r['rebuilt_tokens']} tokens)"
                )
            print(f"re-split, {label}: median {statistics.median(times):.3f} s, max {max(times):.3f} s")

        if args.no_resplit:
            split.stop()
            return
        split.active_slots = lambda: set()
        resplits("no live slot")
        # One live slot of --resplit-ctx tokens: its KV is rebuilt on every stage after each move.
        split.forward(
            torch.arange(1, args.resplit_ctx + 1) % cfg.n_vocab,
            torch.zeros(args.resplit_ctx, dtype=torch.long),
            torch.arange(args.resplit_ctx),
            torch.tensor([args.resplit_ctx - 1]),
        )
        split.active_slots = lambda: {0}
        resplits(f"{args.resplit_ctx}-token live slot")
        split.stop()
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=10)
        tmp.cleanup()


if __name__ == "__main__":
    main()
