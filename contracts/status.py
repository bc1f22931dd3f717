"""The `/health` and `/status` documents (DESIGN §5), declared once.

Workers build these objects and serve `to_json()`; the console parses each probe once with
`from_json`, which never raises: a field that is missing or of the wrong type takes its default,
so a half-started worker, an older version or something else on the port still renders.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any

# "warming": the decode step is being compiled and captured (llama-server answers "loading" meanwhile).
STARTUP_STAGES = {1: "alive", 2: "model loaded", 3: "RPC active", 4: "warming", 5: "ready"}
READY_STAGE = 5
WARMING_STAGE = 4


class _Doc:
    """JSON in and out for the dataclasses below."""

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, obj: Any):
        if not isinstance(obj, dict):
            return cls()
        hints = typing.get_type_hints(cls)
        kw = {}
        for f in dataclasses.fields(cls):
            if f.name in obj:
                ok, value = _coerce(hints[f.name], obj[f.name])
                if ok:
                    kw[f.name] = value
        return cls(**kw)


def _coerce(tp, value) -> tuple[bool, Any]:
    """(fits, value as `tp`) for the few shapes these documents use."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in typing.get_args(tp):
            return True, None
        for arg in typing.get_args(tp):
            if arg is not type(None):
                ok, v = _coerce(arg, value)
                if ok:
                    return True, v
        return False, None
    if origin is list:
        if not isinstance(value, list):
            return False, None
        (item,) = typing.get_args(tp)
        out = [v for ok, v in (_coerce(item, x) for x in value) if ok]
        return True, out
    if origin is tuple:  # a layer range [a, b)
        if (
            isinstance(value, (list, tuple))
            and len(value) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) for x in value)
        ):
            return True, (int(value[0]), int(value[1]))
        return False, None
    if origin is dict or tp is dict:
        return isinstance(value, dict), value
    if isinstance(tp, type) and issubclass(tp, _Doc):
        return isinstance(value, dict), tp.from_json(value)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool), float(value) if isinstance(
            value, (int, float)
        ) else None
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is Any:
        return True, value
    return isinstance(value, tp), value


@dataclass(frozen=True)
class Health(_Doc):
    """`/health`: 200 only while a request can be served. Load balancers read the code: it is 503
    while loading and whenever the worker cannot serve (a peer down, no stage). `status` "degraded"
    with `serving` true is degraded but serving (e.g. --fallback-solo took over): 200."""

    status: str = "starting"  # "starting" | "warming" | "ok" | "degraded"
    startup_stage: int = 1  # STARTUP_STAGES
    has_model: bool = False
    model_name: str | None = None
    rpc_active: bool = False
    error: str | None = None  # why loading failed
    serving: bool = True  # False: cannot serve now; older documents lack it (then readiness decides)
    reason: str | None = None  # why not serving, or why degraded

    @property
    def http_code(self) -> int:
        return 200 if self.startup_stage >= READY_STAGE and self.serving else 503

    def to_json(self) -> dict:
        """`error` and `reason` only when there is one: llama-server's clients read a key `error` in
        /health as a failure (absent fields parse back as None)."""
        doc = super().to_json()
        return {k: v for k, v in doc.items() if not (k in ("error", "reason") and v is None)}


@dataclass(frozen=True)
class Address(_Doc):
    host: str = ""
    port: int = 0
    running: bool | None = None


@dataclass(frozen=True)
class ModelInfo(_Doc):
    name: str | None = None
    path: str | None = None
    arch: str | None = None
    n_layers: int = 0
    fingerprint: str | None = None


@dataclass(frozen=True)
class StageInfo(_Doc):
    role: str = "?"  # "head" | "peer"
    addr: str | None = None
    layers: tuple[int, int] | None = None
    device: str = ""
    state: str = "?"
    # KV cache + recurrent (DeltaNet) state with its rollback checkpoints, all slots, in bytes;
    # None where this process does not know it (a peer, seen from the head: its own /status says).
    kv_bytes: int | None = None
    # Every weight the stage holds on its device (contracts/footprint.py estimates it); None as kv_bytes.
    weight_bytes: int | None = None
    # Passes over the stage's layers by path: "decode graph", "prefill graph", "packed graph", or "eager: <why>"; None as kv_bytes.
    steps: dict[str, int] | None = None


@dataclass(frozen=True)
class DeviceInfo(_Doc):
    index: int = 0
    kind: str = "?"  # "cuda" | "cpu"
    name: str = "?"
    memory_used: int | None = None
    memory_total: int | None = None
    util: float | None = None


