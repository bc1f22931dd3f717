"""An emulated network link: a TCP forwarder that delays every byte by a fixed one-way latency.

    python benchmarks/link.py --to HOST:PORT [--listen 127.0.0.1:0] --delay-ms 5 [--rate-mbit 1000]

Each accepted connection is forwarded to `--to` over a fresh connection; each direction delays
what it reads by `--delay-ms` before writing it on (so a round trip gains twice that), and with
`--rate-mbit` also serialises it at that bandwidth, like a link of that speed. The bytes are the
real protocol's, in order: a reader thread timestamps each chunk on arrival and a writer thread
releases them in arrival order when due (`time.sleep` overshoots by ~0.1 ms; asyncio's millisecond
timer rounding added up to 1 ms). Used where `tc netem` is unavailable (no sch_netem module).
Prints `listening HOST:PORT` once ready, then runs until killed.
"""

from __future__ import annotations

import argparse
import queue
import socket
import threading
import time

CHUNK = 1 << 16


def _nodelay(sock: socket.socket) -> socket.socket:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # no Nagle delay of our own on top
    return sock


def _pipe(src: socket.socket, dst: socket.socket, delay_s: float, rate_bps: float | None) -> None:
    """One direction: read as fast as the sender sends; release each chunk `delay_s` after it left
    the (rate-limited) sending end, in order; pass the sender's close on as a FIN."""
    held: queue.SimpleQueue[tuple[float, bytes]] = queue.SimpleQueue()

    def release() -> None:
        while True:
            due, chunk = held.get()
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            if not chunk:
                break
            try:
                dst.sendall(chunk)
            except OSError:
                break
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    releaser = threading.Thread(target=release, daemon=True)
    releaser.start()
    wire_free_at = 0.0  # when the emulated wire has finished sending what it already holds
    try:
        while chunk := src.recv(CHUNK):
            sent_at = time.monotonic()
            if rate_bps:
                wire_free_at = max(sent_at, wire_free_at) + len(chunk) * 8 / rate_bps
                sent_at = wire_free_at
            held.put((sent_at + delay_s, chunk))
    except OSError:
        pass  # the sender reset: deliver what we hold, then close
    held.put((time.monotonic() + delay_s, b""))
    releaser.join()


def _forward(client: socket.socket, target: tuple[str, int], delay_s: float, rate_bps: float | None) -> None:
    try:
        server = _nodelay(socket.create_connection(target, timeout=5))
        server.settimeout(None)
    except OSError:
        client.close()  # the far side is down: the client sees its connection closed
        return
    other = threading.Thread(target=_pipe, args=(server, client, delay_s, rate_bps), daemon=True)
    other.start()
    _pipe(client, server, delay_s, rate_bps)
    other.join()
    client.close()
    server.close()


def serve(listener: socket.socket, target: tuple[str, int], delay_ms: float, rate_mbit: float | None) -> None:
    """Accept forever; each connection gets its own threads."""
    rate_bps = rate_mbit * 1e6 if rate_mbit else None
    while True:
        client, _ = listener.accept()
        args = (_nodelay(client), target, delay_ms / 1e3, rate_bps)
        threading.Thread(target=_forward, args=args, daemon=True).start()


def parse_hostport(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: expected HOST:PORT")
    return host.strip("[]") or "127.0.0.1", int(port)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--to", type=parse_hostport, required=True, help="where connections are forwarded")
    ap.add_argument("--listen", type=parse_hostport, default=("127.0.0.1", 0))
    ap.add_argument("--delay-ms", type=float, required=True, help="one-way delay, each direction")
    ap.add_argument("--rate-mbit", type=float, default=None, help="bandwidth of each direction (default: unlimited)")
    args = ap.parse_args()
    if args.delay_ms < 0 or (args.rate_mbit is not None and args.rate_mbit <= 0):
        ap.error("--delay-ms must be >= 0 and --rate-mbit > 0")
    try:
        listener = socket.create_server(args.listen)
    except OSError as e:
        ap.error(f"cannot listen on {args.listen[0]}:{args.listen[1]}: {e}")
    host, port = listener.getsockname()[:2]
    print(f"listening {host}:{port}", flush=True)
    try:
        serve(listener, args.to, args.delay_ms, args.rate_mbit)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
