"""`hydra-engine peer`: serves the layers a head assigns, from this machine's own GGUF copy.

Start order: bind the HTTP port, read the model's header (nothing is materialised until a head
sends LOAD_STAGE; then only that layer range is), open the merged RPC port in peer mode (a
thread per connection, straight into the compute protocol), then serve /health, /status and
/metrics. Stop order is the reverse.
"""

from __future__ import annotations

import sys

from fastapi import FastAPI

from ...contracts.fit import headroom_bytes
from ...contracts.status import READY_STAGE, Address, ModelInfo, StageInfo
from ..config import PeerConfig
from ..default_model import model_path
from ..device import resolve_device
from ..gguf_file import GGUFFile
from ..http.worker import add_observation_routes, http_server, listen_socket
from ..metrics import Metrics
from ..model import ModelConfig
from ..rpc.compute import ComputeServer
from ..rpc.listener import RpcListener
from ..rpc.resident import StageHost
from ..rpc.service import RpcCollector
from ..status import StatusDocument

NO_STAGE = "no stage yet: waiting for a head to load its layers"


class PeerWorker:
    def __init__(self, cfg: PeerConfig):
        self.cfg = cfg
        self.http_sock = listen_socket(cfg.host, cfg.port)
        self.status = StatusDocument("peer", cfg.host, self.http_sock.getsockname()[1], config=cfg.redacted())
        self.path = model_path(cfg.model.model)
        g = GGUFFile(self.path)
        self.model_cfg = ModelConfig.from_gguf(g)
        self.device = resolve_device(cfg.model.device)
        self.status.model = ModelInfo(
            self.path.stem, str(self.path), g.architecture, self.model_cfg.n_layers, g.fingerprint
        )
        self.status.startup_stage = 2
        self.host = StageHost(
            g,
            self.model_cfg,
            self.device,
            cache_dir=cfg.model.cache_dir,
            quantized=cfg.model.quantized,
            compile_decode=cfg.model.compile,
            kv_types=cfg.model.kv_types,
            deterministic=cfg.model.deterministic,
            layer_delay_s=cfg.layer_delay_ms / 1e3,
            headroom=headroom_bytes(cfg.model.headroom_gb),
        )
        # No stage until a head loads one: /health says degraded (and why), /status "idle".
        self.host.on_change = lambda: setattr(self.status, "degraded", NO_STAGE if self.host.stage is None else None)
        self.host.on_change()
        rpc = cfg.rpc
        self.compute = ComputeServer(
            self.host, auth_token=rpc.auth_token, max_frame=rpc.max_frame, spin_s=rpc.spin_seconds(self.device)
        )
        self.listener = RpcListener(
            rpc.host, rpc.port, mode="peer", compute=self.compute, pool_size=rpc.pool_size, queue_max=rpc.queue
        )
        self.metrics = Metrics(self.status)
        self.metrics.register(RpcCollector(self.listener))
        self.status.add_provider(self._rpc_status)

    def _rpc_status(self) -> dict:
        host, rpc = self.host, self.cfg.rpc
        stage = StageInfo(
            "peer",
            f"{rpc.host}:{self.listener.bound_port}",
            tuple(host.layers) if host.stage is not None else None,
            str(self.device),
            "ok" if host.stage is not None else "idle",
            host.stage.kv_bytes if host.stage is not None else None,
            host.stage.held_weight_bytes if host.stage is not None else None,
        )
        return {
            "rpc": Address(rpc.host, self.listener.bound_port, self.listener.is_running()),
            "pool": self.listener.stats(),
            "stages": [stage],
            "resident": {**host.stats(), "bytes_in": self.compute.bytes_in, "bytes_out": self.compute.bytes_out},
        }

    def serve(self) -> int:
        self.listener.start()
        self.status.startup_stage = READY_STAGE  # a peer is ready as soon as its port serves (it warms per LOAD_STAGE)
        app = FastAPI(title="hydra peer")
        add_observation_routes(app, self.status, self.metrics)
        print(
            f"hydra-engine peer: {self.path.name} ({self.model_cfg.n_layers} layers) on {self.device}; "
            f"RPC {self.cfg.rpc.host}:{self.listener.bound_port}, HTTP http://{self.cfg.host}:{self.status.http.port}",
            file=sys.stderr,
            flush=True,
        )
        try:
            http_server(app, self.cfg.http).run(sockets=[self.http_sock])
        finally:
            self.listener.stop()
        return 0
