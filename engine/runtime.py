"""The engine: slots, a scheduler that batches every active slot into one forward per step, stop
conditions, per-request timings and the counters behind /metrics and /status.

nano-vllm's shape: a `Request` comes in, becomes a `Sequence` bound to a slot (its KV rows), and a
background thread runs `step()` until nothing is left. A step flattens the next prompt chunks
of the sequences still prefilling or, when none is, the last sampled token of every decoding
sequence (`mixed_steps` puts both in one step) into one `Pipeline.forward`, samples the
sequences whose prompt is done, and hands results to each
request's `sink` (a callable the consumer supplies; the API bridges it into asyncio). Requests
beyond the slots wait in FIFO order.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from .sampling import InvalidParam, Sampler, SamplingParams, TokenLogprob, sample_batch, token_logprobs
from .speculative import Draft, SpecConfig, Speculator
from .tokenizer import StreamDecoder

# Prefill tokens per step across all sequences: bounds how long a long prompt stalls decoders.
DEFAULT_BATCH_TOKENS = 256
# Prompt-scoring chunks are smaller: each row brings a full-vocabulary logits row.
SCORING_CHUNK = 64
RATE_WINDOW_S = 10.0


@dataclass
class GenToken:
    """A generated token released to the consumer: its id, its text piece, its logprobs if asked."""

    id: int
    text: str
    logprob: TokenLogprob | None = None


@dataclass
class Event:
    """What a request's sink receives: text and tokens as they are released; on the last event
    `finish_reason` ("stop", "length", "cancelled", "error"), `usage`, `timings` (and `error`)."""

    text: str = ""
    tokens: list[GenToken] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    usage: dict | None = None
    timings: dict | None = None
    error: str | None = None


@dataclass
class Request:
    prompt: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    prompt_logprobs: int | None = None  # score the prompt: logprob of each prompt token + top N
    spec: SpecConfig | None = None  # this request's speculative decoding; None: the engine's default
    sink: Callable[[Event], None] = lambda ev: None
    id: int = 0
    cancelled: bool = False


class Sequence:
    """A request bound to a slot: its tokens, how many of them are in the KV cache, its output state."""

    def __init__(self, req: Request, slot: int, tok):
        self.req = req
        self.slot = slot
        self.tokens = list(req.prompt)
        self.n_prompt = len(req.prompt)
        self.n_past = 0  # tokens whose KV is written
        self.n_gen = 0
        self.sampler = Sampler(req.params)
        self.decoder = StreamDecoder(tok)
        self.held_text = ""  # text that may still turn out to start a stop string
        self.held_tokens: list[GenToken] = []
        self.emitted_in_held = 0  # chars of the first held tokens' text already passed on
        self.t_start = time.perf_counter()
        self.t_first: float | None = None
        self.n_drafted = 0  # draft tokens verified for this request, and how many were accepted
        self.n_accepted = 0

    @property
    def prefilling(self) -> bool:
        return self.n_past < self.n_prompt

    def timings(self, now: float) -> dict:
        t_first = self.t_first if self.t_first is not None else now
        prompt_ms = (t_first - self.t_start) * 1e3
        predicted_ms = (now - t_first) * 1e3
        return {
            "prompt_n": self.n_prompt,
            "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / self.n_prompt if self.n_prompt else 0.0,
            "prompt_per_second": self.n_prompt / prompt_ms * 1e3 if prompt_ms > 0 else 0.0,
            "predicted_n": self.n_gen,
            "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / self.n_gen if self.n_gen else 0.0,
            "predicted_per_second": self.n_gen / predicted_ms * 1e3 if predicted_ms > 0 else 0.0,
            "draft_n": self.n_drafted,
            "draft_n_accepted": self.n_accepted,
        }


@dataclass
class _Work:
    """One sequence's share of a step: tokens [start, end) of `seq.tokens`, and whether the step
    samples its next token (its last row's logits)."""

    seq: Sequence
    start: int
    end: int
    sample: bool
    score: bool  # prompt scoring: logits of every row
    draft: Draft | None = None  # decode: tokens proposed after seq.tokens[start], verified in this step


class EngineStats:
    """Monotonic totals (llama-server semantics: a request adds its prompt tokens/time when its prompt
    is done, its predicted tokens/time when it ends) and a recent window of steps for rates."""

    def __init__(self):
        self.lock = threading.Lock()
        self.prompt_tokens = 0
        self.prompt_seconds = 0.0
        self.predicted_tokens = 0
        self.predicted_seconds = 0.0
        self.requests_total = 0
        self.requests_rejected = 0
        self.steps = 0
        self._recent: deque[tuple[float, float, int, int]] = deque()  # (start, end, prefill, decode)

    def record_step(self, start: float, end: float, n_prefill: int, n_decode: int) -> None:
        with self.lock:
            self.steps += 1
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


class Engine:
    """Continuous batching over `n_slots` slots of `n_ctx` tokens each, driving `pipeline.forward`."""

    def __init__(self, pipeline, tokenizer, n_slots: int, n_ctx: int, batch_tokens: int = DEFAULT_BATCH_TOKENS,
                 speculator: Speculator | None = None, mixed_steps: bool | None = None):  # fmt: skip
        self.pipeline = pipeline
        self.tok = tokenizer
        self.n_slots = n_slots
        self.n_ctx = n_ctx
        self.batch_tokens = batch_tokens
        # Whether prefill chunks ride along with the decoding slots' tokens in one forward (True) or
        # a step with prefill work runs only prefill (False, nano-vllm's way). Measured with
        # benchmarks/bench_api.py --scheduling (4 streams decoding, a 512-token prompt arrives):
        # on an H200 (1.1B llama) prefill-only wins everything — TTFT 154 vs 526 ms, longest decode
        # stall 155 vs 201 ms, 477 vs 288 tok/s — since a mixed step loses the CUDA-graph decode
        # path; on CPU (Gemma 3 270M, 2 cores) mixing halves the decoders' longest stall (290-384
        # vs 642-669 ms) at a similar TTFT (636-857 vs 607-632 ms) and throughput (43-53 vs 44-48
        # tok/s). Default (None): mixed off CUDA.
        if mixed_steps is None:
            mixed_steps = getattr(getattr(pipeline.head, "device", None), "type", "cpu") != "cuda"
        self.mixed_steps = mixed_steps
        self.stats = EngineStats()
        # Always there: requests may ask for n-gram drafting even when the server default is off.
        self.spec = speculator or Speculator()
        self.spec_stats = self.spec.stats
        self.spec_config = self.spec.config
        self.slots: list[Sequence | None] = [None] * n_slots
        self.waiting: deque[Request] = deque()
        self._cond = threading.Condition()
        self._next_id = 0
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
        if n_prompt + max_tokens > self.n_ctx:
            raise InvalidParam(
                f"the prompt ({n_prompt} tokens) plus max_tokens ({max_tokens}) exceeds the context "
                f"of {self.n_ctx} tokens",
                "max_tokens" if n_prompt < self.n_ctx else "prompt",
            )

    def submit(self, req: Request) -> Request:
        vocab = self.tok.vocab_size
        bad = next((t for t in req.prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidParam(f"token id {bad} is outside the vocabulary of {vocab} tokens", "prompt")
        self.check(len(req.prompt), req.max_tokens)
        with self._cond:
            self._next_id += 1
            req.id = self._next_id
            self.waiting.append(req)
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
    def n_processing(self) -> int:
        return sum(s is not None for s in self.slots)

    @property
    def n_deferred(self) -> int:
        return len(self.waiting)

    def slot_info(self) -> list[dict]:
        out = []
        for i, seq in enumerate(self.slots):
            info = {"id": i, "state": "idle" if seq is None else "processing", "n_ctx": self.n_ctx,
                    "n_past": 0 if seq is None else seq.n_past}  # fmt: skip
            if seq is not None:
                info.update(id_task=seq.req.id, n_prompt_tokens=seq.n_prompt, n_decoded=seq.n_gen)
            out.append(info)
        return out

    # ---- the engine thread ---------------------------------------------------------------------

    def start(self) -> Engine:
        self._thread = threading.Thread(target=self._loop, name="hydra-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _loop(self) -> None:
        torch.set_num_threads(self._n_threads)
        while True:
            with self._cond:
                while not self._stopping and not self.waiting and self.n_processing == 0:
                    self._cond.wait()
                if self._stopping:
                    return
            try:
                self.step()
            except Exception as e:  # a failed forward ends the requests in it, never the engine
                traceback.print_exc(file=sys.stderr)
                for seq in self.slots:
                    if seq is not None:
                        self._finish(seq, "error", error=f"{type(e).__name__}: {e}")

    def step(self) -> None:
        """Admit, schedule, one forward, sample, deliver."""
        self._admit()
        work = self._schedule()
        if not work:
            return
        t0 = time.perf_counter()
        tokens, slots, positions, rows = [], [], [], []
        for w in work:
            drafted = w.draft.tokens if w.draft else []
            n = w.end - w.start + len(drafted)
            first_row = len(tokens)
            tokens += w.seq.tokens[w.start : w.end] + drafted
            slots += [w.seq.slot] * n
            positions += range(w.start, w.start + n)
            if w.score or drafted:
                rows += range(first_row, first_row + n)
            elif w.sample:
                rows.append(first_row + n - 1)
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731  (stages move what they need)
        logits = self.pipeline.forward(as_tensor(tokens), as_tensor(slots), as_tensor(positions), as_tensor(rows))
        n_accepted = self._apply(work, logits)
        n_prefill = sum(w.end - w.start for w in work if w.start < w.seq.n_prompt)
        n_decode = sum(w.end - w.start for w in work) - n_prefill + n_accepted
        self.stats.record_step(t0, time.perf_counter(), n_prefill, n_decode)

    def _admit(self) -> None:
        with self._cond:
            for i, seq in enumerate(self.slots):
                if seq is not None and seq.req.cancelled:
                    self._finish(seq, "cancelled")
            if any(r.cancelled for r in self.waiting):
                self.waiting = deque(r for r in self.waiting if not r.cancelled)
            for i in range(self.n_slots):
                if self.slots[i] is None and self.waiting:
                    # KV rows of a reused slot need no clearing: positions >= n_past are overwritten.
                    self.slots[i] = Sequence(self.waiting.popleft(), i, self.tok)
                    self.spec.start(i, self.slots[i].tokens)

    def _schedule(self) -> list[_Work]:
        """Decoding sequences take one token each (unless prefill runs alone); prefill chunks share
        what is left of the token budget, oldest request first."""
        running = [s for s in self.slots if s is not None]
        decoding = [s for s in running if not s.prefilling]
        if not self.mixed_steps and len(decoding) < len(running):
            decoding = []
        drafts = self.spec.plan(decoding, self.n_ctx)
        work = [_Work(s, s.n_past, s.n_past + 1, True, False, d) for s, d in zip(decoding, drafts)]
        budget = max(self.batch_tokens - len(work) - sum(len(d) for d in drafts if d), 1)
        for s in sorted((s for s in running if s.prefilling), key=lambda s: s.req.id):
            if budget <= 0:
                break
            score = s.req.prompt_logprobs is not None
            n = min(s.n_prompt - s.n_past, budget, SCORING_CHUNK if score else budget)
            end = s.n_past + n
            work.append(_Work(s, s.n_past, end, end == s.n_prompt and s.req.max_tokens > 0, score))
            budget -= n
        return work

    def _apply(self, work: list[_Work], logits: torch.Tensor) -> int:
        """Sample, verify drafts, deliver; returns how many accepted draft tokens were released."""
        row = 0
        n_accepted = 0
        to_sample: list[tuple[Sequence, int]] = []  # (sequence, its logits row)
        for w in work:
            seq = w.seq
            seq.n_past = w.end
            if w.draft:
                k = len(w.draft)
                n_accepted += self._apply_draft(seq, w.draft, logits[row : row + k + 1])
                row += k + 1
            elif w.score:
                n = w.end - w.start
                self._score_prompt(w, logits[row : row + n])
                row += n
                if w.sample:
                    to_sample.append((seq, row - 1))
            elif w.sample:
                to_sample.append((seq, row))
                row += 1
            if not seq.prefilling and seq.t_first is None:
                seq.t_first = time.perf_counter()
                with self.stats.lock:
                    self.stats.prompt_tokens += seq.n_prompt
                    self.stats.prompt_seconds += seq.t_first - seq.t_start
                if seq.req.max_tokens == 0:
                    self._finish(seq, "length")
        if not to_sample:
            return n_accepted
        seqs = [s for s, _ in to_sample]
        idx = [r for _, r in to_sample]
        rows = logits if idx == list(range(logits.shape[0])) else logits[idx]  # decode-only steps: no copy
        picks = sample_batch(rows, [s.sampler for s in seqs], [s.tokens for s in seqs])
        for i, (seq, tid) in enumerate(zip(seqs, picks)):
            n_top = seq.req.params.logprobs
            lp = token_logprobs(rows[i : i + 1], [tid], n_top)[0] if n_top is not None else None
            self._append(seq, tid, lp)
        return n_accepted

    def _apply_draft(self, seq: Sequence, draft: Draft, logits: torch.Tensor) -> int:
        """Emit the verified prefix of `draft` and the target's next token. Rejected draft positions
        stay behind n_past: their KV (here and on peers) is overwritten by the next step."""
        emitted = self.spec.verify(logits, draft, seq.sampler, seq.tokens)
        accepted = len(emitted) - 1
        seq.n_past += accepted
        seq.n_drafted += len(draft)
        seq.n_accepted += accepted
        n_top = seq.req.params.logprobs
        for i, tid in enumerate(emitted):
            lp = token_logprobs(logits[i : i + 1], [tid], n_top)[0] if n_top is not None else None
            self._append(seq, tid, lp)
            if self.slots[seq.slot] is not seq:  # finished (stop, length, end of generation)
                break
        return i  # tokens released beyond the one a plain decode step gives

    def _score_prompt(self, w: _Work, logits: torch.Tensor) -> None:
        """Row p predicts token p+1: the logprobs of the prompt tokens this chunk's rows predict."""
        seq = w.seq
        targets = seq.tokens[w.start + 1 : min(w.end + 1, seq.n_prompt)]
        out = token_logprobs(logits[: len(targets)], targets, seq.req.prompt_logprobs)
        if w.start == 0:
            out.insert(0, TokenLogprob(seq.tokens[0], None, []))
        seq.req.sink(Event(prompt_logprobs=out))

    def _append(self, seq: Sequence, tid: int, lp: TokenLogprob | None) -> None:
        seq.tokens.append(tid)
        seq.n_gen += 1
        if tid in self.tok.eog_ids and not seq.req.ignore_eos:
            self._finish(seq, "stop")
            return
        piece = seq.decoder.push(tid)
        seq.held_tokens.append(GenToken(tid, piece, lp))
        if self._release(seq, piece):
            return
        if seq.n_gen >= seq.req.max_tokens or len(seq.tokens) >= self.n_ctx:
            self._finish(seq, "length")

    def _release(self, seq: Sequence, piece: str) -> bool:
        """Pass on text that can no longer start a stop string; True when a stop string ended the request."""
        text = seq.held_text + piece
        stops = seq.req.stop
        cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
        if cut >= 0:
            seq.held_text = text[:cut]
            self._finish(seq, "stop", at_stop_string=True)
            return True
        keep = max((k for s in stops for k in range(min(len(s) - 1, len(text)), 0, -1) if s.startswith(text[-k:])),
                   default=0)  # fmt: skip
        seq.held_text = text[len(text) - keep :]
        self._emit(seq, text[: len(text) - keep])
        return False

    def _emit(self, seq: Sequence, text: str, final: bool = False) -> None:
        """Send `text` with the held tokens it covers (all of them when `final`)."""
        if final:
            tokens, seq.held_tokens, seq.emitted_in_held = seq.held_tokens, [], 0
        else:
            avail, covered, n = seq.emitted_in_held + len(text), 0, 0
            for t in seq.held_tokens:
                if covered + len(t.text) > avail:
                    break
                covered += len(t.text)
                n += 1
            tokens, seq.held_tokens = seq.held_tokens[:n], seq.held_tokens[n:]
            seq.emitted_in_held = avail - covered
        if text or tokens:
            seq.req.sink(Event(text=text, tokens=tokens))

    def _finish(self, seq: Sequence, reason: str, error: str | None = None, at_stop_string: bool = False) -> None:
        """Deliver what is held back and the final event; free the slot."""
        now = time.perf_counter()
        if not at_stop_string:  # text after a stop string is dropped, otherwise nothing is
            seq.held_text += seq.decoder.flush()
        self._emit(seq, seq.held_text, final=True)
        seq.held_text = ""
        if seq.t_first is not None:
            with self.stats.lock:
                self.stats.predicted_tokens += seq.n_gen
                self.stats.predicted_seconds += now - seq.t_first
        seq.req.sink(
            Event(
                finish_reason=reason,
                usage={"prompt_tokens": seq.n_prompt, "completion_tokens": seq.n_gen,
                       "total_tokens": seq.n_prompt + seq.n_gen},  # fmt: skip
                timings=seq.timings(now),
                error=error,
            )
        )
        if self.slots[seq.slot] is seq:
            self.slots[seq.slot] = None
            self.spec.release(seq.slot)

