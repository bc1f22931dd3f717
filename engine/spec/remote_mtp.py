"""The MTP drafter when the block is the last peer's (`--output-stage last`): drafts through DRAFT."""

from __future__ import annotations

import contextlib

import torch

from ...contracts.rpc import DraftAsk
from ..rpc.peer_errors import PeerUnavailable
from .drafter import Draft, Drafter, DraftRequest


class RemoteMtpDrafter(Drafter):
    """The head's side of the MTP block that the last peer holds beside its output head (llama.cpp's
    placement: the block needs the output head). The peer's own `MtpDrafter` follows every forward
    there (FORWARD_OUT carries the batch's tokens), so nothing here observes; this side sends what
    the head's `Speculator` decides per slot (a new request, resting or following) with the next
    DRAFT, and asks for greedy drafts. A request that samples gets a greedy draft too (no q): its
    verification is then the target's own seeded draw kept while the draft agrees (Speculator.verify),
    exact, as llama.cpp's draft-mtp drafts greedily whatever the request samples.

    The block's state does not travel with a moved slot here (P/D, slot save/restore: the peer's
    state ops carry its layers only), so after a move its drafts are poorer until the block refills,
    never wrong; a re-attached peer's block starts empty the same way."""

    def __init__(self, remote, p_min: float, device: torch.device):
        self.remote = remote
        self.p_min = p_min
        self.device = device  # the head's: what the adaptive policy's default asks
        self._released: set[int] = set()
        self._resting: dict[int, bool] = {}  # slot -> resting, as the peer last heard it
        self._changed: dict[int, bool] = {}  # slot -> resting, not sent yet
        self.ahead = 0  # drafts the peer made in a forward's exchange (no DRAFT of their own)

    @property
    def kv_bytes(self) -> int:
        return 0  # the peer's

    def start(self, slot: int, prompt: list[int]) -> None:
        self.release(slot)

    def release(self, slot: int) -> None:
        self._released.add(slot)
        self.remote.ahead_drafts.pop(slot, None)  # whatever was drafted ahead for the slot's last request
        self._resting.pop(slot, None)
        self._changed.pop(slot, None)

    def rest(self, slot: int, resting: bool) -> None:
        if self._resting.get(slot, False) != resting:
            self._changed[slot] = resting
        else:
            self._changed.pop(slot, None)

    def sync(self) -> None:
        """What the peer has not heard yet, sent now (before the forward it concerns); a peer lost
        meanwhile hears it with the next DRAFT (the forward then waits for it, or fails, as any does)."""
        if self._released or self._changed:
            with contextlib.suppress(PeerUnavailable):
                self._ask()

    def draft_batch(self, requests: list[DraftRequest]) -> list[Draft]:
        """The drafts the peer made ahead in the last forward (`Speculator.ahead`) where they start
        from the slot's last token, else one DRAFT for the rest; a peer lost meanwhile drafts nothing
        (the step's forward then waits for it, or fails its requests, as any forward does)."""
        out = [Draft() for _ in requests]
        asked = []
        for i, r in enumerate(requests):
            if r.k <= 0 or not r.tokens:
                continue
            kept = self.remote.take_ahead(r.slot, len(r.tokens) - 1, r.tokens[-1])
            if kept is None:
                asked.append(i)
            else:
                out[i].tokens = kept[: r.k]
                self.ahead += 1
        if not asked and not (self._released or self._changed):
            return out
        live = [requests[i] for i in asked]
        try:
            drafts = self._ask(
                slots=[r.slot for r in live],
                tokens=[r.tokens[-1] for r in live],
                positions=[len(r.tokens) - 1 for r in live],
                ks=[r.k for r in live],
                p_mins=[self.p_min if r.p_min is None else r.p_min for r in live],
            )
        except PeerUnavailable:
            return out
        for i, tokens in zip(asked, drafts):
            out[i].tokens = tokens
        return out

    def _ask(self, **drafts) -> list[list[int]]:
        ask = DraftAsk(
            released=sorted(self._released),
            resting=sorted(s for s, r in self._changed.items() if r),
            following=sorted(s for s, r in self._changed.items() if not r),
            **drafts,
        )
        out = self.remote.draft(ask)
        self._resting.update(self._changed)
        self._released.clear()
        self._changed.clear()
        return out
