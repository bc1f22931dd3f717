"""The tokens a split pipeline has run, per slot: what it replays to rebuild a stage's lost KV."""

from __future__ import annotations

import torch

PENDING_BATCHES_MAX = 64  # batches of device-resident tokens recorded before one bulk copy back


class SlotHistory:
    """Token ids by (slot, position), grown as slots run; `lengths`: tokens of each slot whose KV
    every stage holds (a slot's run is contiguous with increasing positions)."""

    def __init__(self):
        self._tokens: torch.Tensor | None = None  # [slots, ctx] token ids run so far
        self._pending: list[tuple] = []  # (tokens, slots, positions) not yet in _tokens
        self.lengths: dict[int, int] = {}

    def record(self, tokens, slots, positions) -> None:
        """Remember the batch's tokens. Tokens still on the device (a caller that keeps sampling
        there) are copied back in bulk later: reading them now would make the head wait for the
        whole step mid-pipeline."""
        if tokens.numel() == 0:
            return
        s, p = slots.cpu(), positions.cpu()
        if tokens.device.type == "cpu":
            self.flush()
            self.write(tokens, s, p)
        else:
            self._pending.append((tokens, s, p))
            if len(self._pending) >= PENDING_BATCHES_MAX:
                self.flush()
        # A slot's run is contiguous with increasing positions: its last position ends its history.
        for slot, pos in zip(s.tolist(), p.tolist()):
            self.lengths[slot] = pos + 1

    def flush(self) -> None:
        """The recorded batches still on the device, copied in."""
        if self._pending:
            tokens, s, p = (torch.cat(parts) for parts in zip(*self._pending))
            self._pending.clear()
            self.write(tokens.cpu(), s, p)

    def write(self, tokens, s, p) -> None:
        """Host token ids at (slot, position) pairs, after any pending ones (`flush` first)."""
        need_slots, need_ctx = int(s.max()) + 1, int(p.max()) + 1
        hist = self._tokens
        if hist is None or hist.shape[0] < need_slots or hist.shape[1] < need_ctx:
            grown = torch.zeros(
                max(need_slots, hist.shape[0] if hist is not None else 0),
                max(need_ctx, 2 * hist.shape[1] if hist is not None else 256),
                dtype=torch.long,
            )
            if hist is not None:
                grown[: hist.shape[0], : hist.shape[1]] = hist
            self._tokens = hist = grown
        hist[s, p] = tokens

    def shift(self, slot: int, keep: int, discard: int, n: int) -> None:
        """A context shift of `slot`, which holds `n` positions: [keep + discard, n) move down by discard."""
        self.flush()
        if self._tokens is not None and slot < self._tokens.shape[0]:
            row = self._tokens[slot]
            row[keep : n - discard] = row[keep + discard : n].clone()
        self.lengths[slot] = n - discard

    def tokens(self, slot: int, start: int, end: int) -> torch.Tensor:
        """`slot`'s token ids at positions [start, end), as written (`flush` first)."""
        return self._tokens[slot, start:end]
