"""The engine loop: a background thread runs `step()` while requests are waiting or running.

nano-vllm's `LLMEngine`: a `Request` comes in (`submit`), the `Scheduler` binds it to a slot as a
`Sequence` and builds each step's `Batch`, the `ModelRunner` runs it (inputs, one `Pipeline.forward`,
sampling on the device, drafts verified), the scheduler appends the tokens and the `OutputProcessor`
turns them into `Event`s for each request's `sink` (the API bridges it into asyncio). A failed step
ends the requests in it with the exception as `Event.error`, never the engine. With overlap (on a
GPU; runner.py tells how) a plain decoding step launches before the host has read the step before.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Iterator

import torch

from ..config import DEFAULT_BATCH_TOKENS
from ..errors import KVPoolFull, Overloaded, Unavailable, describe
from ..spec import Speculator
from ..text.structured import Grammars
from .context_shift import ContextShift
from .kv_manager import KVManager
from .output import OutputProcessor
from .runner import Launched, ModelRunner
from .scheduler import SHED, Batch, Chunk, Sampled, Scheduler, mixed_by_default
from .sequence import Event, Request, Sequence, check_fits
from .slot_cache import SlotCache
from .stats import Counters, EngineStats
from .transfers import PromptTransfers

__all__ = ["DEFAULT_BATCH_TOKENS", "Engine", "EngineStats", "Request"]
log = logging.getLogger("hydra.engine")


class Engine:
    """Continuous batching over `n_slots` slots of `n_ctx` tokens each, driving `pipeline.forward`.
    `overlap`: launch plain decoding steps before reading the previous one (None: on a GPU).
    `context_shift`: a full slot shifts its context and generation goes on (None: it ends there)."""

    def __init__(
        self,
        pipeline,
        tokenizer,
        n_slots: int,
        n_ctx: int,
        batch_tokens: int = DEFAULT_BATCH_TOKENS,
        speculator: Speculator | None = None,
        mixed_steps: bool | None = None,
        max_queue: int | None = None,
        disaggregator=None,
        overlap: bool | None = None,
        context_shift: ContextShift | None = None,
        counters: Counters | None = None,
    ):
        """`counters`: an earlier engine's, which this one goes on from (a head waking from sleep)."""
        self.pipeline, self.tok, self.n_slots, self.n_ctx = pipeline, tokenizer, n_slots, n_ctx
        self.context_shift = context_shift
        self.max_queue = max_queue  # requests waiting beyond the slots; None = unbounded
        self.stats = counters.stats if counters else EngineStats()
        # Always there: requests may ask for n-gram drafting even when the server default is off.
        self.spec = speculator or Speculator()
        if counters:
            self.spec.stats = counters.spec_stats
        self.spec_stats, self.spec_config = self.spec.stats, self.spec.config
        self.spec.verify_lengths = getattr(pipeline, "graph_run_lengths", None)
        self.grammars = Grammars(tokenizer)  # structured output; its tokenizer is built on first use
        self.runner = ModelRunner(pipeline, n_slots, self.spec, self.grammars)
        self.mixed_steps = mixed_by_default(self.runner.device.type) if mixed_steps is None else mixed_steps
        self.overlap = self.runner.device.type == "cuda" if overlap is None else overlap
        # What a step costs the adaptive draft lengths: with every layer on this process's CPU, its CPU
        # time (a shared machine's wall time mostly measures the neighbours); else wall time (a GPU, peers).
        local_cpu = self.runner.device.type == "cpu" and not getattr(pipeline, "remotes", None)
        self._step_clock = time.process_time if local_cpu else time.perf_counter
        self._in_flight: deque[Launched] = deque()  # launched steps the host has not read yet
        self._overlap_mark: float | None = None  # when the last overlapped step was launched
        self._finish_s = 0.0  # seconds in `_finish`, so a forward's time leaves out the steps finished meanwhile
        self.kv = KVManager.of(pipeline, n_slots)  # the one owner of the slots' KV and recurrent memory
        self.scheduler = Scheduler(
            n_slots,
            n_ctx,
            batch_tokens,
            self.mixed_steps,
            self.spec,
            tokenizer.eog_ids,
            self.kv,
            context_shift,
        )
        self.output = OutputProcessor(tokenizer, self.stats)
        self._cond = threading.Condition()
        self.slot_cache = SlotCache(pipeline, self.scheduler, self.kv, self._cond)
        # P/D: long prompts prefilled on a prefill worker (`disaggregator`: a pd.Disaggregator, or None)
        self.transfers = PromptTransfers(disaggregator, pipeline, self.scheduler, self._cond)
        self._thread: threading.Thread | None = None
        self._stopping = False
        # OpenMP's thread count is per thread: a new thread would start from the library default
        # (every logical CPU) instead of torch's choice in the main thread (physical cores).
        self._n_threads = torch.get_num_threads()

    # ---- consumer side (any thread) --------------------------------------------------------------

    def check(self, n_prompt: int, max_tokens: int) -> None:
        """Reject up front what can never fit a slot (the API answers 400)."""
        check_fits(n_prompt, max_tokens, self.n_ctx)

    def submit(self, req: Request) -> Request:
        return self.submit_together([req])[0]

    def submit_together(self, reqs: list[Request]) -> list[Request]:
        """`reqs` into the queue at once, or none of them (a request's choices): the engine thread
        admits them in one step where slots are free, so identical ones share every step and give
        one text in any configuration."""
        for req in reqs:
            req.check(self.n_ctx, self.tok.vocab_size)
        with self._cond:
            # Waiting + running, not just `waiting`: a request submitted before the engine thread
            # admits the previous ones would otherwise see free slots as queue.
            queued = len(self.scheduler.waiting) + len(self.scheduler.running) - self.n_slots
            if self.max_queue is not None and queued + len(reqs) > self.max_queue:
                self.stats.requests_rejected += len(reqs)
                raise Overloaded(f"{max(queued, 0)} requests already wait for a slot (--max-queue {self.max_queue})")
            for req in reqs:
                self.scheduler.add(req)
            self.stats.requests_total += len(reqs)
            self._cond.notify()
        return reqs

    def cancel(self, req: Request) -> None:
        """Stop `req` now: the engine frees its slot (or drops it from the queue) before its next step."""
        with self._cond:
            req.cancelled = True
            self._cond.notify()

    def generate(self, req: Request, timeout: float | None = None) -> Iterator[Event]:
        """Submit `req` and yield its events in this thread (the CLI's and the tests' path)."""
        events: queue.Queue[Event] = queue.Queue()
        req.sink = events.put
        self.submit(req)
        try:
            while True:
                ev = events.get(timeout=timeout)
                yield ev
                if ev.finish_reason is not None:
                    return
        finally:
            self.cancel(req)

    @property
    def slots(self) -> list[Sequence | None]:
        return self.scheduler.slots

    @property
    def n_processing(self) -> int:
        return len(self.scheduler.running)

    @property
    def n_deferred(self) -> int:
        return len(self.scheduler.waiting)

    def slot_info(self) -> list[dict]:
        return self.slot_cache.info(self.n_ctx)

    # ---- slot save / restore (llama-server's /slots actions; slot_cache.py) ---------------------

    def save_slot(self, slot: int, write) -> tuple[int, int]:
        return self.slot_cache.save(slot, write)

    def restore_slot(self, slot: int, data: bytes) -> int:
        return self.slot_cache.restore(slot, data)

    def erase_slot(self, slot: int) -> int:
        return self.slot_cache.erase(slot)

    def held_state(self, tokens: list[int], collect, wait_s: float = 5.0):
        return self.slot_cache.held(tokens, collect, wait_s)

    # ---- the engine thread ---------------------------------------------------------------------

    def start(self) -> Engine:
        self._thread = threading.Thread(target=self._loop, name="hydra-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self.transfers.stop()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _loop(self) -> None:
        torch.set_num_threads(self._n_threads)
        while True:
            with self._cond:
                while not self._stopping and not self._has_work():
                    self._cond.wait()
                if self._stopping:
                    return
            try:
                self.step()
            except Exception as e:  # a failed forward ends the requests in it, never the engine
                if isinstance(e, Unavailable):  # expected (a peer went away): each request's log line says so
                    log.debug("step failed: %s", describe(e))
                else:
                    log.exception("step failed")
                self._in_flight.clear()
                for seq in self.scheduler.running:
                    if seq.remote_prefill:  # not in the step; its state may be going into its slot
                        continue
                    seq.finish_reason = "error"
                    self.output.process(seq, error=e)
                    self.scheduler.free(seq)

    def _has_work(self) -> bool:
        """Something to admit, cancel or compute (a sequence waiting for its prompt state is not)."""
        running = any(not s.remote_prefill for s in self.scheduler.running)
        return bool(self._in_flight) or bool(self.scheduler.waiting) or running

    def step(self) -> None:
        """admit → schedule → launch (the runner: forward, sampling on the device) → finish the step
        before it (read its tokens, postprocess, emit) while this one runs (while a peer queues its part
        of it); a batch that is not overlappable first finishes what is in flight, then itself."""
        with self._cond:  # submit and cancel touch the queue and the flags from other threads
            cancelled = self.scheduler.admit()
            self.transfers.start()
        overlap = self.overlap and self.scheduler.overlappable()
        back_to_back = overlap and bool(self._in_flight)
        self.stats.overlapped += back_to_back
        if not overlap:
            self._finish_all()
        t0 = self._step_clock()  # the step's drafting (in `schedule`) counts in its cost
        wall = time.perf_counter()
        batch = self.scheduler.schedule()
        self.stats.add_phase("schedule", time.perf_counter() - wall, batch.n_prefill > 0)
        self._in_flight.append(self._launch(batch, cancelled))
        while len(self._in_flight) > overlap:
            self._finish(self._in_flight.popleft())
        now = self._step_clock()
        if not overlap:  # the adaptive draft lengths' cost of this step: scheduled to read
            self.spec.timed(batch.chunks, now - t0)
        elif back_to_back and self._overlap_mark is not None:
            # Overlapped, a step's time hides in the next one's launch; back to back, what each costs is
            # the time between two such points (plain decode on a GPU: else never measured, and the
            # policy guessed it a quarter of a 4-token verify)
            self.spec.timed(batch.chunks, now - self._overlap_mark)
        self._overlap_mark = now if overlap else None

    def _launch(self, batch: Batch, cancelled: list[Sequence]) -> Launched:
        """The runner queues the step; what is in flight is finished once its layers are queued."""
        step = Launched(batch, cancelled, time.perf_counter())
        for seq in batch.shed:  # the KV pool could not hold them beside the others
            self.output.process(seq, error=KVPoolFull(SHED))
        if not batch.chunks:
            self._finish_all()
            return step
        self.scheduler.launched(batch)  # before `_finish_all` frees a slot: its prompt cache counts the token in flight
        wall, finishing = time.perf_counter(), self._finish_s
        self.runner.run(step, meanwhile=self._finish_all)
        # the steps before, finished meanwhile, are theirs
        self.stats.add_phase("forward", time.perf_counter() - wall - (self._finish_s - finishing), batch.n_prefill > 0)
        return step

    def _finish_all(self) -> None:
        while self._in_flight:
            self._finish(self._in_flight.popleft())

    def _finish(self, step: Launched) -> None:
        """Read a launched step's tokens, append them, emit. A sequence that ended (or was cancelled)
        after this step launched is not in it any more: its row is dropped."""
        wall = time.perf_counter()
        sampled = step.read()
        read = time.perf_counter()
        live = [(c, s) for c, s in zip(step.batch.chunks, sampled) if c.seq.finish_reason is None]
        self.scheduler.postprocess(Batch([c for c, _ in live]), [s.tokens for _, s in live])
        self._emit(step, live)
        done = time.perf_counter()
        prompt = step.batch.n_prefill > 0
        self.stats.add_phase("read", read - wall, prompt)
        self.stats.add_phase("emit", done - read, prompt)
        self._finish_s += done - wall

    def _emit(self, step: Launched, live: list[tuple[Chunk, Sampled]]) -> None:
        """Events for every sequence the step touched; finished ones give their slot back."""
        busy = self.scheduler.running  # the slots this step ran with, before any is given back
        for seq in step.cancelled:
            self.output.process(seq)
        for c, s in live:
            self.output.process(c.seq, s)
            if c.seq.finish_reason is not None:
                self.scheduler.free(c.seq)
        if step.batch.chunks:
            n_decode = sum(len(s.tokens) for c, s in live if not c.prefill)
            longest = max((len(s.tokens) for s in busy), default=0)
            self.stats.record_step(step.t0, time.perf_counter(), step.batch.n_prefill, n_decode, len(busy), longest)
