"""The slots' prompt caches as llama-server's /slots serves them (the listing, the save, restore and
erase actions) and the P/D prefill worker's hand-over of a finished request's state (`held`).

A slot's prompt cache is the tokens whose KV (and recurrent state) a finished request left in it
(`KVManager.cached`). Every action runs on an idle slot, under the engine's lock: the scheduler
admits under the same lock, so no request takes the slot while its state is read or written.
"""

from __future__ import annotations

import threading
import time

from ...contracts.slot_state import SlotStateError
from ..errors import UserError
from .kv_manager import KVManager
from .scheduler import Scheduler


class SlotCache:
    """The /slots actions over `pipeline`'s slot states and `kv`'s prompt caches of `scheduler`'s
    idle slots, under `lock` (the engine's condition)."""

    def __init__(self, pipeline, scheduler: Scheduler, kv: KVManager, lock: threading.Condition):
        self.pipeline = pipeline
        self.scheduler = scheduler
        self.kv = kv
        self.lock = lock

    def info(self, n_ctx: int) -> list[dict]:
        """Each slot as llama-server's GET /slots lists it."""
        out = []
        for i, seq in enumerate(self.scheduler.slots):
            info = {"id": i, "state": "idle" if seq is None else "processing", "n_ctx": n_ctx}
            info["n_past"] = 0 if seq is None else seq.n_past
            if seq is not None:
                info.update(id_task=seq.req.id, n_prompt_tokens=seq.n_prompt, n_decoded=seq.n_gen)
            out.append(info)
        return out

    def save(self, slot: int, write) -> tuple[int, int]:
        """(tokens, bytes) of the prompt cache an idle slot holds, written through `write`."""
        with self.lock:  # the slot stays idle: admit waits for this lock
            self._idle(slot)
            tokens = self.kv.cached(slot)
            return len(tokens), self.pipeline.save_slot(slot, tokens, write)

    def restore(self, slot: int, data: bytes) -> int:
        """Load a saved state into an idle slot; its tokens become that slot's prompt cache. A
        refused state leaves the slot's cache as it was; a placement that failed midway empties it."""
        prepared = self.pipeline.prepare_state(data)  # checksums off the engine lock: decoding goes on
        with self.lock:
            self._idle(slot)
            try:
                tokens = self.pipeline.place_state(slot, prepared)
            except SlotStateError:
                raise
            except Exception:
                self.kv.hold(slot, [])
                raise
            self.kv.hold(slot, tokens)
            return len(tokens)

    def erase(self, slot: int) -> int:
        with self.lock:
            self._idle(slot)
            n = len(self.kv.cached(slot))
            self.kv.hold(slot, [])
            return n

    def held(self, tokens: list[int], collect, wait_s: float = 5.0):
        """`collect(slot, tokens)` for the idle slot whose prompt cache is exactly `tokens` (a
        request that just finished), under the engine lock so no request takes the slot meanwhile;
        None when no slot holds them (a finished request frees its slot just after its last event)."""
        deadline = time.monotonic() + wait_s
        with self.lock:
            while True:
                slot = self.kv.idle_holding(tokens)
                if slot is not None:
                    return collect(slot, tokens)
                if time.monotonic() > deadline:
                    return None
                self.lock.wait(0.001)

    def _idle(self, slot: int) -> None:
        if not 0 <= slot < len(self.scheduler.slots):
            raise UserError(f"slot {slot} does not exist ({len(self.scheduler.slots)} slots)")
        if self.scheduler.slots[slot] is not None:
            raise UserError(f"slot {slot} is processing a request")
