"""Every worker's configuration, built once at the entry point (cli.py) from argv and the environment
(cli_config.py).

Nothing below the CLI reads `os.environ` or an argparse Namespace: each part gets the settings it
needs through its constructor. `/status` reports the effective configuration (`redacted()`), so an
operator sees what a worker runs with, never its secret.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from ..contracts.fit import DEFAULT_HEADROOM_GIB
from ..contracts.footprint import CACHE_TYPES, CUBLAS_WORKSPACE_BYTES
from .errors import UserError

# The environment variables Hydra reads (README lists them), all of them here and nowhere else.
ENVIRONMENT = {
    "HYDRA_TOKEN": "shared secret both RPC protocols require (like --auth-token, which `ps` would show)",
    "HYDRA_API_KEY": "key the head's HTTP API requires (like --api-key, which `ps` would show)",
    "HYDRA_CACHE_DIR": "prepared-weight cache directory; 'off' disables it (default ~/.cache/hydra-console/prepared)",
    "HYDRA_CUDA_IPC": "'0' turns off CUDA IPC between a head and a peer on the same GPU (default on)",
    "HYDRA_SHM": "'0' turns off shared memory for prompt states between a decode head and a prefill worker on one host (default on)",
    "HYDRA_RPC_SPIN_MS": "busy-wait for the next compute frame, in ms (default 20 on CUDA workers, 0 on CPU)",
    "AIP_MODE": "'PREDICTION' (Vertex AI sets it): the head also serves the predict route, as llama-server",
    "AIP_PREDICT_ROUTE": "that predict route's path (default /predict)",
}
GPU_SPIN_S = 0.02  # see RpcSettings.spin_seconds

SPEC_TYPES = ("off", "ngram", "draft", "mtp")
MAX_DRAFT = 32  # per-request cap: beyond this a draft costs more verify compute than it can win
# --max-body's default: a full-context prompt must fit. 64 bytes a token covers JSON-escaped text
# (a token is ~4 characters, at most 6 bytes each as \uXXXX) and token-id prompts ("123456, ").
BODY_BYTES_PER_TOKEN = 64
MIN_MAX_BODY = 1 << 20
DEFAULT_MAX_RESPONSE = 64 << 20  # bytes of one non-streamed response body; above: 400 naming --max-response
MAX_CHOICES = 128  # OpenAI's bound on `n`
DEFAULT_HEADER_TIMEOUT = 10.0  # seconds for a request's headers to arrive (slowloris)
DEFAULT_BODY_TIMEOUT = 60.0  # seconds for a request's body to arrive once its headers have
MAX_CONNECTIONS_CAP = 4096  # the default total connection cap never exceeds this
# Prefill tokens per step across all sequences (--batch-size): bounds how long a long prompt stalls decoders.
DEFAULT_BATCH_TOKENS = 256
# On a GPU a step's host time (eager launches, ~55 ms for a 7.2B's 32 layers) and, for quantized
# weights, one dequantization of every weight are paid per chunk whatever its length: llama.cpp's
# physical batch (-ub 512) takes a 512-token prompt in one step (docs/PERF.md, session 8).
DEFAULT_BATCH_TOKENS_GPU = 512
# Pipelined prefill (--prefill-pipeline): one chunk ahead is what two stages need; a few more absorb
# chunks whose times differ (the attention's part grows along the prompt).
DEFAULT_PREFILL_PIPELINE = 4
# Seconds a head's streams pause for a peer lost mid-forward. A peer's restart (SIGTERM, exit, a new
# process loading its layers) took 3.7-5.6 s with the default model on a loaded 2-core CPU box:
# a few seconds more, so a keyboard restart from the console never fails a stream.
DEFAULT_PEER_GRACE = 15.0


def default_batch_tokens(device: str) -> int:
    from .device import resolve_device  # torch: only when the default is asked for

    return DEFAULT_BATCH_TOKENS_GPU if resolve_device(device).type == "cuda" else DEFAULT_BATCH_TOKENS


def default_max_body(n_ctx: int) -> int:
    return max(MIN_MAX_BODY, n_ctx * BODY_BYTES_PER_TOKEN)


@dataclass(frozen=True)
class SpecConfig:
    """How a slot drafts: `type` off|ngram|draft|mtp, at most `n_max` tokens, drafts shorter than
    `n_min` dropped, draft-model tokens below probability `p_min` not proposed. `adaptive` (None:
    on for mtp, whose drafts cost a forward of its block each) picks each slot's k in [0, n_max]
    per step from its acceptance and the measured step costs (spec/adaptive.py); off: always n_max.
    `probabilistic`: at temperature > 0 a model drafter (draft model, MTP) samples its draft and the
    target verifies it by rejection sampling against its q; off (llama-server's
    `--spec-draft-sampling greedy`): it drafts its argmax, which the target's own seeded draw
    checks, so a seed gives the text it gives without speculation."""

    type: str = "off"
    n_max: int = 3
    n_min: int = 0
    p_min: float = 0.75
    adaptive: bool | None = None
    probabilistic: bool = True

    def __post_init__(self):
        if self.type not in SPEC_TYPES:
            raise UserError(f"speculative type must be one of {', '.join(SPEC_TYPES)}, got {self.type!r}")
        if not isinstance(self.n_max, int) or not 0 <= self.n_max <= MAX_DRAFT:
            raise UserError(f"draft max must be an integer in [0, {MAX_DRAFT}], got {self.n_max!r}")
        if not isinstance(self.n_min, int) or not 0 <= self.n_min <= max(self.n_max, 0):
            raise UserError(f"draft min must be an integer in [0, draft max={self.n_max}], got {self.n_min!r}")
        if not isinstance(self.p_min, (int, float)) or not 0.0 <= self.p_min <= 1.0:
            raise UserError(f"draft p-min must be a number in [0, 1], got {self.p_min!r}")
        if self.adaptive is not None and not isinstance(self.adaptive, bool):
            raise UserError(f"speculative adaptive must be true or false, got {self.adaptive!r}")
        if not isinstance(self.probabilistic, bool):
            raise UserError(f"speculative probabilistic must be true or false, got {self.probabilistic!r}")

    @property
    def active(self) -> bool:
        return self.type != "off" and self.n_max > 0

    @property
    def adapts(self) -> bool:
        return self.type == "mtp" if self.adaptive is None else self.adaptive


@dataclass(frozen=True)
class SamplingDefaults:
    """The server's sampling defaults (`--temp`, `--seed`, ...): what a request that omits a field
    gets; None leaves the engine's own default (sampling.SamplingParams)."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    seed: int | None = None

    def given(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclass(frozen=True)
class ModelSettings:
    model: str | None  # GGUF path; None = the embedded default model
    device: str = "auto"
    dtype: str = "auto"
    ctx: int = 4096
    cache_dir: Path | None = None  # prepared-weight cache; None = off
    gpu_weights: str = "quantized"  # or "dense": expanded to the compute dtype on a GPU
    compile: bool = True  # torch.compile the CUDA decode step before graph capture (--no-compile)
    kv_types: tuple[str, str] = ("auto", "auto")  # --cache-type-k / --cache-type-v (engine/model/kv_cache.py)
    kv_pool: int | None = None  # --kv-unified: positions of the KV pool all slots share; None: each reserves ctx
    # --headroom-gb: GiB a stage must leave free on its device (driver, desktop, estimate error):
    # a stage that would not is refused before anything is allocated (contracts/fit.py)
    headroom_gb: float = DEFAULT_HEADROOM_GIB
    deterministic: bool = False  # --deterministic: a token's floats independent of its batch (model.build_stage)

    @property
    def quantized(self) -> bool | None:
        """build_stage's `quantized`: None keeps them quantized where that applies (a GPU)."""
        return None if self.gpu_weights == "quantized" else False


@dataclass(frozen=True)
class RpcSettings:
    host: str = "127.0.0.1"
    port: int = 0
    max_frame: int = 1 << 30
    auth_token: str | None = field(default=None, repr=False)
    spin_ms: float | None = None  # None: GPU_SPIN_S on CUDA workers, 0 on CPU
    cuda_ipc: bool = True
    shm: bool = True  # a decode head offers its prefill worker shared memory for prompt states (rpc/shm.py)
    pool_size: int = 2  # head: request workers; peer: workers for connections other than the head's
    queue: int = 64
    # Prompt chunks the last peer may hold unanswered while the head computes the next (0: off).
    prefill_pipeline: int = DEFAULT_PREFILL_PIPELINE

    def spin_seconds(self, device) -> float:
        """How long a worker busy-waits for the next compute frame before blocking. A thread that
        sleeps while the other side computes pays a wake-up per hop: tens of microseconds on a GPU
        host (~3 % of a 1 ms half-step), ~1 ms on a KVM guest's halted vCPU. GPU workers spin by
        default (their host has cores to spare); CPU workers only when told, since a spinning wait
        there takes a core from the compute it is waiting for."""
        if self.spin_ms is not None:
            return self.spin_ms / 1e3
        return GPU_SPIN_S if str(device).startswith("cuda") else 0.0


def json_safe(value):
    """Paths as text, everywhere in a nested document (what /status serves must be JSON)."""
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return str(value) if isinstance(value, Path) else value


def descriptor_limit() -> int:
    """The process's soft limit on open file descriptors."""
    import resource

    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def default_max_connections(nofile: int) -> int:
    """Half the descriptor limit (the rest: model files, RPC sockets, shared memory), at most
    MAX_CONNECTIONS_CAP."""
    return max(16, min(MAX_CONNECTIONS_CAP, nofile // 2))


@dataclass(frozen=True)
class HttpLimits:
    """What one HTTP client may hold of the server (http/worker.py's `GuardedH11`): open connections
    in all (`max_connections`) and per client address (`max_client_connections`), seconds for a
    request's headers to arrive (from the connection's start or the previous response's end) and
    for its body once the headers have."""

    max_connections: int = 512
    max_client_connections: int = 128
    header_timeout: float = DEFAULT_HEADER_TIMEOUT
    body_timeout: float = DEFAULT_BODY_TIMEOUT


@dataclass(frozen=True)
class WorkerConfig:
    """What every worker has: a model, an HTTP address and its merged RPC port."""

    model: ModelSettings
    rpc: RpcSettings
    host: str = "127.0.0.1"
    port: int = 8090
    http: HttpLimits = HttpLimits()  # connection caps and read deadlines of its HTTP server

    def redacted(self) -> dict:
        """The configuration /status reports: the secret as `***`."""
        doc = dataclasses.asdict(self)
        doc["rpc"]["auth_token"] = "***" if self.rpc.auth_token else None
        return json_safe(doc)


@dataclass(frozen=True)
class HeadConfig(WorkerConfig):
    port: int = 8080
    parallel: int = 4
    aliases: tuple[str, ...] = ()  # --alias, sorted: the first is the model's id (llama-server's std::set)
    tags: tuple[str, ...] = ()
    peers: tuple[str, ...] = ()
    split: str | None = None
    fallback_solo: bool = False
    output_stage: str = "head"  # --output-stage: "last" puts the output head and MTP block on the last peer
    peer_wait: float = 180.0
    peer_grace: float = DEFAULT_PEER_GRACE  # seconds streams pause for a peer lost mid-forward (rpc/peer_recovery.py)
    spec: SpecConfig = SpecConfig()
    model_draft: str | None = None
    api_key: str | None = field(default=None, repr=False)  # None: the HTTP API is open
    max_body: int = MIN_MAX_BODY  # bytes of a request body; above: 413
    max_queue: int = 64  # requests waiting beyond the slots; above: 503 + Retry-After
    drain_grace: float = 30.0  # seconds in-flight requests run on after SIGTERM (http/drain.py)
    # idle seconds before the head frees its model (workers/idle_sleep.py); None: never
    sleep_idle_seconds: int | None = None
    n_predict: int = 1024  # max_tokens of a chat request that names none; -1: unbounded (to the context's end)
    context_shift: bool = (
        False  # --context-shift: a full slot drops half its tokens and goes on (serving/context_shift.py)
    )
    n_keep: int = 0  # --keep: prompt tokens a context shift keeps after the BOS (-1: all)
    max_n: int = 4  # choices (`n`) one request may ask for; above: 400 (default: --parallel)
    max_response: int = DEFAULT_MAX_RESPONSE  # bytes of a non-streamed response body; above: 400
    batch_tokens: int = DEFAULT_BATCH_TOKENS  # prompt tokens per engine step (-b, --batch-size)
    slot_save_path: Path | None = None  # where /slots save and restore files live; None: off
    embedding: bool = False  # /embedding(s), /v1/embeddings and /rerank answer (--embedding, --reranking)
    pooling: str | None = None  # None: the GGUF's pooling_type, else none (embedding.resolve_pooling)
    embd_normalize: int = 2  # embedding.normalize's p
    cors_origins: str = "*"  # http_cors.Cors: "*" reflects any Origin, "localhost" only local ones, else a list
    slots: bool = True  # GET /slots (--no-slots: 501)
    metrics: bool = True  # GET /metrics (--no-metrics: 501); llama-server defaults off, the console reads it
    role: str = "head"  # or "prefill": only prefills, for decode heads (PREFILL)
    prefill_worker: str | None = None  # HOST:PORT of a prefill worker's RPC port; None: prefill here
    prefill_threshold: int = 256  # prompt tokens to compute at which the prefill worker takes over
    prefill_deadline: float = 30.0  # seconds for prefill + transfer before the head prefills itself
    sampling: SamplingDefaults = SamplingDefaults()
    chat_template: str | None = None  # --chat-template(-file): a built-in name or jinja source; None: the GGUF's
    # --jinja or a file: what is not a built-in name is jinja source even without a "{" (llama-server's)
    chat_template_source: bool = False
    chat_template_kwargs: dict = field(default_factory=dict)  # template variables of every chat (--reasoning)
    verbose: bool = False  # every chat response carries __verbose (llama-server's --verbose)
    overlap: bool | None = None  # --overlap / --no-overlap: decoding steps launched ahead of the host (None: on a GPU)
    mixed_steps: bool | None = None  # --mixed-steps: prompt chunks beside decoding tokens in one step (None: off a GPU)
    predict_route: str | None = None  # Vertex AI's predict route (env AIP_MODE=PREDICTION); None: off

    def redacted(self) -> dict:
        doc = super().redacted()
        doc["api_key"] = "***" if self.api_key else None
        return doc


@dataclass(frozen=True)
class PeerConfig(WorkerConfig):
    """The head assigns a peer's layers; its own settings are where it listens and whether it may
    listen beyond loopback without a token."""

    insecure: bool = False
    layer_delay_ms: float = 0.0  # tests: a per-layer delay on every forward and probe (a slow peer on purpose)


# ---- from argv and the environment -----------------------------------------------------------------


def default_cache_dir(env: Mapping[str, str]) -> Path | None:
    """The prepared-weight cache directory: $HYDRA_CACHE_DIR ("off" disables the cache), else
    ~/.cache/hydra-console/prepared."""
    value = env.get("HYDRA_CACHE_DIR")
    if value == "off":
        return None
    return Path(value) if value else Path.home() / ".cache" / "hydra-console" / "prepared"


# llama.cpp's names; "auto" = the compute dtype (what model/kv_cache.py stores for each), declared
# with their bytes per value in contracts/footprint.py (the console's estimate reads them there).
KV_CACHE_TYPES = CACHE_TYPES


def cuda_env() -> dict[str, str]:
    """cuBLAS's workspace per stream as the memory estimate counts it (two chunks, in KiB), read by
    torch when a stream first runs a product."""
    return {"CUBLAS_WORKSPACE_CONFIG": f":{CUBLAS_WORKSPACE_BYTES // 2 >> 10}:2"}


def worker_env(env: Mapping[str, str]) -> dict[str, str]:
    """What a worker's entry point puts in its environment before torch is imported (the operator's
    own settings win): the compile caches under the cache folder `env` names, cuBLAS's workspace."""
    return {**compile_cache_env(default_cache_dir(env)), **cuda_env()}


def compile_cache_env(cache_dir: Path | None) -> dict[str, str]:
    """Inductor's and Triton's caches beside the prepared weights, so a restarted worker reuses its
    compiled decode step (seconds, not a fresh compile)."""
    if cache_dir is None:
        return {}
    return {"TORCHINDUCTOR_CACHE_DIR": str(cache_dir / "inductor"), "TRITON_CACHE_DIR": str(cache_dir / "triton")}
