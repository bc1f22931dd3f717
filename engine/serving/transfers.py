"""Prefill/decode disaggregation on the decode head: a newly admitted sequence with a long prompt
fetches its prompt's state from a prefill worker (`pd.Disaggregator`) while the others decode.

The state is checked and copied into the sequence's slot on the transfer's thread, holding no
engine lock; the slot stays the sequence's meanwhile (the scheduler frees no sequence whose state
is in flight, and the engine steps no sequence with `remote_prefill` set). When the transfer ends,
the sequence decodes from the placed state, or prefills here from the start if it fell back.
"""

from __future__ import annotations

import threading

from ..errors import UserError
from .scheduler import Scheduler
from .sequence import Sequence


class PromptTransfers:
    """Starts and ends the transfers of `scheduler`'s running sequences through `disaggregator`
    (None: no prefill worker, nothing to do), placing the states into `pipeline`'s slots; `lock` is
    the engine's condition."""

    def __init__(self, disaggregator, pipeline, scheduler: Scheduler, lock: threading.Condition):
        self.pd = disaggregator
        self.pipeline = pipeline
        self.scheduler = scheduler
        self.lock = lock

    def start(self) -> None:
        """Newly admitted sequences with a long prompt fetch its state from the prefill worker
        (called under the engine's lock, after admission)."""
        if self.pd is None:
            return
        for seq in self.scheduler.running:
            if seq.transfer is None and not seq.remote_prefill and seq.n_gen == 0 and self.pd.wants(seq):
                seq.remote_prefill = True
                self.pd.start(
                    seq,
                    lambda payload, tokens, seq=seq: self._place(seq, payload, tokens),
                    lambda transfer, seq=seq: self._transferred(seq, transfer),
                )

    def stop(self) -> None:
        if self.pd is not None:
            self.pd.stop()

    def _place(self, seq: Sequence, payload: list, tokens: list[int]) -> None:
        """On the transfer's thread, holding no engine lock: decoding goes on while the state is
        checked and copied in. The slot stays this sequence's until `_transferred` (the scheduler
        frees no sequence whose state is in flight)."""
        prepared = self.pipeline.prepare_state(payload, tokens)
        with self.lock:
            if self.scheduler.slots[seq.slot] is not seq or seq.req.cancelled:
                raise UserError("the request left its slot during the transfer")
        self.pipeline.place_state(seq.slot, prepared)
        with self.lock:
            seq.n_past = len(tokens)

    def _transferred(self, seq: Sequence, transfer) -> None:
        with self.lock:
            seq.transfer, seq.remote_prefill = transfer, False
            if transfer.fallback is not None:  # prefill here from the start: a half-placed slot is never read
                seq.n_past = seq.n_cached = 0
            self.lock.notify()
