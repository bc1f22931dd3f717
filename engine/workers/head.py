"""`hydra-engine serve`: the head worker.

Start order: bind the HTTP port and serve /health (503, "starting") at once; then, in a loader
thread, model file → tokenizer → speculator → pipeline (own stage + peers, waiting for them) →
merged RPC port → engine, each step moving /health's startup_stage on. Stop order is the reverse:
engine, RPC port, pipeline (peer connections), on SIGTERM too, after the HTTP API's drain
(http/drain.py: new requests 503, those in flight finish within --drain-grace or end with a clean 503).
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
import traceback

from ...contracts.footprint import rollback_depth
from ...contracts.split import parse_split
from ...contracts.status import READY_STAGE, WARMING_STAGE, ModelInfo
from ..config import HeadConfig
from ..errors import UserError
from ..http.api import create_app
from ..http.drain import Drain
from ..http.worker import http_server, listen_sockets
from ..metrics import Metrics
from ..status import StatusDocument

log = logging.getLogger("hydra.head")


class HeadWorker:
    """The head's parts, and what the HTTP routes read: status, metrics and, once loaded, the
    model's name, tokenizer and engine."""

    def __init__(self, cfg: HeadConfig):
        self.cfg = cfg
        self.status = StatusDocument(cfg.role, cfg.host, cfg.port, config=cfg.redacted())
        self.metrics = Metrics(self.status)
        self.drain = Drain(cfg.drain_grace, self.status)  # SIGTERM: the API's requests end before the engine
        self.model_name: str | None = cfg.aliases[0] if cfg.aliases else None
        self.pooling: str | None = None  # embedding pooling, resolved from --pooling and the GGUF at load
        self.rank_head = None  # model.rank.RankHead: pooling rank on a reranker
        self.rank_refusal: str | None = None  # pooling rank on another model: why /rerank is refused
        self.created = int(time.time())
        self.gguf = None
        self.tok = None
        self.chat_template = None  # chat.ChatTemplate: --chat-template, else the GGUF's
        self.fim_tokens: dict[str, int | None] = {}  # /infill's pre/suf/mid/rep/sep token ids
        self.engine = None
        self.pipeline = None
        self.rpc = None
        self.disaggregator = None  # pd.Disaggregator with --prefill-worker
        self.idle = None  # IdleSleep with --sleep-idle-seconds, once loaded
        self.error: BaseException | None = None

    @property
    def ready(self) -> bool:
        return self.status.startup_stage >= READY_STAGE and self.engine is not None

    def load(self) -> None:
        """Model file → Pipeline → Engine; each step moves /health's startup_stage on."""
        # Imported here, not at the top: they bring torch, and /health must answer while it loads.
        from ..default_model import model_path
        from ..embedding import resolve_pooling
        from ..gguf_file import GGUFFile
        from ..model import ModelConfig
        from ..model.rank import NotAReranker, RankHead
        from ..pd import Disaggregator, PdStats, PrefillClient
        from ..rpc.service import HeadRpc, RpcCollector
        from ..spec import check_speculative
        from ..text.chat import ChatTemplate
        from ..text.tokenizer import Tokenizer, fim_tokens

        cfg = self.cfg
        path = model_path(cfg.model.model)
        self.gguf = g = GGUFFile(path)
        self.tok = Tokenizer.from_gguf(g)
        self.chat_template = ChatTemplate.for_model(self.tok, g, cfg.chat_template, cfg.chat_template_source)
        self.fim_tokens = fim_tokens(self.tok, g.metadata)
        mcfg = ModelConfig.from_gguf(g)
        self.model_name = self.model_name or path.stem
        if cfg.embedding or cfg.pooling is not None:
            self.pooling = resolve_pooling(cfg.pooling, g.metadata, g.architecture)
        if self.pooling == "rank":
            try:
                self.rank_head = RankHead.from_gguf(g)
            except NotAReranker as e:  # generation still serves; /rerank says why it cannot
                self.rank_refusal = str(e)
                log.warning("pooling rank: %s", e)
        self.status.model = ModelInfo(self.model_name, str(path), g.architecture, mcfg.n_layers, g.fingerprint)
        self.status.startup_stage = 2
        check_speculative(cfg.spec, cfg.model_draft, g)  # before the peers: a bad flag fails at once
        self.context_shift = context_shift_of(cfg, mcfg, self.tok)
        self.pipeline = pipeline = build_pipeline(cfg, g, mcfg)
        if cfg.peers and not pipeline.remotes:
            self.status.degraded = "--fallback-solo: the peers never came up, every layer runs on the head"
        self.status.pipeline = pipeline
        pd_stats = PdStats(cfg.prefill_worker, cfg.prefill_threshold if cfg.prefill_worker else 0)
        self.rpc = HeadRpc(cfg.rpc, g, mcfg, pipeline, self.status.model, role=cfg.role, pd_stats=pd_stats).start()
        self.status.add_provider(self.rpc.status)
        self.metrics.register(RpcCollector(self.rpc.listener, pipeline))
        if cfg.prefill_worker or cfg.role == "prefill":
            self.status.add_provider(pd_stats.status)
            self.metrics.register(pd_stats)
        self.status.startup_stage = 3
        if cfg.prefill_worker:
            client = PrefillClient(cfg.prefill_worker, cfg.rpc.auth_token, cfg.prefill_deadline)
            self.disaggregator = Disaggregator(
                client, cfg.prefill_threshold, pipeline, pd_stats, cuda_ipc=cfg.rpc.cuda_ipc, shm=cfg.rpc.shm
            )
        self.status.startup_stage = WARMING_STAGE
        self._start_engine()
        self.status.startup_stage = READY_STAGE
        if cfg.sleep_idle_seconds is not None:
            from .idle_sleep import IdleSleep

            self.idle = IdleSleep(cfg.sleep_idle_seconds, self.sleep, self.wake, busy=self._engine_busy).start()
            self.rpc.control.awake = self.idle.held

    def _start_engine(self, counters=None) -> None:
        """The drafters, the warmed-up graphs and the engine over the pipeline's stage, wired to the
        RPC port and /status; `counters`: the engine before a sleep's, which this one goes on from."""
        from ..serving.runtime import Engine
        from ..spec import build_speculator

        cfg, pipeline = self.cfg, self.pipeline
        # The MTP block shares the head stage's embedding and output head.
        speculator = build_speculator(
            cfg.spec, cfg.model_draft, self.gguf, cfg.model, n_slots=cfg.parallel, head=pipeline.local
        )
        t0 = time.perf_counter()
        pipeline.local.warm_up(range(1, max_run_of(cfg.spec) + 1), prefill_tokens=cfg.batch_tokens)
        log.info("decode and prefill graphs warmed up in %.1f s", time.perf_counter() - t0)
        self.engine = Engine(
            pipeline,
            self.tok,
            n_slots=cfg.parallel,
            n_ctx=cfg.model.ctx,
            speculator=speculator,
            batch_tokens=cfg.batch_tokens,
            max_queue=cfg.max_queue,
            disaggregator=self.disaggregator,
            overlap=cfg.overlap,
            context_shift=self.context_shift,
            counters=counters,
        ).start()
        self.rpc.control.engine = self.engine
        pipeline.active_slots = self.engine.kv.busy_slots  # the KV a rebuild replays
        self.status.engine = self.engine

    def _engine_busy(self) -> bool:
        return bool(self.engine.n_processing or self.engine.n_deferred)

    def sleep(self) -> None:
        """--sleep-idle-seconds: free the model as llama-server does: the engine with its drafters
        (a draft model, the MTP block), this stage's weights, KV and graphs, the prompt caches.
        Peers keep their stages (their memory is theirs to give; waking needs no peer to load
        again) but every slot is cleared on them. /status and /metrics read the stopped engine's
        counters meanwhile; the tokenizer and chat template stay (no model memory)."""
        from ..serving.dormant import DormantEngine

        self.engine.stop()
        self.status.engine = self.engine = DormantEngine(self.engine)
        self.rpc.control.engine = None
        self.rpc.host.stage = None  # the head's resident set is gone: its epoch moves on
        self.rpc.host.epoch += 1
        self.pipeline.release()
        _return_memory()
        self.status.sleeping = True

    def wake(self) -> None:
        """The first request after a sleep: this stage (for the layers the split gives it now), the
        drafters and the engine built again as at the start; the counters go on."""
        cfg, pipeline = self.cfg, self.pipeline
        local = build_local(cfg, self.gguf, pipeline.ranges[0], "--sleep-idle-seconds' reload")
        pipeline.restore(local)
        self.rpc.host.stage = local
        self.rpc.host.epoch += 1
        self._start_engine(self.engine.counters)
        self.status.sleeping = False

    def stop(self) -> None:
        if self.idle is not None:  # first: no sleep or wake while the parts stop
            self.idle.stop()
        if self.pipeline is not None:  # first: an engine step paused for a lost peer must not hold up the stop
            self.pipeline.interrupt()
        for part in (self.engine, self.rpc, self.pipeline):
            if part is not None:
                part.stop()

    def serve(self) -> int:
        """Serve until stopped; a load failure ends the server and is reported here."""
        cfg = self.cfg
        socks = listen_sockets(cfg.host, cfg.port)
        server = http_server(create_app(self), cfg.http, self.drain)

        def load():
            try:
                self.load()
                print(f"hydra-engine: serving {self.model_name} on http://{cfg.host}:{cfg.port}", file=sys.stderr)
            except BaseException as e:  # any failure ends the server; serve() reports it
                self.error = e
                self.status.error = f"{type(e).__name__}: {e}"
                server.should_exit = True

        threading.Thread(target=load, name="hydra-load", daemon=True).start()
        # On SIGTERM uvicorn drains the API (http/drain.py), stops serving, then raises the signal
        # again under the handler it found: this one lets `stop` run (a decode head's shared memory
        # under /dev/shm is unlinked there) before the signal ends the process as it would have.
        signal.signal(signal.SIGTERM, _terminated)
        terminated = False
        try:
            server.run(sockets=socks)
        except Terminated:
            terminated = True
        finally:
            self.stop()
        if terminated:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.raise_signal(signal.SIGTERM)
        if isinstance(self.error, UserError):
            raise self.error
        if self.error is not None:
            traceback.print_exception(self.error, file=sys.stderr)
            return 1
        return 0