@dataclass(frozen=True)
class ProcessInfo(_Doc):
    """The worker's own process (not the machine's totals, which `devices` carries)."""

    rss: int | None = None  # resident set, bytes
    gpu_memory: int | None = None  # NVML's per-process reading over every GPU (the CUDA context included)
    gpu_source: str | None = (
        None  # "nvml" | "torch" (the caching allocator's reservation, when NVML cannot see the pid)
    )
    # High-water marks since the start: torch's caching allocator over every GPU (reserved bytes;
    # NVML also counts the CUDA context), and the resident set.
    peak_device_bytes: int | None = None
    peak_rss: int | None = None
    device_reserved: int | None = None  # torch's caching allocator now, over every GPU
    device_allocated: int | None = None  # of that, in live tensors (the rest is cached for reuse)

    @property
    def runtime_bytes(self) -> int | None:
        """What the process takes on its GPUs outside torch's allocator (the CUDA context, loaded
        kernels), from NVML's reading: the split editor's estimate for this worker counts it."""
        if self.gpu_source != "nvml" or self.gpu_memory is None or self.device_reserved is None:
            return None
        return max(0, self.gpu_memory - self.device_reserved)


@dataclass(frozen=True)
class Throughput(_Doc):
    """Rates over the last ~10 s; totals are monotonic."""

    prefill_tok_s: float = 0.0
    decode_tok_s: float = 0.0
    prefill_tokens_total: int = 0
    decode_tokens_total: int = 0
    steps_total: int = 0
    # The steps' wall seconds by phase (engine/serving/stats.py STEP_PHASES: schedule, drafting
    # included; forward, queueing the layers; read, waiting for the tokens; emit): / steps_total is
    # where an average step goes.
    step_phase_s: dict = field(default_factory=dict)
    # Of those, the steps that held prompt rows: their count and seconds by phase.
    prompt_steps_total: int = 0
    prompt_step_phase_s: dict = field(default_factory=dict)

    def step_ms_since(self, before: Throughput, decode_only: bool = False) -> dict[str, float] | None:
        """An average step's milliseconds by phase over the steps between `before` and these totals
        (the console's step line, vs_llama_cpp's `step_ms_N`); `decode_only`: over the steps that held
        no prompt rows. None when no such step ran between them."""
        (steps, now), (steps0, then) = self._steps(decode_only), before._steps(decode_only)
        if steps <= steps0 or not now:
            return None
        return {k: (v - then.get(k, 0.0)) / (steps - steps0) * 1e3 for k, v in now.items()}

    def steps_since(self, before: Throughput, decode_only: bool = False) -> int:
        """The steps between `before` and these totals (`decode_only`: those that held no prompt rows)."""
        return self._steps(decode_only)[0] - before._steps(decode_only)[0]

    def _steps(self, decode_only: bool) -> tuple[int, dict]:
        if not decode_only:
            return self.steps_total, self.step_phase_s
        prompt = self.prompt_step_phase_s
        return self.steps_total - self.prompt_steps_total, {
            k: v - prompt.get(k, 0.0) for k, v in self.step_phase_s.items()
        }


@dataclass(frozen=True)
class SpecSlot(_Doc):
    """A slot's adaptive drafting: the k its last step drafted (0: plain decode) and its estimated
    acceptance per draft position (each given the ones before were accepted)."""

    slot: int = 0
    k: int = 0
    acceptance: list[float] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0


@dataclass(frozen=True)
class Speculative(_Doc):
    type: str = "off"
    draft_max: int = 0
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    acceptance: float | None = None
    mean_accepted_len: float | None = None
    recent_acceptance: float | None = None
    accepted_per_pos: list[int] = field(default_factory=list)
    kv_bytes: int = 0  # the drafter's own cache: the MTP block's KV, or the draft model's KV
    adaptive: bool = False  # k chosen per slot and step (spec/adaptive.py); `slots`: each one's
    slots: list[SpecSlot] = field(default_factory=list)


@dataclass(frozen=True)
class Pool(_Doc):
    """The merged RPC port's bounded pool and its connections."""

    size: int = 0  # head: workers that serve each request; peer: workers each holding a non-head connection
    busy: int = 0
    queued: int = 0
    queue_max: int = 0
    dropped: int = 0
    accepted: int = 0
    connections: int = 0  # open on the port now: handshaking, idle or served
    compute: int = 0  # of those, compute sessions (on a head, its peers'; on a peer, the head's, beside the pool)
    auth_failures: int = 0  # handshakes that failed to prove the token (each slows its address down)

    @property
    def idle(self) -> int:
        """Open connections no pool worker holds (waiting for their next request)."""
        return max(self.connections - self.busy, 0)


@dataclass(frozen=True)
class PeerInfo(_Doc):
    addr: str = "?"
    state: str = "?"  # "up" | "down" | "connecting"
    rtt_ms: float | None = None
    compute_ms: float | None = None
    layers: tuple[int, int] | None = None
    bytes_sent: int = 0
    bytes_recv: int = 0
    epoch: int = 0
    transport: str | None = None  # "socket" | "cuda-ipc"
    attaches: int = 0
    error: str | None = None
    pipelined: int = 0  # prompt chunks sent without waiting for their reply (FORWARD_ACK: --prefill-pipeline)
    rtt_max_ms: float | None = None  # the worst round trip of the head's last ~10 s (rtt_ms: the last one)

    @property
    def rtt_peak_ms(self) -> float | None:
        """The worst round trip this document knows of (a spike between two polls included)."""
        known = [ms for ms in (self.rtt_ms, self.rtt_max_ms) if ms is not None]
        return max(known, default=None)


