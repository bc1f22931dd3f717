"""What the RPC layer adds to a worker: the merged port's servers, the head's control backend,
and the RPC sections of /status and /metrics (pool occupancy, peers, stage ranges)."""

from __future__ import annotations

import contextlib
import functools
import os

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ... import __version__
from ...contracts.rpc import (
    VERSION,
    ConfigureRequest,
    ControlError,
    Op,
    PipelineProbe,
    PipelineProbeRequest,
    PrefillReply,
    PrefillRequest,
    Status,
)
from ...contracts.split import parse_split
from ...contracts.status import Address, ModelInfo
from ..config import RpcSettings
from ..device import free_bytes
from ..errors import UserError
from ..pd import PdStats, serve_prefill
from .compute import ComputeServer
from .control import ControlServer
from .listener import RpcListener
from .resident import StageHost
from .shm import Attached

EXPERT_MODES = ("solo", "combined")


def _awake(op):
    """A control op that needs the model: a sleeping head loads it first (--sleep-idle-seconds)."""

    @functools.wraps(op)
    def run(self, *args):
        with self.awake():
            return op(self, *args)

    return run


class HeadControl:
    """The head's Hydra control backend: INFO, CONFIGURE (live re-split), SET_EXPERT_MODE, the
    state ops (STATE_META/GET/PUT on a slot of the whole pipeline) and PREFILL."""

    def __init__(
        self,
        pipeline,
        host: StageHost,
        model: ModelInfo | None,
        auth: bool,
        role: str = "head",
        pd_stats: PdStats | None = None,
    ):
        self.pipeline, self.host, self.model, self.auth, self.role = pipeline, host, model, auth, role
        self.expert_mode = "solo"
        self.engine = None  # set once the engine runs: the state ops and PREFILL go through it
        self.pd_stats = pd_stats or PdStats()
        self.shm = Attached()  # decode heads' shared memory this worker writes PREFILL's states into
        self.split_by: str | None = None  # who asked for the live split (CONFIGURE's optional "by")
        self.awake = contextlib.nullcontext  # the head's IdleSleep.held with --sleep-idle-seconds

    def info(self) -> dict:
        return {
            "engine": "hydra",
            "version": __version__,
            "compute_protocol": ".".join(map(str, VERSION)),
            "mode": self.role,
            "pid": os.getpid(),
            "model": self.model.to_json() if self.model else None,
            "layer_split": [list(r) for r in self.pipeline.ranges],
            "peers": [r.status().to_json() for r in self.pipeline.remotes],
            "expert_mode": self.expert_mode,
            "auth": self.auth,
            "resplits": self.pipeline.resplits,
            "last_resplit": self.pipeline.last_resplit,
            "ops": {
                "INFO": Op.INFO,
                "CONFIGURE": Op.CONFIGURE,
                "SET_EXPERT_MODE": Op.SET_EXPERT_MODE,
                "STATE_META": Op.STATE_META,
                "STATE_GET": Op.STATE_GET,
                "STATE_PUT": Op.STATE_PUT,
                "PREFILL": Op.PREFILL,
                "PROBE": Op.PROBE,
                "AUTH": Op.AUTH,
            },
        }

    @_awake
    def configure(self, request: ConfigureRequest) -> dict:
        """`{"split": "12/6"}` (DESIGN §3 syntax) or `{"layers": [[0,12],[12,18]]}`: live re-split;
        an optional `"by"` names the requester in /status (`split_by`)."""
        n_stages = 1 + len(self.pipeline.remotes)
        try:
            if request.split is not None:
                ranges = parse_split(request.split, self.pipeline.cfg.n_layers, n_stages)
            else:
                ranges = [tuple(r) for r in request.layers]
            result = self.pipeline.resplit(ranges)
        except (UserError, TypeError, ValueError) as e:
            raise ControlError(str(e), Status.BAD_REQUEST) from None
        self.host.epoch += 1  # the head's resident set changed too
        self.split_by = request.by or "CONFIGURE"
        return {"ok": True, **result}

    @_awake
    def probe(self, request: PipelineProbeRequest) -> PipelineProbe:
        """PROBE: the split advisor's timings of every stage, with the head's own footprint and free
        memory (the peers report theirs)."""
        try:
            result = self.pipeline.probe(request.tokens, request.reps)
        except UserError as e:
            raise ControlError(str(e), Status.BAD_REQUEST) from None
        local = self.pipeline.local
        footprint = self.host.layer_footprint(
            local.dtype, local.n_slots, local.n_ctx, local.kv_pool, local.kv_types, local.depth
        )
        a, b = result["stages"][0]["layers"]
        result["stages"][0].update(
            layer_bytes=footprint, held_bytes=sum(footprint[a:b]), free_bytes=free_bytes(local.device)
        )
        return PipelineProbe(**result)

    # --- state ops on the whole pipeline (an idle slot's prompt cache; contracts.slot_state) ------

    def _engine(self):
        if self.engine is None:
            raise ControlError("the engine is not running yet", Status.BUSY)
        return self.engine

    @_awake
    def state_meta(self, slot: int) -> dict:
        """What a slot holds, stage by stage, without moving it."""
        engine, head = self._engine(), self.pipeline.local
        if not 0 <= slot < head.n_slots:
            raise ControlError(f"slot {slot} does not exist ({head.n_slots} slots)", Status.NOT_FOUND)
        seq = engine.slots[slot]
        n = seq.n_past if seq is not None else len(engine.kv.cached(slot))
        stages = [
            {"layers": list(self.pipeline.ranges[0]), "bytes": sum(t.nbytes for t in head.slot_state(slot, n).values())}
        ]
        stages += [{"layers": list(r.layer_range), "bytes": r.state_meta(slot)["bytes"]} for r in self.pipeline.remotes]
        return {
            "slot": slot,
            "n_tokens": n,
            "state": "idle" if seq is None else "processing",
            "n_ctx": head.n_ctx,
            "layers": [s["layers"] for s in stages],
            "bytes": sum(s["bytes"] for s in stages),
            "stages": stages,
            "fingerprint": head.g.fingerprint,
            "dtype": str(head.dtype).removeprefix("torch."),
        }

    @_awake
    def state_get(self, slot: int) -> tuple[dict, bytes]:
        """An idle slot's state: one slot state per stage (the peers' through STATE_GET)."""
        parts: list[bytes] = []
        n, _ = self._state_op(lambda: self._engine().save_slot(slot, parts.append))
        return {"slot": slot, "n_tokens": n, "sizes": [len(p) for p in parts]}, b"".join(parts)

    @_awake
    def state_put(self, slot: int, payload: bytes) -> dict:
        """Place slot states into an idle slot (checked whole first; refused: the slot is as it was)."""
        n = self._state_op(lambda: self._engine().restore_slot(slot, payload))
        return {"slot": slot, "n_tokens": n, "bytes": len(payload)}

    @staticmethod
    def _state_op(fn):
        try:
            return fn()
        except UserError as e:  # a slot that is busy or missing, a refused state: the reason goes back
            raise ControlError(str(e), Status.BAD_REQUEST) from None

    @_awake
    def prefill(self, request: PrefillRequest) -> tuple[PrefillReply, list]:
        """PREFILL (a prefill worker's job; any head answers it): the state of `tokens`, one slot
        state per range the asker holds."""
        return serve_prefill(self._engine(), self.pipeline, request, self.pd_stats, self.shm)

    def set_expert_mode(self, mode: str) -> dict:
        if mode not in EXPERT_MODES:
            raise ControlError(f"expert mode must be one of {EXPERT_MODES}, got {mode!r}", Status.BAD_REQUEST)
        self.expert_mode = mode
        return {"ok": True, "expert_mode": mode}


