"""`hydra-engine serve`: the head worker.

Start order: bind the HTTP port and serve /health (503, "starting") at once; then, in a loader
thread, model file → tokenizer → pipeline (own stage; the peers load theirs meanwhile when they
may, `start_pipeline`) → merged RPC port → speculator → warm-up → the peers joined → engine, each
step moving /health's startup_stage on (and /status `startup_s`'s load phases). Stop order is the reverse:
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

from ...contracts.status import READY_STAGE, WARMING_STAGE, ModelInfo
from ..config import HeadConfig
from ..errors import UserError
from ..http.api import create_app
from ..http.drain import Drain
from ..http.worker import http_server, listen_sockets
from ..metrics import Metrics
from ..status import StatusDocument
from .head_pipeline import PeersReady, build_local, max_run_of, start_pipeline

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
        # The peers may load their stages meanwhile (`start_pipeline`), joined after our warm-up.
        pipeline, peers = start_pipeline(cfg, g, mcfg)
        self.status.mark("stage built")
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
        self._start_engine(pipeline, peers=peers)
        self.status.startup_stage = READY_STAGE
        if cfg.sleep_idle_seconds is not None:
            from .idle_sleep import IdleSleep

            self.idle = IdleSleep(cfg.sleep_idle_seconds, self.sleep, self.wake, busy=self._engine_busy).start()
            self.rpc.control.awake = self.idle.held

    def _start_engine(self, pipeline, counters=None, peers: PeersReady | None = None) -> None:
        """The drafters, the warmed-up graphs and the engine over the pipeline's stage, wired to the
        RPC port and /status; `counters`: the engine before a sleep's, which this one goes on from.
        `peers` (the start's): the peers loading beside this, joined before the engine, and then
        `self.pipeline` is set (what `stop` closes: closing a peer would wait for its LOAD_STAGE)."""
        from ..model import graph_run_lengths
        from ..serving.runtime import Engine
        from ..spec import build_speculator

        cfg = self.cfg
        # The MTP block shares the head stage's embedding and output head, or is the last peer's with them.
        speculator = build_speculator(
            cfg.spec,
            cfg.model_draft,
            self.gguf,
            cfg.model,
            n_slots=cfg.parallel,
            head=pipeline.local,
            remote_output=pipeline.output_remote,
        )
        if peers is not None:
            if speculator.mtp is not None:
                self.status.mark("MTP block")
            peers.check()  # a peer refused already (another model, say): not after the whole warm-up
        t0 = time.perf_counter()
        mark = self.status.mark if peers is not None else lambda phase: None  # a start's phases, not a wake's
        pipeline.local.warm_up(graph_run_lengths(max_run_of(cfg.spec)), prefill_tokens=cfg.batch_tokens, mark=mark)
        log.info("decode and prefill graphs warmed up in %.1f s", time.perf_counter() - t0)
        if peers is not None:
            self.status.mark("graphs warmed")
            peers.join()
            if pipeline.remotes:
                self.status.mark("peers loaded")
        self.pipeline = pipeline
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
            mixed_steps=cfg.mixed_steps,
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
        self._start_engine(pipeline, self.engine.counters)
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
