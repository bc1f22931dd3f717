"""The engine's counters: llama-server's totals (prompt and predicted tokens and seconds, requests),
recent step rates, the latency percentiles /status reports, busy slots per step and the longest
sequence (llama-server's metrics). The engine and the output processor add to them; /status and
/metrics read them from any thread."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from ..spec import SpecStats

RATE_WINDOW_S = 10.0
# Where a step's wall time goes: scheduling (drafting included), queueing its forward (running it, on
# a CPU), waiting for its tokens (the device's time past the queueing), and the host's work on them.
STEP_PHASES = ("schedule", "forward", "read", "emit")
LATENCY_WINDOW_S = 60.0  # requests/s and the latency percentiles in /status
LATENCY_SAMPLES = 4096


@dataclass(frozen=True)
class Counters:
    """An engine's counters, handed to the engine that follows it (a head waking from sleep): the
    metrics' totals go on rather than start over."""

    stats: EngineStats
    spec_stats: SpecStats


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
        self.phase_s = dict.fromkeys(STEP_PHASES, 0.0)  # wall seconds of the steps, by phase
        # The same for the steps that held prompt rows (and their count): a decode step's average
        # is what is left.
        self.prompt_phase_s = dict.fromkeys(STEP_PHASES, 0.0)
        self.prompt_steps = 0
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

    def add_phase(self, phase: str, seconds: float, prompt: bool) -> None:
        """`seconds` of a step's `phase`; `prompt`: the step held prompt rows."""
        with self.lock:
            self.phase_s[phase] += seconds
            if prompt:
                self.prompt_phase_s[phase] += seconds

    def record_step(
        self, start: float, end: float, n_prefill: int, n_decode: int, n_busy: int = 0, n_tokens: int = 0
    ) -> None:
        """One forward: its token counts, the slots busy during it and the longest sequence among them."""
        with self.lock:
            self.steps += 1
            self.prompt_steps += n_prefill > 0
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