class Terminated(BaseException):
    """SIGTERM, once uvicorn has stopped serving."""


def _terminated(sig, frame) -> None:
    raise Terminated


def context_shift_of(cfg: HeadConfig, mcfg, tok):
    """`--context-shift` as the engine applies it (None: off). A recurrent (DeltaNet) state cannot
    drop tokens (llama.cpp turns the flag off there: here it is refused, not silently ignored)."""
    from ..serving.context_shift import ContextShift

    if not cfg.context_shift:
        return None
    if mcfg.recurrent:
        raise UserError(
            f"--context-shift: {mcfg.arch}'s recurrent layers cannot drop tokens from their state "
            "(attention-only models can shift); serve without it"
        )
    return ContextShift(cfg.n_keep, bool(tok.add_bos and tok.bos_id is not None))


def max_run_of(spec) -> int:
    """Tokens per slot of the longest decode step: a speculative verify runs the draft + 1 (their
    graphs are captured at start, on the head and its peers)."""
    return 1 + (spec.n_max if spec.type != "off" else 0)


def build_pipeline(cfg: HeadConfig, g, mcfg):
    """Head Stage + one RemoteStage per `--peer`, split by `--split`; waits for the peers
    (`--peer-wait`, polling every 2 s) and, if they never come, fails or (`--fallback-solo`)
    runs every layer here when they fit."""
    from ..device import resolve_device, resolve_dtype
    from ..pipeline import Pipeline
    from ..rpc.client import RemoteStage
    from ..rpc.peer_recovery import wait_for_peers

    m, n_slots = cfg.model, cfg.parallel
    max_run = max_run_of(cfg.spec)
    ranges = parse_split(cfg.split, mcfg.n_layers, 1 + len(cfg.peers))
    device = resolve_device(m.device)
    dtype = resolve_dtype(m.dtype, device)
    # Before any peer loads or anything is allocated.
    _check_own_stage(cfg, g, ranges[0], device, dtype, f"--split {cfg.split or 'even'}")
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
        )
        for addr, r in zip(cfg.peers, ranges[1:])
    ]
    # Wait before loading our own range: with --fallback-solo it depends on the outcome.
    missing = wait_for_peers(remotes, cfg.peer_wait)
    if missing:
        names = ", ".join(f"{r.addr} ({r.error})" for r in missing)
        for r in remotes:
            r.close()
        if not cfg.fallback_solo:
            raise UserError(f"peer(s) not ready after {cfg.peer_wait:g} s: {names} (or start with --fallback-solo)")
        _check_own_stage(cfg, g, (0, mcfg.n_layers), device, dtype, "--fallback-solo (every layer on the head)")
        log.warning("peers %s never came up: --fallback-solo runs all %d layers on the head", names, mcfg.n_layers)
        remotes, ranges = [], [(0, mcfg.n_layers)]
    elif remotes:  # again: a peer on this GPU has loaded its stage since
        _check_own_stage(cfg, g, ranges[0], device, dtype, f"--split {cfg.split or 'even'}")
    pipeline = Pipeline(_build_stage(cfg, g, ranges[0], device, dtype), remotes, ranges=ranges)
    pipeline.recovery.grace = cfg.peer_grace
    if remotes:
        pipeline.recovery.start_watch()
    return pipeline


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


