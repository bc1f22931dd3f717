"""Prompt-lookup drafting: the continuation of the longest recent n-gram match in the slot's own
history (works on any model)."""

from __future__ import annotations

import numpy as np

from .drafter import Draft, Drafter, DraftRequest


class NgramDrafter(Drafter):
    """Prompt lookup: find the latest earlier occurrence of the history's last n tokens (n = n_max
    down to 1) and propose the tokens that followed it. Needs no model; shines when the output
    repeats the prompt (code edits, summaries quoting the text, extraction)."""

    def __init__(self, n_max: int = 3, n_min: int = 1):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"n-gram sizes need 1 <= n_min <= n_max, got {n_min}, {n_max}")
        self.n_max, self.n_min = n_max, n_min

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        if k <= 0 or len(tokens) < 2:
            return []
        hist = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.n_max, len(hist) - 1), self.n_min - 1, -1):
            # Windows starting at j with j + n < len(hist): an earlier occurrence with a follower.
            windows = np.lib.stride_tricks.sliding_window_view(hist[:-1], n)
            hits = np.flatnonzero((windows == hist[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return hist[start : start + k].tolist()
        return []

    def draft_batch(self, requests: list[DraftRequest]) -> list[Draft]:
        return [Draft(self.lookup(r.tokens, r.k)) for r in requests]
