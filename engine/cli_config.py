"""The worker configurations (config.py) built from argv and the environment: `head_config`,
`peer_config` and their parts (`model_settings`, `rpc_settings`, `http_limits`, the slot context,
the token file), each flag checked (UserError naming it). Only the entry point (cli.py) calls them."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path
from typing import Mapping

from .config import (
    DEFAULT_BODY_TIMEOUT,
    DEFAULT_HEADER_TIMEOUT,
    MAX_CHOICES,
    HeadConfig,
    HttpLimits,
    ModelSettings,
    PeerConfig,
    RpcSettings,
    SamplingDefaults,
    SpecConfig,
    default_batch_tokens,
    default_cache_dir,
    default_max_body,
    default_max_connections,
    descriptor_limit,
)
from .errors import UserError

DEFAULT_CTX = 4096


def slot_ctx(args) -> int:
    """Context per slot: --ctx, or llama-server's -c/--ctx-size shared by the --parallel slots (with
    --kv-unified, any slot may grow to the whole -c unless --ctx caps it)."""
    unified = getattr(args, "kv_unified", False)
    if args.ctx is not None and args.ctx_size is not None and not unified:
        raise UserError("--ctx (per slot) and -c/--ctx-size (all slots): give one of them (or both with --kv-unified)")
    if args.ctx_size is None or args.ctx is not None:
        return args.ctx if args.ctx is not None else DEFAULT_CTX
    _at_least(1, ctx_size=args.ctx_size)
    return args.ctx_size if unified else args.ctx_size // getattr(args, "parallel", 1)


def kv_pool(args, ctx: int) -> int | None:
    """--kv-unified: the positions of the pool the slots share (-c/--ctx-size, else every slot's
    context); None: each slot reserves its context."""
    if not getattr(args, "kv_unified", False):
        return None
    if args.ctx_size is None:
        return ctx * getattr(args, "parallel", 1)
    if ctx > args.ctx_size:
        raise UserError(f"--ctx {ctx} per slot exceeds the --kv-unified pool of -c/--ctx-size {args.ctx_size}")
    return args.ctx_size


def model_settings(args, env: Mapping[str, str]) -> ModelSettings:
    ctx = slot_ctx(args)
    _at_least(1, ctx=ctx)
    _at_least(0, headroom_gb=args.headroom_gb)
    return ModelSettings(
        args.model,
        args.device,
        args.dtype,
        ctx,
        default_cache_dir(env),
        args.gpu_weights,
        not args.no_compile,
        (args.cache_type_k, args.cache_type_v),
        kv_pool(args, ctx),
        args.headroom_gb,
        args.deterministic,
    )


def read_token_file(path: str) -> str:
    """The token in `path`, refused when group or others may read it (a secret file must stay one)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise UserError(f"--auth-token-file {path}: {e.strerror}") from None
    with os.fdopen(fd) as f:
        if os.fstat(fd).st_mode & 0o077:
            raise UserError(f"--auth-token-file {path}: readable by group or others; chmod 600 it")
        token = f.read().strip()
    if not token:
        raise UserError(f"--auth-token-file {path} is empty")
    return token


def rpc_settings(args, env: Mapping[str, str], **mode) -> RpcSettings:
    _at_least(1, max_frame=args.max_frame, rpc_pool_size=args.rpc_pool_size)
    _at_least(0, rpc_queue=args.rpc_queue)
    return RpcSettings(
        host=args.rpc_host,
        port=args.rpc_port if args.rpc_port is not None else args.port + 1,
        max_frame=args.max_frame,
        auth_token=(read_token_file(args.auth_token_file) if args.auth_token_file else args.auth_token)
        or env.get("HYDRA_TOKEN")
        or None,
        spin_ms=_spin_ms(env.get("HYDRA_RPC_SPIN_MS")),
        pool_size=args.rpc_pool_size,
        queue=args.rpc_queue,
        cuda_ipc=env.get("HYDRA_CUDA_IPC", "1") != "0",
        shm=env.get("HYDRA_SHM", "1") != "0",
        **mode,
    )