class HeadRpc:
    """The head's merged port (pool + peek dispatch) serving compute and control."""

    def __init__(
        self,
        rpc: RpcSettings,
        g,
        cfg,
        pipeline,
        model: ModelInfo | None = None,
        *,
        role: str = "head",
        pd_stats: PdStats | None = None,
    ):
        token = rpc.auth_token
        self.host = StageHost(g, cfg, pipeline.local.device, stage=pipeline.local, assignable=False)
        self.control = HeadControl(pipeline, self.host, model, auth=bool(token), role=role, pd_stats=pd_stats)
        self.pipeline = pipeline
        self.listener = RpcListener(
            rpc.host,
            rpc.port,
            mode="head",
            compute=ComputeServer(
                self.host,
                auth_token=token,
                max_frame=rpc.max_frame,
                spin_s=rpc.spin_seconds(self.host.device),
                role=role,
            ),
            control=ControlServer(self.control, auth_token=token, max_frame=rpc.max_frame, role=role),
            pool_size=rpc.pool_size,
            queue_max=rpc.queue,
        )

    def start(self) -> HeadRpc:
        self.listener.start()
        return self

    def stop(self) -> None:
        self.listener.stop()
        self.control.shm.close()

    def status(self) -> dict:
        """The /status fields this layer owns."""
        return {
            "rpc": Address(self.listener.host, self.listener.bound_port, self.listener.is_running()),
            "pool": self.listener.stats(),
            "peers": [r.status() for r in self.pipeline.remotes],
            "resplits": self.pipeline.resplits,
            "split_by": self.control.split_by,
        }