def _return_memory() -> None:
    """What the freed stage held goes back to the system: Python's cycles collected, the CUDA
    caching allocator emptied, and glibc's heap trimmed (its arenas kept the freed weights' pages:
    the default model's head on CPU stayed at 666 MiB asleep, 356 MiB trimmed, 1019 MiB awake)."""
    import ctypes
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: its allocator returns what it returns
        pass


def head_footprint(cfg: HeadConfig, g, layers: tuple[int, int], device: str, dtype: str):
    """The head's stage (its layers, embedding and output head, the MTP block with `--spec-type mtp`)
    for these settings as contracts/footprint.py counts it (a `StageBytes`): what the head checks
    against its device before loading, and what benchmarks/bench_fit.py sets beside NVML."""
    from ...contracts.footprint import model_tensors

    m = cfg.model
    return model_tensors(g.metadata, g.tensors).stage(
        *layers,
        head=True,
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

    m, mtp = cfg.model, cfg.spec.type == "mtp"
    est = head_footprint(cfg, g, layers, device.type, str(dtype).removeprefix("torch."))
    fit = fit_here("head", layers, est.total - est.runtime_bytes, headroom_bytes(m.headroom_gb), device, mtp=mtp)
    if not fit.fits:
        raise UserError(
            f"{what} refused before loading: {fit.reason()}; "
            "give the head fewer layers, a smaller --ctx or a smaller --headroom-gb"
        )