def head_config(args, env: Mapping[str, str]) -> HeadConfig:
    _at_least(1, parallel=args.parallel)
    _at_least(0, peer_wait=args.peer_wait, max_queue=args.max_queue)
    _at_least(0, prefill_pipeline=args.prefill_pipeline)
    _at_least(0, drain_grace=args.drain_grace, peer_grace=args.peer_grace)
    _at_least(-1, n_predict=args.n_predict, keep=args.keep)
    if args.sleep_idle_seconds == 0 or args.sleep_idle_seconds < -1:
        raise UserError(f"--sleep-idle-seconds must be -1 (never) or a positive count, got {args.sleep_idle_seconds}")
    batch_tokens = args.batch_size if args.batch_size is not None else default_batch_tokens(args.device)
    _at_least(1, batch_size=batch_tokens)
    max_body = args.max_body if args.max_body is not None else default_max_body(slot_ctx(args))
    _at_least(1024, max_body=max_body)
    max_n = args.max_n if args.max_n is not None else min(args.parallel, MAX_CHOICES)
    _at_least(1, max_n=max_n)
    if max_n > MAX_CHOICES:
        raise UserError(f"--max-n must be <= {MAX_CHOICES} (OpenAI's bound on n), got {max_n}")
    _at_least(1024, max_response=args.max_response)
    if args.output_stage == "last" and not args.peer:
        raise UserError("--output-stage last puts the output head on the last peer: it needs --peer")
    if args.output_stage == "last" and args.fallback_solo:
        raise UserError("--output-stage last and --fallback-solo: a solo head must hold the output head itself")
    spec = SpecConfig(
        type=args.spec_type,
        n_max=args.draft_max,
        n_min=args.draft_min,
        p_min=args.draft_p_min,
        adaptive={"auto": None, "on": True, "off": False}[args.draft_adaptive],
        probabilistic=args.spec_draft_sampling == "probabilistic",
    )
    return HeadConfig(
        model=model_settings(args, env),
        rpc=rpc_settings(args, env, prefill_pipeline=args.prefill_pipeline),
        host=args.host,
        port=args.port,
        parallel=args.parallel,
        aliases=_csv(args.alias),
        tags=_csv(args.tags),
        peers=tuple(args.peer),
        split=args.split,
        fallback_solo=args.fallback_solo,
        output_stage=args.output_stage,
        peer_wait=args.peer_wait,
        peer_grace=args.peer_grace,
        spec=spec,
        model_draft=args.model_draft,
        api_key=args.api_key or env.get("HYDRA_API_KEY") or None,
        max_body=max_body,
        max_queue=args.max_queue,
        drain_grace=args.drain_grace,
        sleep_idle_seconds=args.sleep_idle_seconds if args.sleep_idle_seconds > 0 else None,
        n_predict=args.n_predict,
        context_shift=args.context_shift,
        n_keep=args.keep,
        max_n=max_n,
        max_response=args.max_response,
        http=http_limits(args),
        batch_tokens=batch_tokens,
        slot_save_path=_existing_dir("--slot-save-path", args.slot_save_path),
        embedding=args.embedding or args.reranking,
        pooling=_pooling(args),
        embd_normalize=args.embd_normalize,
        cors_origins=_cors_origins(args.cors_origins),
        slots=args.slots,
        metrics=args.metrics,
        role=args.role,
        prefill_worker=_prefill_worker(args),
        prefill_threshold=args.prefill_threshold,
        prefill_deadline=args.prefill_deadline,
        sampling=_sampling_defaults(args),
        chat_template=_chat_template(args.chat_template, args.chat_template_file),
        chat_template_source=args.jinja or args.chat_template_file is not None,
        chat_template_kwargs={} if args.reasoning == "auto" else {"enable_thinking": args.reasoning == "on"},
        verbose=args.verbose,
        overlap=args.overlap,
        mixed_steps=args.mixed_steps,
        predict_route=_predict_route(env),
    )


