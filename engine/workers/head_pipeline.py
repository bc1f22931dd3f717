"""The head's pipeline at start: its own stage, checked against its device before anything loads,
and one RemoteStage per `--peer`, split by `--split`; the peers load their stages beside the head's
own when nothing can run out of memory halfway (`start_pipeline`), else before it."""

from __future__ import annotations

import logging

from ...contracts.footprint import rollback_depth
from ...contracts.split import parse_split
from ..config import HeadConfig
from ..errors import UserError

log = logging.getLogger("hydra.head")


def max_run_of(spec) -> int:
    """Tokens per slot of the longest decode step: a speculative verify runs the draft + 1 (its graphs,
    `graph_run_lengths`, are captured at start, on the head and its peers)."""
    return 1 + (spec.n_max if spec.type != "off" else 0)


def build_pipeline(cfg: HeadConfig, g, mcfg):
    """Head Stage + one RemoteStage per `--peer`, split by `--split`, every peer attached (see
    `start_pipeline`)."""
    pipeline, peers = start_pipeline(cfg, g, mcfg)
    peers.join()
    return pipeline


class PeersReady:
    """What is left of a split pipeline's start: the peers' LOAD_STAGEs, when they run beside the
    head's own load (`start_pipeline`). `join` waits for them and starts the watcher that re-attaches
    a peer lost later."""

    def __init__(self, cfg: HeadConfig, pipeline, loading=None):
        self.cfg, self.pipeline, self.loading = cfg, pipeline, loading

    def check(self) -> None:
        """Raises what attaching a peer raised so far (`PeersLoading.check`)."""
        if self.loading is not None:
            self.loading.check()

    def join(self) -> None:
        missing = self.loading.join() if self.loading is not None else []
        remotes = self.pipeline.remotes
        if missing:
            for r in remotes:
                r.close()
            raise UserError(_never_up(missing, self.cfg.peer_wait))
        if remotes:
            self.pipeline.recovery.start_watch()


def start_pipeline(cfg: HeadConfig, g, mcfg):
    """Head Stage + one RemoteStage per `--peer`, split by `--split`, and the `PeersReady` to join
    before serving. A peer's LOAD_STAGE (its weights, then its graphs' compile and capture: as long
    as the head's own warm-up) runs beside the head's loading and whatever the caller does before
    `join` when nothing can run out of memory halfway: the head's stage and those of every peer on
    this host (which may share its GPU or RAM: each one's check would see memory free that the other
    is about to take) fit what is free now. Otherwise the head waits for the peers (`--peer-wait`,
    polling every 2 s) before loading its own range, as with `--fallback-solo`, whose range depends
    on whether they come: if they never do it fails or runs every layer here when they fit."""
    from ..device import resolve_device, resolve_dtype
    from ..pipeline import Pipeline
    from ..rpc.client import RemoteStage
    from ..rpc.peer_recovery import PeersLoading, wait_for_peers

    m, n_slots = cfg.model, cfg.parallel
    max_run = max_run_of(cfg.spec)
    ranges = parse_split(cfg.split, mcfg.n_layers, 1 + len(cfg.peers))
    device = resolve_device(m.device)
    dtype = resolve_dtype(m.dtype, device)
    # Before any peer loads or anything is allocated.
    _check_own_stage(cfg, g, ranges[0], device, dtype, f"--split {cfg.split or 'even'}")
    if cfg.output_stage == "last" and not _on_this_host(cfg.peers[-1]):
        log.warning(
            "--output-stage last with %s on another host: every logit row (%d bytes) crosses the link",
            cfg.peers[-1],
            4 * mcfg.n_vocab,
        )
    remotes = [
        RemoteStage(
            addr,
            r,
            g=g,
            dtype=dtype,
            n_slots=n_slots,
            n_ctx=m.ctx,
            kv_pool=m.kv_pool,
            kv_types=m.kv_types,
            max_run=max_run,
            deterministic=m.deterministic,
            auth_token=cfg.rpc.auth_token,
            max_frame=cfg.rpc.max_frame,
            spin_s=cfg.rpc.spin_seconds(device),
            head_device=device if cfg.rpc.cuda_ipc else None,
            pipeline_depth=cfg.rpc.prefill_pipeline,
            output=last,
            mtp=last and cfg.spec.type == "mtp",
        )
        for (addr, r), last in zip(zip(cfg.peers, ranges[1:]), _holds_output(cfg))
    ]
    loading = None
    if remotes and not cfg.fallback_solo and _fits_beside_local_peers(cfg, g, ranges, device, dtype):
        loading = PeersLoading(remotes, cfg.peer_wait)
    elif remotes:
        missing = wait_for_peers(remotes, cfg.peer_wait)
        if missing:
            for r in remotes:
                r.close()
            if not cfg.fallback_solo:
                raise UserError(_never_up(missing, cfg.peer_wait))
            _check_own_stage(cfg, g, (0, mcfg.n_layers), device, dtype, "--fallback-solo (every layer on the head)")
            log.warning(
                "peers %s never came up: --fallback-solo runs all %d layers on the head",
                ", ".join(f"{r.addr} ({r.error})" for r in missing),
                mcfg.n_layers,
            )
            remotes, ranges = [], [(0, mcfg.n_layers)]
        else:  # again: a peer on this GPU has loaded its stage since
            _check_own_stage(cfg, g, ranges[0], device, dtype, f"--split {cfg.split or 'even'}")
    pipeline = Pipeline(_build_stage(cfg, g, ranges[0], device, dtype), remotes, ranges=ranges)
    pipeline.recovery.grace = cfg.peer_grace
    return pipeline, PeersReady(cfg, pipeline, loading)


