"""`hydra-engine peer`: serves the layers a head assigns, from this machine's own GGUF copy.

The merged RPC port runs in peer mode (after its handshake, a thread per connection straight
into the compute protocol). Nothing is materialised until a head sends LOAD_STAGE; then only that layer range
is. `/health`, `/status` and `/metrics` answer on `--port`.
"""

from __future__ import annotations

import ipaddress
import os
import sys

from ...contracts.status import Address, ModelInfo, StageInfo
from ..errors import UserError
from .compute import ComputeServer
from .listener import RpcListener
from .resident import StageHost
from .service import RpcCollector


def require_token_off_loopback(rpc_host: str, token: str | None, insecure: bool) -> None:
    """Without a token anyone who reaches the port can load, run and clear this peer's stage:
    only loopback is allowed that way unless the operator says --insecure."""
    if token or insecure:
        return
    try:
        loopback = ipaddress.ip_address(rpc_host.strip("[]")).is_loopback
    except ValueError:
        loopback = rpc_host == "localhost"
    if not loopback:
        raise UserError(f"--rpc-host {rpc_host} without a token exposes this peer to anyone who reaches it: "
                        "set HYDRA_TOKEN or --auth-token-file, or pass --insecure")  # fmt: skip


def build_app(status, metrics):
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, Response

    from ..metrics import CONTENT_TYPE

    app = FastAPI(title="hydra peer")

    @app.get("/health")
    def health():
        h = status.health()
        return JSONResponse(h.to_json(), status_code=h.http_code)

    @app.get("/status")
    def get_status():
        return status.document().to_json()

    @app.get("/metrics")
    def get_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app


def main(args) -> int:
    import uvicorn

    from ..api import listen_socket
    from ..device import resolve_device
    from ..gguf_file import GGUFFile
    from ..metrics import Metrics
    from ..model import ModelConfig, default_cache_dir
    from ..status import StatusDocument

    require_token_off_loopback(args.rpc_host, args.auth_token, args.insecure)
    http_sock = listen_socket(args.host, args.port)
    status = StatusDocument("peer", args.host, http_sock.getsockname()[1])
    from ..default_model import model_path

    path = model_path(args.model)
    g = GGUFFile(path)
    cfg = ModelConfig.from_gguf(g)
    device = resolve_device(args.device)
    status.model = ModelInfo(path.stem, str(path), g.architecture, cfg.n_layers, g.fingerprint)
    status.startup_stage = 2
    host = StageHost(g, cfg, device, cache_dir=default_cache_dir(os.environ))
    host.on_change = lambda: setattr(status, "degraded", host.stage is None)
    host.on_change()  # no stage until a head loads one: /health says degraded, /status "idle"
    compute = ComputeServer(host, auth_token=args.auth_token or None, max_frame=args.max_frame)
    listener = RpcListener(args.rpc_host, args.rpc_port, mode="peer", compute=compute).start()
    status.startup_stage = 4  # 3 = RPC active; a peer is ready as soon as its port serves

    def rpc_status() -> dict:
        stage = StageInfo("peer", f"{args.rpc_host}:{listener.bound_port}", tuple(host.layers) if host.stage is not None else None,
                          str(device), "ok" if host.stage is not None else "idle")  # fmt: skip
        return {
            "rpc": Address(args.rpc_host, listener.bound_port, listener.is_running()),
            "pool": listener.stats(),
            "stages": [stage],
            "resident": {**host.stats(), "bytes_in": compute.bytes_in, "bytes_out": compute.bytes_out},
        }

    status.add_provider(rpc_status)
    metrics = Metrics(status)
    metrics.register(RpcCollector(listener))
    print(
        f"hydra-engine peer: {path.name} ({cfg.n_layers} layers) on {device}; "
        f"RPC {args.rpc_host}:{listener.bound_port}, HTTP http://{args.host}:{status.http.port}",
        file=sys.stderr,
        flush=True,
    )
    server = uvicorn.Server(uvicorn.Config(build_app(status, metrics), log_level="warning", timeout_graceful_shutdown=2))
    try:
        server.run(sockets=[http_sock])
    finally:
        listener.stop()
    return 0