def http_limits(args) -> HttpLimits:
    """--max-connections (default: half the descriptor limit, at most MAX_CONNECTIONS_CAP),
    --max-client-connections (default: a quarter of that), --header-timeout, --body-timeout; a
    peer (no such flags) takes the defaults."""
    nofile = descriptor_limit()
    total = getattr(args, "max_connections", None)
    total = total if total is not None else default_max_connections(nofile)
    _at_least(1, max_connections=total)
    if total >= nofile:
        raise UserError(f"--max-connections {total} must stay below the descriptor limit ({nofile}, ulimit -n)")
    per_client = getattr(args, "max_client_connections", None)
    per_client = per_client if per_client is not None else max(8, total // 4)
    _at_least(1, max_client_connections=per_client)
    header = getattr(args, "header_timeout", DEFAULT_HEADER_TIMEOUT)
    body = getattr(args, "body_timeout", DEFAULT_BODY_TIMEOUT)
    _at_least(0.1, header_timeout=header, body_timeout=body)
    return HttpLimits(total, min(per_client, total), header, body)


def _predict_route(env: Mapping[str, str]) -> str | None:
    if env.get("AIP_MODE") != "PREDICTION":
        return None
    route = env.get("AIP_PREDICT_ROUTE") or "/predict"
    return route if route.startswith("/") else "/" + route


def _csv(value: str | None) -> tuple[str, ...]:
    """llama-server's comma-separated names (--alias, --tags): stripped, empties dropped, sorted, unique."""
    return tuple(sorted({v.strip() for v in (value or "").split(",") if v.strip()}))


def _pooling(args) -> str | None:
    """--pooling; --reranking is pooling rank (llama-server's), which another --pooling contradicts."""
    if not args.reranking:
        return args.pooling
    if args.pooling not in (None, "rank"):
        raise UserError(f"--reranking pools by rank; --pooling {args.pooling} contradicts it")
    return "rank"


def _cors_origins(value: str) -> str:
    if not value.strip():
        raise UserError("--cors-origins must name origins, '*' or 'localhost'")
    return value.strip()


def _prefill_worker(args) -> str | None:
    """--prefill-worker, checked: HOST:PORT, on a decode head only."""
    addr = args.prefill_worker
    if addr is None:
        return None
    if args.role == "prefill":
        raise UserError("--prefill-worker is for decode heads: a --role prefill worker prefills itself")
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"--prefill-worker {addr!r}: expected HOST:PORT (the prefill worker's RPC port)")
    _at_least(0, prefill_threshold=args.prefill_threshold)
    if not args.prefill_deadline > 0:
        raise UserError(f"--prefill-deadline must be > 0 seconds, got {args.prefill_deadline}")
    return addr


def _sampling_defaults(args) -> SamplingDefaults:
    checks = {
        "temperature": (args.temperature, lambda v: 0 <= v <= 100, "in [0, 100]"),
        "top_k": (args.top_k, lambda v: v >= 0, ">= 0"),
        "top_p": (args.top_p, lambda v: 0 < v <= 1, "in (0, 1]"),
        "min_p": (args.min_p, lambda v: 0 <= v <= 1, "in [0, 1]"),
        "repeat_penalty": (args.repeat_penalty, lambda v: 0 < v <= 100, "in (0, 100]"),
    }
    for key, (value, ok, what) in checks.items():
        if value is not None and not ok(value):
            raise UserError(f"--{key.replace('_', '-')} must be {what}, got {value}")
    return SamplingDefaults(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repeat_penalty=args.repeat_penalty,
        seed=None if args.seed == -1 else args.seed,
    )


def _chat_template(inline: str | None, path: str | None) -> str | None:
    if inline and path:
        raise UserError("--chat-template and --chat-template-file: give one of them")
    if path is None:
        return inline
    try:
        return Path(path).read_text()
    except OSError as e:
        raise UserError(f"--chat-template-file {path}: {e.strerror}") from None


def peer_config(args, env: Mapping[str, str]) -> PeerConfig:
    cfg = PeerConfig(
        model=model_settings(args, env),
        rpc=rpc_settings(args, env),
        host=args.host,
        port=args.port,
        http=http_limits(args),
        insecure=args.insecure,
        layer_delay_ms=args.layer_delay_ms,
    )
    _at_least(0, layer_delay_ms=args.layer_delay_ms)
    _require_token_off_loopback(cfg)
    return cfg


def _require_token_off_loopback(cfg: PeerConfig) -> None:
    """Without a token anyone who reaches the port can load, run and clear this peer's stage:
    only loopback is allowed that way unless the operator says --insecure."""
    host = cfg.rpc.host
    if cfg.rpc.auth_token or cfg.insecure:
        return
    try:
        loopback = ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback:
        raise UserError(
            f"--rpc-host {host} without a token exposes this peer to anyone who reaches it: "
            "set HYDRA_TOKEN or --auth-token-file, or pass --insecure"
        )


def _existing_dir(flag: str, value: str | None) -> Path | None:
    if value is None:
        return None
    path = Path(value)
    if not path.is_dir():
        raise UserError(f"{flag} {value}: not a folder")
    return path


def _at_least(low: float, **values) -> None:
    for key, value in values.items():
        if value < low:
            raise UserError(f"--{key.replace('_', '-')} must be >= {low:g}, got {value}")


def _spin_ms(raw: str | None) -> float | None:
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise UserError(f"HYDRA_RPC_SPIN_MS must be a number of milliseconds, got {raw!r}") from None
    if not value >= 0:
        raise UserError(f"HYDRA_RPC_SPIN_MS must be >= 0, got {raw!r}")
    return value