def _holds_output(cfg: HeadConfig) -> list[bool]:
    """Per peer, whether it holds the output head and the MTP block (`--output-stage last`: the last)."""
    return [cfg.output_stage == "last" and i == len(cfg.peers) - 1 for i in range(len(cfg.peers))]


def _never_up(missing: list, wait_s: float) -> str:
    names = ", ".join(f"{r.addr} ({r.error})" for r in missing)
    return f"peer(s) not ready after {wait_s:g} s: {names} (or start with --fallback-solo)"


def build_local(cfg: HeadConfig, g, layers: tuple[int, int], what: str):
    """The head's own stage for `layers`, checked against its device first (`_check_own_stage`)."""
    from ..device import resolve_device, resolve_dtype

    device = resolve_device(cfg.model.device)
    dtype = resolve_dtype(cfg.model.dtype, device)
    _check_own_stage(cfg, g, layers, device, dtype, what)
    return _build_stage(cfg, g, layers, device, dtype)


def _build_stage(cfg: HeadConfig, g, layers: tuple[int, int], device, dtype):
    from ..model import build_stage

    m = cfg.model
    return build_stage(
        g,
        layers,
        head=cfg.output_stage == "head",
        device=device,
        dtype=dtype,
        n_slots=cfg.parallel,
        n_ctx=m.ctx,
        cache_dir=m.cache_dir,
        quantized=m.quantized,
        compile_decode=m.compile,
        kv_types=m.kv_types,
        kv_pool=m.kv_pool,
        depth=rollback_depth(max_run_of(cfg.spec)),
        deterministic=m.deterministic,
    )


def head_footprint(cfg: HeadConfig, g, layers: tuple[int, int], device: str, dtype: str):
    """The head's stage (its layers, embedding, and unless `--output-stage last` the output head and
    the MTP block with `--spec-type mtp`) for these settings as contracts/footprint.py counts it (a
    `StageBytes`): what the head checks against its device before loading, and what
    benchmarks/bench_fit.py sets beside NVML."""
    from ...contracts.footprint import model_tensors

    m = cfg.model
    return model_tensors(g.metadata, g.tensors).stage(
        *layers,
        head=True,
        output=cfg.output_stage == "head",
        device=device,
        dtype=dtype,
        n_slots=cfg.parallel,
        n_ctx=m.ctx,
        kv_types=m.kv_types,
        gpu_weights=m.gpu_weights,
        kv_pool=m.kv_pool,
        prompt_rows=cfg.batch_tokens,
        mtp=cfg.spec.type == "mtp",
        depth=rollback_depth(max_run_of(cfg.spec)),
    )


def _check_own_stage(cfg: HeadConfig, g, layers: tuple[int, int], device, dtype, what: str) -> None:
    """The head's stage (`head_footprint`) against what is free on its device: a split that cannot fit
    is refused with both numbers before anything loads. Its CUDA context exists once `free_bytes`
    asked, so it is not counted again."""
    from ...contracts.fit import headroom_bytes
    from ..device import fit_here

    m, mtp = cfg.model, cfg.spec.type == "mtp" and cfg.output_stage == "head"
    est = head_footprint(cfg, g, layers, device.type, str(dtype).removeprefix("torch."))
    fit = fit_here("head", layers, est.total - est.runtime_bytes, headroom_bytes(m.headroom_gb), device, mtp=mtp)
    if not fit.fits:
        raise UserError(
            f"{what} refused before loading: {fit.reason()}; "
            "give the head fewer layers, a smaller --ctx or a smaller --headroom-gb"
        )


def _fits_beside_local_peers(cfg: HeadConfig, g, ranges: list, device, dtype) -> bool:
    """Whether the head's stage (`head_footprint`) and the stages of its peers on this host (which may
    share its GPU, or its RAM) fit what is free on its device now, together: then their loads may
    run side by side (`start_pipeline`)."""
    from ...contracts.fit import headroom_bytes
    from ...contracts.footprint import model_tensors
    from ..device import fit_here

    m, name = cfg.model, str(dtype).removeprefix("torch.")
    own = head_footprint(cfg, g, ranges[0], device.type, name)
    need = own.total - own.runtime_bytes  # as _check_own_stage: our CUDA context exists already
    tensors = model_tensors(g.metadata, g.tensors)
    for addr, (a, b), last in zip(cfg.peers, ranges[1:], _holds_output(cfg)):
        if _on_this_host(addr):
            peer = tensors.stage(
                a,
                b,
                head=False,
                output=last,
                mtp=last and cfg.spec.type == "mtp",
                device=device.type,
                dtype=name,
                n_slots=cfg.parallel,
                n_ctx=m.ctx,
                kv_types=m.kv_types,
                gpu_weights=m.gpu_weights,
                kv_pool=m.kv_pool,
                depth=rollback_depth(max_run_of(cfg.spec)),
            )
            need += peer.total
    return fit_here("head", ranges[0], need, headroom_bytes(m.headroom_gb), device).fits


def _on_this_host(addr: str) -> bool:
    """Whether a `host:port` peer address names this machine (loopback or one of its interfaces); a
    name that does not resolve now counts as this machine's."""
    import ipaddress
    import socket

    import psutil

    host = addr.rsplit(":", 1)[0].strip("[]")
    try:
        ips = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return True
    ours = {a.address.split("%")[0] for nic in psutil.net_if_addrs().values() for a in nic}
    return any(ipaddress.ip_address(ip.split("%")[0]).is_loopback or ip in ours for ip in ips)
