"""The engine loop: a background thread runs `step()` while requests are waiting or running.

nano-vllm's shape: a `Request` comes in (`submit`), the `Scheduler` binds it to a slot as a
`Sequence` and builds each step's `Batch`; the engine runs that batch through one
`Pipeline.forward`, samples on the device (verifying speculative drafts), lets the scheduler append
the tokens, and the `OutputProcessor` turns them into `Event`s for each request's `sink` (a callable
the consumer supplies; the API bridges it into asyncio). A failed step ends the requests in it with
the exception as `Event.error`, never the engine.

Overlap (vLLM's and SGLang's overlap scheduling; on by default on a GPU, `--no-overlap` turns it
off): a plain decoding batch launches before the host reads the previous step's tokens. Its inputs
are those tokens where they already are (`_last`, each slot's latest sample, on the device), and
while it runs the host copies the previous step's tokens through page-locked memory and does the
detokenizing, stop strings, events and metrics, as soon as the new step's layers are queued: with a
split this fills the time a peer takes to queue its part (`Pipeline.forward`'s `meanwhile`). A
sequence that ended at step n was already in step n+1: that row's output is dropped. The row ran the sequence's last token, so the KV (or recurrent
state) it wrote is that token's own, and the slot's prompt cache counts it. Batches that need a
host decision before they launch take the synchronous path: prefill chunks, speculative
verification, grammar-constrained rows, embeddings, P/D transfers (`Scheduler.overlappable`). On a
CPU the forward runs in this thread anyway, so there is nothing to overlap and it stays off unless
asked for.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
import torch

from ...contracts.slot_state import SlotStateError
from ..config import DEFAULT_BATCH_TOKENS
from ..device import to_device
from ..errors import ContextOverflow, KVPoolFull, Overloaded, Unavailable, UserError, describe
from ..spec import Speculator
from ..text.structured import Grammars, apply_bitmask
from .output import OutputProcessor
from .sampling import PENDING, InvalidParam, Picks, Rows, TokenLogprob, logprobs, sample, token_logprobs
from .scheduler import Batch, Chunk, Sampled, Scheduler
from .sequence import Event, Request, Sequence

RATE_WINDOW_S = 10.0
LATENCY_WINDOW_S = 60.0  # requests/s and the latency percentiles in /status
LATENCY_SAMPLES = 4096
SLOT_INDEXES_KEPT = 256  # batches of slots whose device index is kept (`_slot_index`)
log = logging.getLogger("hydra.engine")


@functools.lru_cache(maxsize=SLOT_INDEXES_KEPT)
def _slot_index(slots: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """`slots` on the device, read only, kept per batch of slots: consecutive decode steps run the
    same ones, and a fresh copy each step cost the host more than launching the step's graph."""
    return to_device(torch.tensor(slots, dtype=torch.long), device)


