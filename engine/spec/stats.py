"""Speculative decoding's counters: drafts, accepted tokens, per-position acceptance (/status, /metrics)."""

from __future__ import annotations

import threading
import time
from collections import deque

from ...contracts.status import SpecSlot, Speculative
from ..config import SpecConfig


class SpecStats:
    """Counters behind /metrics and /status: drafts verified, tokens drafted, tokens accepted,
    accepted per draft position, and a recent window of drafts."""

    def __init__(self, window_s: float = 30.0, window_max: int = 1024):
        self._lock = threading.Lock()
        self.drafts = 0
        self.draft_tokens = 0
        self.accepted = 0
        self.accepted_per_pos: list[int] = []
        self.window_s = window_s
        self._recent: deque[tuple[float, int, int]] = deque(maxlen=window_max)

    def record(self, n_drafted: int, n_accepted: int) -> None:
        if n_drafted <= 0:
            return
        with self._lock:
            self.drafts += 1
            self.draft_tokens += n_drafted
            self.accepted += n_accepted
            while len(self.accepted_per_pos) < n_drafted:
                self.accepted_per_pos.append(0)
            for i in range(n_accepted):
                self.accepted_per_pos[i] += 1
            self._recent.append((time.monotonic(), n_drafted, n_accepted))

    def snapshot(
        self, spec: SpecConfig | None = None, kv_bytes: int = 0, slots: list[dict] | None = None
    ) -> Speculative:
        """The /status `speculative` section (`kv_bytes`: the drafter's own cache; `slots`: the
        adaptive policy's per-slot state, `AdaptiveDrafts.snapshot`)."""
        with self._lock:
            cutoff = time.monotonic() - self.window_s
            recent = [(d, a) for t, d, a in self._recent if t >= cutoff]
            r_drafted = sum(d for d, _ in recent)
            r_accepted = sum(a for _, a in recent)
            return Speculative(
                type=spec.type if spec else "off",
                draft_max=spec.n_max if spec else 0,
                drafts=self.drafts,
                draft_tokens=self.draft_tokens,
                accepted=self.accepted,
                acceptance=self.accepted / self.draft_tokens if self.draft_tokens else None,
                mean_accepted_len=1 + self.accepted / self.drafts if self.drafts else None,
                recent_acceptance=r_accepted / r_drafted if r_drafted else None,
                accepted_per_pos=list(self.accepted_per_pos),
                kv_bytes=kv_bytes,
                adaptive=bool(spec and spec.active and spec.adapts),
                slots=[SpecSlot(**s) for s in slots or []],
            )


# ---------------------------------------------------------------- the engine's side