@dataclass(frozen=True)
class SlotInfo(_Doc):
    id: int = 0
    state: str = "idle"  # "idle" | "processing"
    n_ctx: int = 0
    n_past: int = 0
    id_task: int | None = None  # the request in it (llama-server's /slots fields)
    n_prompt_tokens: int | None = None
    n_decoded: int | None = None


@dataclass(frozen=True)
class Requests(_Doc):
    """The head's requests: slots and queue now; rate and latency percentiles over the last
    ~60 s (None: no request finished in it)."""

    slots_busy: int = 0
    slots_total: int = 0
    queued: int = 0  # waiting for a slot
    queue_max: int | None = None  # --max-queue; None = unbounded
    requests_per_s: float = 0.0
    requests_total: int = 0
    rejected_total: int = 0  # refused with 503: the queue was full
    ttft_p50_ms: float | None = None  # time to first token, from arrival (queue wait included)
    ttft_p99_ms: float | None = None
    itl_p50_ms: float | None = None  # inter-token latency, per generated token
    itl_p99_ms: float | None = None


@dataclass(frozen=True)
class Transfer(_Doc):
    """One request's prompt state fetched from the prefill worker (or its fallback)."""

    request: int = 0
    tokens: int = 0
    bytes: int = 0
    ms: float = 0.0  # fetch + placement, as the decode head saw it
    prefill_ms: float | None = None  # the prefill worker's own compute
    fallback: str | None = None  # None: placed; else why the head prefilled locally
    error: str | None = None
    collect_ms: float | None = None  # the prefill worker copying the state out
    place_ms: float | None = None  # this head placing it (waits for the running step, then copies)
    transport: str | None = None  # "socket", "shm" (the prefill worker on this head's host), or "cuda-ipc" (on its GPU)


@dataclass(frozen=True)
class Disaggregation(_Doc):
    """Prefill/decode disaggregation: a decode head's transfers and fallbacks (totals monotonic),
    a prefill worker's prefills served."""

    prefill_worker: str | None = None
    threshold: int = 0
    transfers: int = 0
    bytes: int = 0
    seconds: float = 0.0  # moving them: fetch + placement, less the prefill worker's compute
    fallbacks: int = 0
    fallback_reasons: dict = field(default_factory=dict)  # reason -> count
    served: int = 0
    served_bytes: int = 0
    recent: list[Transfer] = field(default_factory=list)


@dataclass(frozen=True)
class Status(_Doc):
    """`/status` of a head or a peer: one document the console reads."""

    role: str = "?"  # "head" | "peer" | "prefill"
    pid: int | None = None
    version: str | None = None
    uptime_s: float | None = None
    state: str = "starting"  # as Health.status
    sleeping: bool = False  # a head's model freed after --sleep-idle-seconds idle; the next request loads it
    startup_stage: int = 1
    # Seconds from the process's start (interpreter and imports included) to each startup stage
    # reached, by STARTUP_STAGES name, and to the head's load phases between them ("stage built":
    # its weights read and repacked; "MTP block": built, its graphs captured; on a GPU "decode graphs":
    # the decode and output head graphs compiled and captured, then "prefill graphs" or "packed
    # graphs" captured; "graphs warmed": the warm-up done; "peers loaded": their LOAD_STAGEs
    # answered, run beside the head's own when they may): where a start's time goes.
    startup_s: dict = field(default_factory=dict)
    http: Address | None = None
    rpc: Address | None = None
    model: ModelInfo | None = None
    stages: list[StageInfo] = field(default_factory=list)
    devices: list[DeviceInfo] = field(default_factory=list)
    process: ProcessInfo | None = None
    throughput: Throughput = field(default_factory=Throughput)
    speculative: Speculative = field(default_factory=Speculative)
    pool: Pool | None = None
    peers: list[PeerInfo] = field(default_factory=list)
    # The head's applied split: how many live re-splits, and who asked for the last one (CONFIGURE's
    # "by", e.g. "hydra-console pid 812 on lab1"); None = the split it started with.
    resplits: int = 0
    split_by: str | None = None
    slots: list[SlotInfo] = field(default_factory=list)
    requests: Requests | None = None  # the head's; None on a peer
    resident: dict | None = None  # a peer's resident stage: layers, epoch, forwards, bytes
    pd: Disaggregation | None = None  # a decode head with --prefill-worker, or a prefill worker
    config: dict | None = None  # the worker's effective configuration, secrets redacted