class RpcCollector:
    """`hydra_` metrics of the merged port and the peers (read at scrape time)."""

    def __init__(self, listener: RpcListener, pipeline=None):
        self.listener, self.pipeline = listener, pipeline

    def collect(self):
        st = self.listener.stats()
        for name, doc, value in (
            ("hydra_rpc_pool_size", "RPC pool workers.", st.size),
            ("hydra_rpc_pool_busy", "RPC pool workers holding a connection.", st.busy),
            ("hydra_rpc_pool_queued", "RPC connections waiting for a worker.", st.queued),
            ("hydra_rpc_pool_queue_max", "RPC wait queue capacity.", st.queue_max),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        yield CounterMetricFamily("hydra_rpc_dropped", "RPC connections dropped: queue full.", value=st.dropped)
        yield CounterMetricFamily("hydra_rpc_accepted", "RPC connections accepted.", value=st.accepted)
        yield CounterMetricFamily(
            "hydra_rpc_auth_failures", "RPC handshakes that failed to prove the token.", value=st.auth_failures
        )
        if self.pipeline is None:
            return
        up = GaugeMetricFamily("hydra_peer_up", "1 when the peer is attached.", labels=["peer"])
        rtt = GaugeMetricFamily(
            "hydra_peer_rtt_seconds", "Last measured peer round trip (network part).", labels=["peer"]
        )
        rtt_max = GaugeMetricFamily(
            "hydra_peer_rtt_max_seconds", "Worst peer round trip of the last 10 s (network part).", labels=["peer"]
        )
        sent = CounterMetricFamily("hydra_peer_bytes_sent", "Bytes sent to the peer.", labels=["peer"])
        recv = CounterMetricFamily("hydra_peer_bytes_recv", "Bytes received from the peer.", labels=["peer"])
        pipelined = CounterMetricFamily(
            "hydra_peer_pipelined_chunks",
            "Prompt chunks sent to the peer without waiting (--prefill-pipeline).",
            labels=["peer"],
        )
        for r in self.pipeline.remotes:
            up.add_metric([r.addr], 1.0 if r.state == "up" else 0.0)
            if r.rtt_ms is not None:
                rtt.add_metric([r.addr], r.rtt_ms / 1e3)
            if (worst := r.rtt_max_ms) is not None:
                rtt_max.add_metric([r.addr], worst / 1e3)
            sent.add_metric([r.addr], r.bytes_sent)
            recv.add_metric([r.addr], r.bytes_recv)
            pipelined.add_metric([r.addr], r.pipelined)
        yield from (up, rtt, rtt_max, sent, recv, pipelined)
        yield CounterMetricFamily("hydra_resplits", "Live re-splits done.", value=self.pipeline.resplits)
