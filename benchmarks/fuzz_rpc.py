"""Fuzz both protocols of the merged RPC port on live workers (a head and a peer process).

    python benchmarks/fuzz_rpc.py [--frames 100000] [--seed 0]

Generated frames — valid ones, random ops/commands, random payloads, bit flips, bad magic,
oversized and truncated lengths — are sent in bursts of 1–40 per connection; the client then
half-closes and waits for the server to finish. A connection still open 10 s after our EOF is a
hang; a worker that stops answering INFO / HELLO+PING (checked every 500 connections and at the
end) or exits is a crash. Prints counts; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ready import wait_ready

from hydra_console.contracts.rpc import CONTROL_MAGIC, FORWARD_HEADER, Cmd, Op
from hydra_console.engine.gguf_file import GGUFFile
from hydra_console.engine.rpc import wire
from hydra_console.engine.rpc.compute import pack_hello
from hydra_console.engine.rpc.resident import tensor_shapes
from hydra_console.engine.rpc.wire import BufferReader, FrameError, SocketReader
from hydra_console.engine.synth import write_synthetic

HANG_S = 10.0
MAX_FRAME = 1 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(role: str, model: Path, log: Path, *extra: str) -> tuple[subprocess.Popen, int, int]:
    port, rpc = free_port(), free_port()
    cmd = [
        sys.executable,
        "-m",
        "hydra_console.engine.cli",
        role,
        "--model",
        str(model),
        "--device",
        "cpu",
        "--port",
        str(port),
        "--rpc-port",
        str(rpc),
        "--max-frame",
        str(MAX_FRAME),
        *extra,
    ]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stderr=f, stdout=f)
    wait_ready(port, role)
    return proc, port, rpc


# --- generators -----------------------------------------------------------------------------------

OPS = [
    Op.STATE_GET,
    Op.STATE_PUT,
    Op.STATE_META,
    Op.CONFIGURE,
    Op.INFO,
    Op.PREFILL,
    Op.DECODE,
    Op.SET_EXPERT_MODE,
    Op.SWAP_QUANT,
    Op.PIPELINE_ATTACH,
    Op.AUTH,
]
CMDS = [
    Cmd.LOAD_STAGE,
    Cmd.RESOLVE,
    Cmd.FORWARD,
    Cmd.KV_TRIM,
    Cmd.KV_CLEAR,
    Cmd.STATS,
    Cmd.PING,
    Cmd.CHECK,
    Cmd.AUTH,
    Cmd.IPC_OPEN,
    Cmd.FORWARD_IPC,
    Cmd.FORWARD_ACK,
]


def junk(rng: random.Random, n: int | None = None) -> bytes:
    return rng.randbytes(rng.randrange(0, 300) if n is None else n)


def json_payload(rng: random.Random) -> bytes:
    choices = [
        {"split": rng.choice(["9/9", "1", "0", "-1", "x", "1e400", "", "3,", "18"])},
        {"layers": [[0, rng.randrange(-2, 40)]]},
        {"layers": [[rng.randrange(-3, 3), rng.randrange(-3, 40)], [1]]},
        {"fingerprint": junk(rng, 4).hex(), "shapes": {"a": [1]}},
        {
            "layers": [0, rng.randrange(-1, 5)],
            "dtype": rng.choice(["float32", "int8", None]),
            "n_slots": rng.randrange(-1, 3),
            "n_ctx": 0,
        },
        [1, 2, 3],
        None,
    ]
    raw = json.dumps(rng.choice(choices)).encode()
    return raw if rng.random() < 0.8 else raw[: rng.randrange(len(raw) + 1)]


def mutate(rng: random.Random, frame: bytes) -> bytes:
    b = bytearray(frame)
    for _ in range(rng.randrange(1, 4)):
        if b:
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
    return bytes(b)


def control_frame(rng: random.Random) -> tuple[bytes, bool]:
    """(frame, keeps the connection usable)"""
    kind = rng.random()
    op = rng.choice(OPS) if rng.random() < 0.8 else rng.randrange(256)
    key = rng.choice([b"", b"0", b"1", b"99", b"-1", b"x", junk(rng, 3)])
    payload = (
        json_payload(rng)
        if op == Op.CONFIGURE and rng.random() < 0.7
        else rng.choice([b"", b"solo", b"combined", junk(rng)])
    )
    frame = wire.pack_control_request(
        op, payload, key=key, trace=junk(rng, rng.randrange(0, 16)), flags=rng.randrange(256)
    )
    if kind < 0.75:
        return frame, op != Op.AUTH
    if kind < 0.85:
        return mutate(rng, frame), False
    if kind < 0.90:
        return struct.pack("<HBBHQH", rng.randrange(1 << 16), op, 0, 0, 0, 0), False
    if kind < 0.95:
        return struct.pack(
            "<HBBHQH", CONTROL_MAGIC, op, 0, 0, rng.choice([MAX_FRAME + 1, 1 << 40, (1 << 64) - 1]), 0
        ), False
    return frame[: rng.randrange(len(frame))], False


def forward_payload(rng: random.Random, with_hidden: bool = True) -> bytes:
    """Mostly well-formed batches (epoch 1, float32, width 64) with random slots, positions, values
    (FORWARD_IPC: no values)."""
    t = rng.randrange(0, 4)
    d = 64 if rng.random() < 0.7 else rng.choice([0, 1, 65])
    code = 0 if rng.random() < 0.7 else rng.randrange(4)
    epoch = 1 if rng.random() < 0.7 else rng.randrange(3)
    n_tokens = t if rng.random() < 0.9 else rng.randrange(1 << 32)
    body = FORWARD_HEADER.pack(epoch, n_tokens, d, code)
    index = struct.pack(
        f"<{2 * t}i", *(rng.randrange(-1, 4) for _ in range(t)), *(rng.randrange(-1, 20) for _ in range(t))
    )
    values = junk(rng, 4 * t * d) if with_hidden else b""
    return body + (index + values if rng.random() < 0.8 else junk(rng, rng.randrange(0, 600)))


def compute_frame(rng: random.Random) -> tuple[bytes, bool]:
    kind = rng.random()
    cmd = rng.choice(CMDS) if rng.random() < 0.85 else rng.randrange(256)
    if cmd in (Cmd.FORWARD, Cmd.FORWARD_IPC, Cmd.FORWARD_ACK):
        payload = forward_payload(rng, with_hidden=cmd != Cmd.FORWARD_IPC)
    elif cmd == Cmd.IPC_OPEN:
        payload = json.dumps({"uuid": rng.choice(["GPU-0", "", None]), "rows": rng.randrange(-2, 1 << 17)}).encode()
    elif cmd in (Cmd.CHECK, Cmd.LOAD_STAGE):
        payload = json_payload(rng)
    elif cmd == Cmd.RESOLVE:
        payload = rng.choice([b"blk.0.attn_q.weight", b"token_embd.weight", b"blk.99.x", junk(rng, 20)])
    elif cmd in (Cmd.KV_CLEAR, Cmd.KV_TRIM):
        payload = junk(rng, rng.choice([4, 8, 3, 0]))
    else:
        payload = junk(rng)
    frame = wire.pack_compute_request(cmd, payload)
    if kind < 0.8:
        return frame, True
    if kind < 0.9:
        return mutate(rng, frame), False
    if kind < 0.95:
        return struct.pack("<BQ", cmd, rng.choice([MAX_FRAME + 1, 1 << 40, (1 << 64) - 1])), False
    return frame[: rng.randrange(len(frame))], False


def checked_session(g) -> bytes:
    """HELLO + a passing CHECK: FORWARD and LOAD_STAGE frames then reach the stage itself."""
    check = {"fingerprint": g.fingerprint, "shapes": tensor_shapes(g)}
    return wire.pack_compute_request(Cmd.HELLO, pack_hello()) + wire.pack_compute_request(
        Cmd.CHECK, json.dumps(check).encode()
    )


def hello(rng: random.Random, checked: bytes) -> tuple[bytes, bool]:
    frame = wire.pack_compute_request(Cmd.HELLO, pack_hello())
    r = rng.random()
    if r < 0.4:
        return checked, True
    if r < 0.9:
        return frame, True
    if r < 0.95:
        return wire.pack_compute_request(Cmd.HELLO, struct.pack("<BBBBI", 3, rng.randrange(8), 0, 0, 0)), False
    return mutate(rng, frame), False


# --- driving ------------------------------------------------------------------------------------


def burst(port: int, frames: list[bytes]) -> tuple[bytes, bool]:
    """Send, half-close, read until the server closes; (received bytes, hung)."""
    with socket.create_connection(("127.0.0.1", port), timeout=HANG_S) as s:
        try:
            s.sendall(b"".join(frames))
            s.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the server closed early (malformed frame): fine
        out = bytearray()
        deadline = time.monotonic() + HANG_S
        while time.monotonic() < deadline:
            try:
                chunk = s.recv(1 << 16)
            except socket.timeout:
                return bytes(out), True
            except ConnectionResetError:
                return bytes(out), False
            if not chunk:
                return bytes(out), False
            out += chunk
        return bytes(out), True


def count_replies(data: bytes, control: bool) -> int:
    r, n = BufferReader(data), 0
    try:
        while r.pos < len(data):
            if control:
                wire.read_control_response(r, MAX_FRAME)
            else:
                wire.read_compute_response(r, MAX_FRAME)
            n += 1
    except FrameError:
        pass
    return n


def alive(head_rpc: int, peer_rpc: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", head_rpc), timeout=5) as s:
            s.settimeout(5)
            s.sendall(wire.pack_control_request(Op.INFO))
            ok = wire.read_control_response(SocketReader(s), MAX_FRAME).status == 0
        with socket.create_connection(("127.0.0.1", peer_rpc), timeout=5) as s:
            s.settimeout(5)
            s.sendall(wire.pack_compute_request(Cmd.HELLO, pack_hello()) + wire.pack_compute_request(Cmd.PING, b"ok"))
            r = SocketReader(s)
            wire.read_compute_response(r, 64)
            return ok and bytes(wire.read_compute_response(r, 64)) == b"\x00ok"
    except (OSError, FrameError):
        return False


def run(name: str, target: int, rng, port: int, make, first=None, check=lambda: True) -> dict:
    sent = answered = conns = hangs = crashes = 0
    t0 = time.perf_counter()
    while sent < target:
        frames = []
        if first is not None:
            f, ok = first(rng)
            frames.append(f)
        else:
            ok = True
        n = rng.randrange(1, 41)
        while ok and len(frames) < n:
            f, ok = make(rng)
            frames.append(f)
        data, hung = burst(port, frames)
        sent += len(frames)
        answered += count_replies(data, first is None)
        hangs += hung
        conns += 1
        if conns % 500 == 0 and not check():
            crashes += 1
    dt = time.perf_counter() - t0
    crashes += not check()
    result = {
        "protocol": name,
        "frames": sent,
        "answered": answered,
        "connections": conns,
        "hangs": hangs,
        "crashes": crashes,
        "seconds": round(dt, 1),
        "frames_per_s": round(sent / dt),
    }
    print(json.dumps(result), flush=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frames", type=int, default=100_000, help="frames per protocol (and per port for compute)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        model = write_synthetic(Path(tmp) / "fuzz.gguf", "gemma3", n_layers=2)
        logs = [Path(tmp) / "head.log", Path(tmp) / "peer.log"]
        head, _, head_rpc = spawn("serve", model, logs[0], "--parallel", "1", "--ctx", "64")
        peer, _, peer_rpc = spawn("peer", model, logs[1])
        checked = checked_session(GGUFFile(model))
        # The peer holds layer [0, 1) at epoch 1. Its slots belong to that (closed) loading session,
        # so fuzzed FORWARD frames are parsed and checked in full, then refused by slot ownership.
        load = {"layers": [0, 1], "dtype": "float32", "n_slots": 2, "n_ctx": 16}
        burst(peer_rpc, [checked, wire.pack_compute_request(Cmd.LOAD_STAGE, json.dumps(load).encode())])
        first = lambda r: hello(r, checked)  # noqa: E731
        try:
            check = lambda: alive(head_rpc, peer_rpc) and head.poll() is None and peer.poll() is None  # noqa: E731
            run("control (head)", args.frames, rng, head_rpc, control_frame, check=check)
            run(
                "compute (head, one request per pool hand-off)",
                args.frames,
                rng,
                head_rpc,
                compute_frame,
                first=first,
                check=check,
            )
            run(
                "compute (peer, thread per handshaken connection)",
                args.frames,
                rng,
                peer_rpc,
                compute_frame,
                first=first,
                check=check,
            )
            data, _ = burst(peer_rpc, [checked, wire.pack_compute_request(Cmd.STATS)])
            r = BufferReader(data)
            for _ in range(3):  # HELLO, CHECK, then STATS
                stats = wire.read_compute_response(r, MAX_FRAME)
            print(
                f"peer ran {json.loads(bytes(stats[1:]))['forwards']} fuzzed FORWARD batches through its stage "
                "(0 expected: none came from the session that owns its slots)"
            )
        finally:
            for p in (head, peer):
                p.terminate()
                p.wait(timeout=10)
            # Refused frames are logged at debug level: any traceback in a worker's log is a bug.
            for log in logs:
                text = log.read_text(errors="replace")
                print(f"{log.stem}: {text.count('Traceback')} tracebacks in the worker log")
                if "Traceback" in text:
                    print(text[text.index("Traceback") :][:3000])


if __name__ == "__main__":
    main()
