"""`DormantEngine`: what /status, /metrics and /props read of the engine while the head sleeps
(--sleep-idle-seconds, workers/idle_sleep.py): the stopped engine's counters and shape, no model.
The engine that wakes goes on from its `counters`."""

from __future__ import annotations

from ..spec import Speculator
from .stats import Counters


class DormantEngine:
    n_processing = n_deferred = 0

    def __init__(self, engine):
        self.counters = Counters(engine.stats, engine.spec_stats)
        self.stats, self.spec_stats, self.spec_config = engine.stats, engine.spec_stats, engine.spec_config
        self.n_slots, self.n_ctx, self.max_queue = engine.n_slots, engine.n_ctx, engine.max_queue
        self.spec = Speculator(engine.spec_config)  # n-gram only: no drafter holds a model, no slot a draft length
        self.spec.stats = engine.spec_stats

    def slot_info(self) -> list[dict]:
        """Every slot idle and empty (`SlotCache.info`'s shape): the prompt caches went with the KV."""
        return [{"id": i, "state": "idle", "n_ctx": self.n_ctx, "n_past": 0} for i in range(self.n_slots)]

    def stop(self) -> None:
        """Nothing runs."""
