"""A peer stage's slot states out and in (contracts.slot_state), for its head only: STATE_META,
STATE_GET, STATE_JOIN, STATE_PUT."""

from __future__ import annotations

import hmac

from ...contracts.rpc import StateGetRequest, StateMeta
from ...contracts.slot_state import SlotHeader, SlotStateError, check_body
from .. import slot_state
from .compute_error import ComputeError


class StageStateOps:
    """`StageHost`'s state ops: they use its lock, stage, owner, `lengths`, `state_key`, `output`
    and byte counters."""

    def _state_stage(self, slot: int, owner: int):
        """The stage whose slot a state op may touch (caller holds the lock)."""
        if not self.assignable:
            raise ComputeError("this worker is a head: its slots move through the control port's state ops")
        if self.stage is None:
            raise ComputeError("no stage assigned here: send LOAD_STAGE first")
        self._own(owner)
        if not 0 <= slot < self.stage.n_slots:
            raise ComputeError(f"slot {slot} does not exist ({self.stage.n_slots} slots)")
        return self.stage

    def state_meta(self, slot: int, owner: int = 0) -> StateMeta:
        with self.lock:
            stage = self._state_stage(slot, owner)
            n = self.lengths.get(slot, 0)
            return StateMeta(
                slot=slot,
                n_tokens=n,
                layers=[list(self.layers)],
                fingerprint=self.fingerprint,
                bytes=sum(t.nbytes for t in stage.slot_state(slot, n).values()),
                dtype=str(stage.dtype).removeprefix("torch."),
            )

    def state_get(self, request: StateGetRequest, owner: int = 0) -> list[memoryview]:
        """The state of the slot's first len(tokens) positions (one buffer, sent as it is)."""
        slot, tokens = request.slot, request.tokens
        with self.lock:
            stage = self._state_stage(slot, owner)
            if len(tokens) > self.lengths.get(slot, 0):
                raise ComputeError(f"slot {slot} holds {self.lengths.get(slot, 0)} positions, {len(tokens)} asked for")
            try:
                chunks = [slot_state.save(stage, slot, tokens, self.fingerprint)]
            except SlotStateError as e:
                raise ComputeError(str(e)) from None
        self.state_bytes_out += sum(len(c) for c in chunks)
        return chunks

    def join(self, key: bytes) -> int:
        """STATE_JOIN: the identity a second session of the stage's head takes (the loading session's,
        which owns the slots), given the `state_key` LOAD_STAGE answered."""
        with self.lock:
            if self.stage is None or not hmac.compare_digest(bytes(key), self.state_key):
                raise ComputeError("STATE_JOIN refused: not the key of this worker's stage (reloaded since?)")
            return self.owner

    def state_put(self, slot: int, read, fill, owner: int = 0) -> StateMeta:
        """Stage a state whole (its header read with `read(n)` and judged first, then its body
        filled with `fill(view)` into a kept buffer, each chunk checked as it arrives, then its
        tensors made ready on the stage's device) without holding the forwards; only the copy into
        the slot takes the lock. A refused or broken stream leaves the slot as it was."""
        try:
            header, crcs = SlotHeader.decode(read)
            with self.lock:
                stage = self._state_stage(slot, owner)
                self.staging += 1
            try:
                views = slot_state.check(stage, slot, header, self.fingerprint)
                body = slot_state.BUFFERS.take(header.body_bytes)  # the stage's own slot's size, checked above
                check_body(body, header, crcs, fill)
                tensors = slot_state.staged(header, body, views)
            finally:
                with self.lock:
                    self.staging -= 1
            with self.lock:
                if self._state_stage(slot, owner) is not stage:
                    raise SlotStateError("the stage was replaced while the state streamed in")
                slot_state.place_staged(stage, slot, len(header.tokens), tensors, views)
                if self.output is not None:
                    self.output.restored(slot, len(header.tokens))
                self.lengths[slot] = len(header.tokens)
        except SlotStateError as e:
            raise ComputeError(f"STATE_PUT refused: {e}") from None
        self.state_bytes_in += header.body_bytes
        return self.state_meta(slot, owner)
