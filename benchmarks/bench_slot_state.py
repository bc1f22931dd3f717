"""Where a slot-state transfer's time goes, piece by piece, on this machine (no prefill, no server):

    python benchmarks/bench_slot_state.py [--tokens 4096] [--layers 64] [--embd 256] [--reps 5] [--threads 1]

A synthetic llama stage (8 heads, 4 KV heads; float32) gets a slot of --tokens positions of random
K/V, then each step of a P/D transfer is timed alone (best of --reps), in GB/s of the state:
  save      the prefill worker's copy of the slot into one buffer, with the chunk checksums (collect)
  crc       the chunk checksums alone (zlib-ng crc32)
  socket    the state through a TCP loopback connection, from one thread into another's buffer
  prepare   the head's checks of every chunk and of the header against its stage
  place     the copy into the head's slot
The default shape gives a 268 MB state; bench_pd.py measures the same steps end to end.
"""

from __future__ import annotations

import argparse
import socket
import tempfile
import threading
import time
from pathlib import Path

import torch

from hydra_console.contracts.slot_state import chunk_crcs
from hydra_console.engine import slot_state
from hydra_console.engine.gguf_file import GGUFFile
from hydra_console.engine.model import build_stage
from hydra_console.engine.pipeline import Pipeline
from hydra_console.engine.rpc.wire import SocketReader, send_all
from hydra_console.engine.synth import write_synthetic


def best(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def socket_seconds(blob: memoryview, reps: int) -> float:
    """One-way time of `blob` over loopback TCP (the reader acknowledges each copy with one byte)."""
    server = socket.create_server(("127.0.0.1", 0))
    sink = memoryview(bytearray(len(blob)))

    def receive():
        conn, _ = server.accept()
        reader = SocketReader(conn)
        for _ in range(reps):
            reader.expect(60)
            reader.read_into(sink)
            conn.sendall(b"k")

    threading.Thread(target=receive, daemon=True).start()
    with socket.create_connection(server.getsockname()) as out:
        return best(lambda: (send_all(out, blob), out.recv(1)), reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--embd", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_synthetic(
            Path(tmp) / "state.gguf",
            "llama",
            n_layers=args.layers,
            n_embd=args.embd,
            n_head=8,
            n_head_kv=4,
            n_ff=256,
            n_ctx=args.tokens,
        )
        g = GGUFFile(path)
        stage = build_stage(g, device="cpu", dtype="float32", n_slots=2, n_ctx=args.tokens)
        tokens = list(range(args.tokens))
        stage.place_slot_state(
            0, args.tokens, {k: torch.randn(v.shape) for k, v in stage.slot_state(0, args.tokens).items()}
        )
        blob = slot_state.save(stage, 0, tokens, g.fingerprint)
        pipeline = Pipeline(stage)
        prepared = pipeline.prepare_state(blob, tokens)
        seconds = {
            "save": best(lambda: slot_state.save(stage, 0, tokens, g.fingerprint), args.reps),
            "crc": best(lambda: chunk_crcs(blob), args.reps),
            "socket": socket_seconds(blob, args.reps),
            "prepare": best(lambda: pipeline.prepare_state(blob, tokens), args.reps),
            "place": best(lambda: pipeline.place_state(1, prepared), args.reps),
        }
    print(f"state of {args.tokens} tokens: {len(blob) / 1e6:.0f} MB")
    for name, s in seconds.items():
        print(f"{name:8s} {s * 1e3:8.1f} ms {len(blob) / s / 1e9:7.2f} GB/s")
    serial = sum(seconds[k] for k in ("save", "socket", "prepare", "place"))
    print(
        f"save + socket + prepare + place, one after another: {serial * 1e3:.1f} ms, {len(blob) / serial / 1e9:.2f} GB/s"
    )


if __name__ == "__main__":
    main()
