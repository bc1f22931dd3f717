"""A stand-in worker: takes `hydra-engine serve|peer` flags and serves /health and /status.

For console demos, its tests and the polling benchmark on machines where loading a model is not
wanted: `engine_command = "python -m hydra_console.app.fake_worker"` in a profile makes the
supervisor start these instead of real workers. It reports "starting" for --startup-delay
seconds, then "ok", with the layer ranges its --split implies (the /status schema of
docs/ARCHITECTURE.md), writes an access-log line for any other path, and exits --stop-delay
seconds after SIGTERM. It loads no model and opens no RPC port.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from ..contracts.split import parse_split
from ..contracts.status import (
    READY_STAGE,
    Address,
    DeviceInfo,
    Health,
    ModelInfo,
    PeerInfo,
    Pool,
    Speculative,
    StageInfo,
    Status,
)


def build_status(args, started: float) -> Status:
    n_stages = 1 + len(args.peer)
    stage_ranges = parse_split(args.split, args.layers, n_stages)
    stages = [StageInfo("head", f"{args.rpc_host}:{args.rpc_port}", stage_ranges[0], "cpu", "ok")]
    stages += [StageInfo("peer", addr, r, "cpu", "ok") for addr, r in zip(args.peer, stage_ranges[1:])]
    up = time.time() - started
    ready = up >= args.startup_delay
    head = args.command == "serve"
    return Status(
        role="head" if head else "peer",
        pid=os.getpid(),
        version="fake",
        uptime_s=round(up, 1),
        state="ok" if ready else "starting",
        startup_stage=READY_STAGE if ready else 1,
        http=Address(args.host, args.port),
        rpc=Address(args.rpc_host, args.rpc_port),
        model=ModelInfo("fake", args.model or "", "fake", args.layers, "0"),
        stages=stages if head else [],
        devices=[DeviceInfo(0, "cpu", "cpu", 1 << 30, 8 << 30)],
        speculative=Speculative(draft_max=3),
        pool=Pool(size=2, queue_max=64),
        peers=[PeerInfo(a, "up", rtt_ms=0.3, layers=r) for a, r in zip(args.peer, stage_ranges[1:])] if head else [],
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="fake_worker")
    ap.add_argument("command", choices=["serve", "peer"])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("--rpc-host", default="127.0.0.1")
    ap.add_argument("--rpc-port", type=int, default=None)
    ap.add_argument("--model", default=None)
    ap.add_argument("--peer", action="append", default=[])
    ap.add_argument("--split", default=None)
    ap.add_argument("--layers", type=int, default=18, help="layer count of the pretend model")
    ap.add_argument("--startup-delay", type=float, default=0.5)
    ap.add_argument(
        "--stop-delay", type=float, default=0.0, help="seconds SIGTERM takes, as a head draining its streams"
    )
    args, _ = ap.parse_known_args(argv)
    args.rpc_port = args.rpc_port or args.port + 1
    started = time.time()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            doc = build_status(args, started)
            if self.path == "/health":
                ok = doc.state == "ok"
                health = Health(doc.state, doc.startup_stage, ok, "fake", ok)
                body, code = health.to_json(), health.http_code
            elif self.path == "/status":
                body, code = doc.to_json(), 200
            else:
                body, code = {"error": "not found"}, 404
                # An access-log line as the head writes one (not for the console's polls).
                print(f"{uuid.uuid4().hex[:12]} GET {self.path} {code}", flush=True)
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, fmt, *a):
            pass

    server = ThreadingHTTPServer((args.host, args.port), Handler)

    def stop(*_):
        time.sleep(args.stop_delay)
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    print(f"fake {args.command} listening on {args.host}:{args.port} split={args.split}", flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
