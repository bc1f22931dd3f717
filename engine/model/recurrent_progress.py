"""How far each slot's recurrent (Gated DeltaNet) state has run, for a stage's recurrent layers.

Unlike the KV, recurrent state is not overwritten by position: a slot's run must continue its
state (start at the number of tokens it holds), start at position 0 (a fresh state), or start at
most `depth` tokens back within its previous run (a rejected draft: the state is restored from a
checkpoint); anything else is an error.
"""

from __future__ import annotations

from .deltanet import ROLLBACK, DeltaNet
from .forward_batch import Run


class RecurrentProgress:
    def __init__(self, n_slots: int, depth: int):
        """`depth`: positions a recurrent layer's state can be taken back (1..ROLLBACK)."""
        if not 1 <= depth <= ROLLBACK:
            raise ValueError(f"rollback depth {depth} outside 1..{ROLLBACK}")
        self.n_slots, self.depth = n_slots, depth
        self.nets: list[DeltaNet] = []  # the states of the stage's recurrent layers
        self.length = [0] * n_slots  # tokens each slot's recurrent state has consumed
        self.rollback = [0] * n_slots  # how many of them checkpoints can take back

    def hold(self, nets: list[DeltaNet]) -> None:
        """The stage's layers changed: new layers hold no state, so slots continue only after a
        replay from position 0."""
        self.nets = nets
        self.length, self.rollback = [0] * self.n_slots, [0] * self.n_slots

    def restart(self, slot: int) -> None:
        for net in self.nets:
            net.clear(slot)
        self.length[slot] = self.rollback[slot] = 0

    def placed(self, slot: int, n: int) -> None:
        """A slot state of `n` tokens was put into `slot`: it continues from n."""
        self.length[slot], self.rollback[slot] = n, 0

    def enter(self, runs: list[Run]) -> None:
        """Before a batch: a run starts a slot afresh (position 0), continues its recurrent state, or
        re-runs the last few positions (a rejected draft), whose state a checkpoint restores."""
        if not self.nets:
            return
        seen = set()
        for slot, p0, _ in runs:
            if slot in seen:
                raise ValueError(f"slot {slot} appears twice in one batch: its tokens must be contiguous")
            seen.add(slot)
            back = self.length[slot] - p0
            if p0 == 0:
                self.restart(slot)
            elif 0 < back <= self.rollback[slot]:
                for net in self.nets:
                    net.restore(slot, back)
            elif back != 0:
                raise ValueError(
                    f"slot {slot}: the recurrent (DeltaNet) state holds {self.length[slot]} tokens but the batch "
                    f"continues at position {p0}; recurrent layers cannot skip, nor roll back further than "
                    f"{self.rollback[slot]} (re-run the slot from position 0)"
                )

    def ran(self, runs: list[Run]) -> None:
        """After a batch: each slot's state holds its run, and checkpoints of its last `depth` tokens."""
        for slot, p0, n in runs:
            self.length[slot], self.rollback[slot] = p0 + n, min(n, self.depth)