class EngineStats:
    """Monotonic totals (llama-server semantics: a request adds its prompt tokens/time when its prompt
    is done, its predicted tokens/time when it ends) and a recent window of steps for rates."""

    def __init__(self):
        self.lock = threading.Lock()
        self.prompt_tokens = 0  # computed; a reused prefix (prompt cache) counts in prompt_tokens_cached
        self.prompt_tokens_cached = 0
        self.prompt_seconds = 0.0
        self.predicted_tokens = 0
        self.predicted_seconds = 0.0
        self.requests_total = 0
        self.requests_rejected = 0
        self.steps = 0
        self.overlapped = 0  # steps launched before the host read the one before
        self.busy_slots = 0  # summed over steps: / steps = llama-server's n_busy_slots_per_decode
        self.n_tokens_max = 0  # the longest sequence a slot has held (prompt + generated)
        self._recent: deque[tuple[float, float, int, int]] = deque()  # (start, end, prefill, decode)
        # (time, ms) samples for the latency percentiles, and finish times for requests/s.
        self._ttft: deque[tuple[float, float]] = deque(maxlen=LATENCY_SAMPLES)
        self._itl: deque[tuple[float, float]] = deque(maxlen=LATENCY_SAMPLES)
        self._done: deque[float] = deque(maxlen=LATENCY_SAMPLES)

    def add_prompt(self, n: int, seconds: float, cached: int = 0) -> None:
        with self.lock:
            self.prompt_tokens += n
            self.prompt_tokens_cached += cached
            self.prompt_seconds += seconds

    def add_predicted(self, n: int, seconds: float) -> None:
        with self.lock:
            self.predicted_tokens += n
            self.predicted_seconds += seconds

    def add_first_token(self, now: float, seconds: float) -> None:
        """A request's first token, `seconds` after it arrived (its wait for a slot included)."""
        with self.lock:
            self._ttft.append((now, seconds * 1e3))

    def add_tokens(self, now: float, seconds: float, n: int) -> None:
        """`n` tokens of one request came `seconds` after its previous ones (a verified draft brings several)."""
        with self.lock:
            self._itl.extend([(now, seconds * 1e3 / n)] * n)

    def add_finished(self, now: float) -> None:
        with self.lock:
            self._done.append(now)

    def latency(self) -> dict:
        """requests/s and p50/p99 TTFT and inter-token latency over the last LATENCY_WINDOW_S."""
        now = time.perf_counter()
        since = now - LATENCY_WINDOW_S
        with self.lock:
            ttft = [ms for t, ms in self._ttft if t >= since]
            itl = [ms for t, ms in self._itl if t >= since]
            done = sum(1 for t in self._done if t >= since)
        out = {"requests_per_s": round(done / LATENCY_WINDOW_S, 3)}
        for name, xs in (("ttft", ttft), ("itl", itl)):
            p50, p99 = np.percentile(xs, [50, 99]).tolist() if xs else (None, None)
            out[f"{name}_p50_ms"] = round(p50, 2) if p50 is not None else None
            out[f"{name}_p99_ms"] = round(p99, 2) if p99 is not None else None
        return out

    def record_step(
        self, start: float, end: float, n_prefill: int, n_decode: int, n_busy: int = 0, n_tokens: int = 0
    ) -> None:
        """One forward: its token counts, the slots busy during it and the longest sequence among them."""
        with self.lock:
            self.steps += 1
            self.busy_slots += n_busy
            self.n_tokens_max = max(self.n_tokens_max, n_tokens)
            self._recent.append((start, end, n_prefill, n_decode))
            self._trim(end)

    def _trim(self, now: float) -> None:
        while self._recent and self._recent[0][1] < now - RATE_WINDOW_S:
            self._recent.popleft()

    def rates(self) -> tuple[float, float]:
        """(prefill tok/s, decode tok/s) over the last RATE_WINDOW_S seconds of wall time."""
        now = time.perf_counter()
        with self.lock:
            self._trim(now)
            if not self._recent:
                return 0.0, 0.0
            span = max(now - self._recent[0][0], 1e-6)
            return sum(r[2] for r in self._recent) / span, sum(r[3] for r in self._recent) / span


@dataclass
class Launched:
    """A step on its way: its batch, what the host already has per chunk (verified drafts, prompt
    logprobs), and the device's sampled tokens (`picks`, row j for chunk `rows[j]`)."""

    batch: Batch
    cancelled: list[Sequence]
    t0: float
    sampled: list[Sampled] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    picks: Picks | None = None


