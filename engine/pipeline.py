"""The head's view of the whole model: its own Stage, then each peer in pipeline order.

The runtime only ever calls `Pipeline.forward`; whether layers run here or on peers is
decided here (solo = no peers).
"""

from __future__ import annotations

import torch

from .model import Stage


class Pipeline:
    def __init__(self, head: Stage, remotes: list | None = None):
        self.head = head
        self.remotes = list(remotes or [])

    @property
    def cfg(self):
        return self.head.cfg

    def forward(
        self,
        tokens: torch.Tensor,
        slots: torch.Tensor,
        positions: torch.Tensor,
        logit_rows: torch.Tensor,
    ) -> torch.Tensor:
        """Flattened batch in, float32 logits of the rows in `logit_rows` out."""
        h = self.head.run_layers(self.head.embed(tokens), slots, positions)
        for remote in self.remotes:
            h = remote.run_layers(h, slots, positions)
        return self.head.logits(h[logit_rows])

    def clear_slot(self, slot: int) -> None:
        self.head.kv_clear(slot)
        for remote in self.remotes:
            remote.kv_clear(slot)