class Engine:
    """Continuous batching over `n_slots` slots of `n_ctx` tokens each, driving `pipeline.forward`.
    `overlap`: launch plain decoding steps before reading the previous one (None: on a GPU)."""

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
    ):
        self.pipeline = pipeline
        self.n_slots = n_slots
        self.max_queue = max_queue  # requests waiting beyond the slots; None = unbounded
        self.tok = tokenizer
        self.n_ctx = n_ctx
        # Whether prefill chunks ride along with the decoding slots' tokens in one forward (True) or
        # a step with prefill work runs only prefill (False, nano-vllm's way). Measured with
        # benchmarks/bench_api.py --scheduling (4 streams decoding, a 512-token prompt arrives):
        # on an H200 (1.1B llama) prefill-only wins everything — TTFT 154 vs 526 ms, longest decode
        # stall 155 vs 201 ms, 477 vs 288 tok/s — since a mixed step loses the CUDA-graph decode
        # path; on CPU (Gemma 3 270M, 2 cores) mixing halves the decoders' longest stall (290-384
        # vs 642-669 ms) at a similar TTFT (636-857 vs 607-632 ms) and throughput (43-53 vs 44-48
        # tok/s). Default (None): mixed off CUDA.
        self.device = torch.device(getattr(pipeline.local, "device", "cpu"))
        if mixed_steps is None:
            mixed_steps = self.device.type != "cuda"
        self.mixed_steps = mixed_steps
        self.overlap = self.device.type == "cuda" if overlap is None else overlap
        self._in_flight: deque[Launched] = deque()  # launched steps the host has not read yet
        self._last = torch.zeros(n_slots, dtype=torch.long, device=self.device)  # each slot's latest sampled token
        self.stats = EngineStats()
        # Always there: requests may ask for n-gram drafting even when the server default is off.
        self.spec = speculator or Speculator()
        self.spec_stats = self.spec.stats
        self.spec_config = self.spec.config
        if hasattr(pipeline, "side_state"):  # the MTP block's per-slot state moves with the slot's
            pipeline.side_state = self.spec.mtp
        self.scheduler = Scheduler(
            n_slots,
            n_ctx,
            batch_tokens,
            mixed_steps,
            self.spec,
            tokenizer.eog_ids,
            lambda: getattr(pipeline, "kv_generation", 0),
            recurrent=getattr(getattr(pipeline, "cfg", None), "recurrent", False),
            kv_fits=getattr(pipeline, "kv_fits", lambda ends: True),
        )
        self.output = OutputProcessor(tokenizer, self.stats)
        self.pd = disaggregator  # pd.Disaggregator: long prompts prefilled on a prefill worker
        self.grammars = Grammars(tokenizer)  # structured output; its tokenizer is built on first use
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        # OpenMP's thread count is per thread: a new thread would start from the library default
        # (every logical CPU) instead of torch's choice in the main thread (physical cores).
        self._n_threads = torch.get_num_threads()

    # ---- consumer side (any thread) --------------------------------------------------------------

    def check(self, n_prompt: int, max_tokens: int) -> None:
        """Reject up front what can never fit a slot (the API answers 400)."""
        if n_prompt == 0:
            raise InvalidParam("the prompt is empty", "prompt")
        if max_tokens < 0:
            raise InvalidParam(f"max_tokens must be >= 0, got {max_tokens}", "max_tokens")
        if n_prompt >= self.n_ctx:
            raise ContextOverflow(n_prompt, self.n_ctx)
        if n_prompt + max_tokens > self.n_ctx:
            raise InvalidParam(
                f"the prompt ({n_prompt} tokens) plus max_tokens ({max_tokens}) exceeds the context "
                f"of {self.n_ctx} tokens",
                "max_tokens",
            )

    def submit(self, req: Request) -> Request:
        vocab = self.tok.vocab_size
        bad = next((t for t in req.prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidParam(f"token id {bad} is outside the vocabulary of {vocab} tokens", "prompt")
        self.check(len(req.prompt), req.max_tokens)
        with self._cond:
            # Waiting + running, not just `waiting`: a request submitted before the engine thread
            # admits the previous ones would otherwise see free slots as queue.
            queued = len(self.scheduler.waiting) + len(self.scheduler.running) - self.n_slots
            if self.max_queue is not None and queued >= self.max_queue:
                self.stats.requests_rejected += 1
                raise Overloaded(f"{max(queued, 0)} requests already wait for a slot (--max-queue {self.max_queue})")
            self.scheduler.add(req)
            self.stats.requests_total += 1
            self._cond.notify()
        return req

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
        out = []
        for i, seq in enumerate(self.slots):
            info = {
                "id": i,
                "state": "idle" if seq is None else "processing",
                "n_ctx": self.n_ctx,
                "n_past": 0 if seq is None else seq.n_past,
            }
            if seq is not None:
                info.update(id_task=seq.req.id, n_prompt_tokens=seq.n_prompt, n_decoded=seq.n_gen)
            out.append(info)
        return out

    # ---- slot save / restore (llama-server's /slots actions) -----------------------------------

    def save_slot(self, slot: int, write) -> tuple[int, int]:
        """(tokens, bytes) of the prompt cache an idle slot holds, written through `write`."""
        with self._cond:  # the slot stays idle: admit waits for this lock
            self._idle(slot)
            tokens = list(self.scheduler.cached[slot])
            return len(tokens), self.pipeline.save_slot(slot, tokens, write)

    def restore_slot(self, slot: int, data: bytes) -> int:
        """Load a saved state into an idle slot; its tokens become that slot's prompt cache. A
        refused state leaves the slot's cache as it was; a placement that failed midway empties it."""
        prepared = self.pipeline.prepare_state(data)  # checksums off the engine lock: decoding goes on
        with self._cond:
            self._idle(slot)
            try:
                self.scheduler.cached[slot] = self.pipeline.place_state(slot, prepared)
            except SlotStateError:
                raise
            except Exception:
                self.scheduler.cached[slot] = []
                raise
            return len(self.scheduler.cached[slot])

    def erase_slot(self, slot: int) -> int:
        with self._cond:
            self._idle(slot)
            n, self.scheduler.cached[slot] = len(self.scheduler.cached[slot]), []
            return n

    def held_state(self, tokens: list[int], collect, wait_s: float = 5.0):
        """`collect(slot, tokens)` for the idle slot whose prompt cache is exactly `tokens` (a
        request that just finished), under the engine lock so no request takes the slot meanwhile;
        None when no slot holds them (a finished request frees its slot just after its last event)."""
        deadline = time.monotonic() + wait_s
        with self._cond:
            while True:
                for i, cached in enumerate(self.scheduler.cached):
                    if self.scheduler.slots[i] is None and cached == tokens:
                        return collect(i, tokens)
                if time.monotonic() > deadline:
                    return None
                self._cond.wait(0.001)

    # ---- prefill/decode disaggregation (pd.py) ---------------------------------------------------

    def _start_transfers(self) -> None:
        """Newly admitted sequences with a long prompt fetch its state from the prefill worker."""
        for seq in self.scheduler.running:
            if seq.transfer is None and not seq.remote_prefill and seq.n_gen == 0 and self.pd.wants(seq):
                seq.remote_prefill = True
                self.pd.start(
                    seq,
                    lambda payload, tokens, seq=seq: self._place(seq, payload, tokens),
                    lambda transfer, seq=seq: self._transferred(seq, transfer),
                )

    def _place(self, seq: Sequence, payload: list, tokens: list[int]) -> None:
        """On the transfer's thread, holding no engine lock: decoding goes on while the state is
        checked and copied in. The slot stays this sequence's until `_transferred` (the scheduler
        frees no sequence whose state is in flight)."""
        prepared = self.pipeline.prepare_state(payload, tokens)
        with self._cond:
            if self.scheduler.slots[seq.slot] is not seq or seq.req.cancelled:
                raise UserError("the request left its slot during the transfer")
        self.pipeline.place_state(seq.slot, prepared)
        with self._cond:
            seq.n_past = len(tokens)

    def _transferred(self, seq: Sequence, transfer) -> None:
        with self._cond:
            seq.transfer, seq.remote_prefill = transfer, False
            if transfer.fallback is not None:  # prefill here from the start: a half-placed slot is never read
                seq.n_past = seq.n_cached = 0
            self._cond.notify()

    def _idle(self, slot: int) -> None:
        if not 0 <= slot < len(self.scheduler.slots):
            raise UserError(f"slot {slot} does not exist ({len(self.scheduler.slots)} slots)")
        if self.scheduler.slots[slot] is not None:
            raise UserError(f"slot {slot} is processing a request")

    # ---- the engine thread ---------------------------------------------------------------------

    def start(self) -> Engine:
        self._thread = threading.Thread(target=self._loop, name="hydra-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self.pd is not None:
            self.pd.stop()
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
        return (
            bool(self._in_flight)
            or bool(self.scheduler.waiting)
            or any(not s.remote_prefill for s in self.scheduler.running)
        )

    def step(self) -> None:
        """admit → schedule → launch (forward, sampling on the device) → finish the step before it (read
        its tokens, postprocess, emit) while this one runs (while a peer queues its part of it); a batch
        that is not overlappable first finishes what is in flight, then itself."""
        cancelled = self._admit()
        overlap = self.overlap and self.scheduler.overlappable()
        self.stats.overlapped += overlap and bool(self._in_flight)
        if not overlap:
            self._finish_all()
        self._in_flight.append(self._launch(self.scheduler.schedule(), cancelled, meanwhile=self._finish_all))
        while len(self._in_flight) > overlap:
            self._finish(self._in_flight.popleft())

    def _admit(self) -> list[Sequence]:
        with self._cond:  # submit and cancel touch the queue and the flags from other threads
            cancelled = self.scheduler.admit()
            if self.pd is not None:
                self._start_transfers()
        return cancelled

    def _launch(self, batch: Batch, cancelled: list[Sequence], meanwhile=None) -> Launched:
        """Forward and sampling queued on the device; the sampled tokens start their copy to the host.
        `meanwhile` runs once the layers are queued (`Pipeline.forward`), before the sampling."""
        step = Launched(batch, cancelled, time.perf_counter(), [Sampled() for _ in batch.chunks])
        for seq in batch.shed:  # the KV pool could not hold them beside the others
            full = KVPoolFull(
                "KV pool full: the context size has been exceeded, this request does not fit beside the "
                "others (-c/--ctx-size sets the pool with --kv-unified)"
            )
            self.output.process(seq, error=full)
        if not batch.chunks:
            if meanwhile is not None:
                meanwhile()
            return step
        self.scheduler.launched(batch)  # before `meanwhile` frees a slot: its prompt cache counts the token in flight
        logits, hidden = self._forward(batch, meanwhile)
        self._sample(batch, logits, step)
        self._keep_hidden(batch, hidden)
        return step

    def _finish_all(self) -> None:
        while self._in_flight:
            self._finish(self._in_flight.popleft())

    def _finish(self, step: Launched) -> None:
        """Read a launched step's tokens, append them, emit. A sequence that ended (or was cancelled)
        after this step launched is not in it any more: its row is dropped."""
        if step.picks is not None:
            for i, tid, lp in zip(step.rows, *step.picks.read()):
                step.sampled[i].tokens, step.sampled[i].logprobs = [tid], [lp]
        live = [(c, s) for c, s in zip(step.batch.chunks, step.sampled) if c.seq.finish_reason is None]
        self.scheduler.postprocess(Batch([c for c, _ in live]), [s.tokens for _, s in live])
        self._emit(step, live)

    def _forward(self, batch: Batch, meanwhile=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits, the embedding chunks' hidden states or None). Inputs the host has not read yet
        (PENDING) are each slot's latest sampled token, taken on the device."""
        ids, slot_ids, pos, rows = batch.inputs()
        slots, positions = torch.tensor(slot_ids, dtype=torch.long), torch.tensor(pos, dtype=torch.long)
        rows = None if len(rows) == len(ids) else torch.tensor(rows, dtype=torch.long)  # decode: no gather
        if PENDING not in ids:
            tokens = torch.tensor(ids, dtype=torch.long)
        else:  # a plain decode step builds nothing on the host: every input is on the device already
            tokens = self._last[_slot_index(tuple(slot_ids), self.device)]
            if ids.count(PENDING) < len(ids):  # a mixed batch: the known inputs replace theirs
                known = to_device(torch.tensor(ids, dtype=torch.long), self.device)
                tokens = torch.where(known == PENDING, tokens, known)
        hidden_rows = batch.hidden_rows()
        if not (self.spec.wants_hidden or hidden_rows):
            return self.pipeline.forward(tokens, slots, positions, rows, meanwhile=meanwhile), None
        logits, hidden = self.pipeline.forward(tokens, slots, positions, rows, hidden=True, meanwhile=meanwhile)
        if self.spec.wants_hidden:
            self.spec.observe(tokens, slots, positions, hidden)  # the MTP block follows every token the target ran
        return logits, hidden[torch.tensor(hidden_rows).to(hidden.device)] if hidden_rows else None

    @staticmethod
    def _keep_hidden(batch: Batch, hidden: torch.Tensor | None) -> None:
        """Each embedding chunk's rows go to its sequence (the output processor sends them whole)."""
        if hidden is None:
            return
        hidden, row = hidden.cpu(), 0
        for c in batch.chunks:
            if c.hidden:
                n = c.end - c.start
                c.seq.hidden.append(hidden[row : row + n])
                row += n

    def _sample(self, batch: Batch, logits: torch.Tensor, step: Launched) -> None:
        """Per chunk: the verified draft and the target's next token (on the host), or one token
        sampled on the device (`step.picks`), or none (a prompt chunk before the last); a scored chunk
        also gets its prompt logprobs."""
        to_sample: list[tuple[int, int]] = []  # (chunk index, its logits row)
        row = 0
        for i, c in enumerate(batch.chunks):
            if c.draft:
                rows = logits[row : row + len(c.draft) + 1]
                tids = self.spec.verify(self._draft_mask(rows, c), c.draft, c.seq.sampler, c.seq.tokens)
                step.sampled[i] = Sampled(tids, self._draft_logprobs(c.seq, rows, tids))
                row += len(c.draft) + 1
            elif c.score:
                n = c.end - c.start
                step.sampled[i].prompt_logprobs = self._score_prompt(c, logits[row : row + n])
                row += n
                if c.sample:
                    to_sample.append((i, row - 1))
            elif c.sample:
                to_sample.append((i, row))
                row += 1
        if not to_sample:
            return
        seqs = [batch.chunks[i].seq for i, _ in to_sample]
        ends = [batch.chunks[i].end for i, _ in to_sample]
        idx = [r for _, r in to_sample]
        rows = logits if idx == list(range(logits.shape[0])) else logits[idx]  # decode-only steps: no copy
        slots = _slot_index(tuple(s.slot for s in seqs), self.device)
        in_flight = any(e > len(s.tokens) for s, e in zip(seqs, ends))  # a penalty window ends on a PENDING token
        picked = Rows.build(
            [s.sampler for s in seqs],
            [s.tokens for s in seqs],
            rows.device,
            ends,
            self._last[slots] if in_flight else None,
        )
        step.picks = sample(rows, picked, self._mask(seqs)).copy()
        self._last[slots] = step.picks.tokens  # the next step's input, should it launch before this one is read
        step.rows = [i for i, _ in to_sample]

    @staticmethod
    def _draft_logprobs(seq: Sequence, rows: torch.Tensor, tids: list[int]) -> list[TokenLogprob | None]:
        """Row j's logprob of `tids[j]` and its top alternatives (row j follows the tokens so far and
        the j accepted draft tokens before it), when the request asked for them."""
        if seq.req.params.logprobs is None:
            return [None] * len(tids)
        n = len(tids)
        picked = Rows.build([seq.sampler] * n, [seq.tokens + tids[:j] for j in range(n)], rows.device)
        return logprobs(rows[:n], picked, tids)

    def _mask(self, seqs: list[Sequence]):
        """The grammar mask of the constrained rows among `seqs` (None when there are none), applied
        after the logit bias; the raw rows stay for the logprobs. Others' rows pay nothing."""
        constrained = [i for i, s in enumerate(seqs) if s.req.constraint is not None]
        if not constrained:
            return None
        bitmask = self.grammars.bitmask(
            [seqs[i].req.constraint for i in constrained], pinned=self.device.type == "cuda"
        )

        def mask(x: torch.Tensor) -> torch.Tensor:
            if len(constrained) == len(seqs):
                return apply_bitmask(x, bitmask)
            idx = torch.tensor(constrained, device=x.device)
            return x.index_copy(0, idx, apply_bitmask(x[idx], bitmask))

        return mask

    def _draft_mask(self, rows: torch.Tensor, c: Chunk) -> torch.Tensor:
        """A draft's k+1 verified rows with, row by row, the grammar's mask after the draft tokens
        before that row: a draft the grammar refuses is rejected there (the logit bias comes in the
        sampler: a ban and a mask commute)."""
        constraint = c.seq.req.constraint
        if constraint is None:
            return rows
        mask = torch.empty((rows.shape[0], self.grammars.words), dtype=torch.int32, pin_memory=rows.is_cuda)
        constraint.draft_bitmask(c.draft.tokens, mask)
        return apply_bitmask(rows, mask)

    @staticmethod
    def _score_prompt(c: Chunk, logits: torch.Tensor) -> list[TokenLogprob]:
        """Row p predicts token p+1: the logprobs of the prompt tokens this chunk's rows predict."""
        seq = c.seq
        targets = seq.tokens[c.start + 1 : min(c.end + 1, seq.n_prompt)]
        out = token_logprobs(logits[: len(targets)], targets, seq.req.prompt_logprobs)
        if c.start == 0:
            out.insert(0, TokenLogprob(seq.tokens[0], None, []))
        return out

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
            self.stats.record_step(
                step.t0,
                time.perf_counter(),
                step.batch.n_prefill,
                n_decode,
                len(busy),
                max((len(s.tokens) for s in busy), default=0),
            )
