"""The output on the last stage (`--output-stage last`), the peer's side.

llama.cpp keeps the output norm, the output head and the MTP block on the last device of a split;
a head that holds them instead carries ~1.5 GiB more on the users' 27B (the output head 0.97 GiB,
the block 0.35 GiB and its KV). With `LoadStageRequest.output` the last peer holds them: FORWARD_OUT
runs its layers, then the norm, the logits of the rows the head asks for (and, for an embedding,
every row's normed hidden state), and with `mtp` its MTP block follows the batch (the frame carries
the token ids) as the head's would; DRAFT asks the block for greedy drafts. The math is the head's
own (`Pipeline.forward`): a split computes what the head alone computes, bit for bit.
"""

from __future__ import annotations

import torch

from ...contracts.rpc import DraftAsk, DraftReply
from ..spec.mtp import MtpDrafter, build_mtp


class StageOutput:
    """What the last stage holds past its layers: `stage` was built with the output head (and the
    token embedding when `mtp`: the MTP block embeds each draft)."""

    def __init__(self, stage, mtp: MtpDrafter | None):
        self.stage, self.mtp = stage, mtp

    @classmethod
    def build(cls, stage, mtp: bool, max_run: int) -> StageOutput:
        """The block's graphs are captured here, with the stage's: drafts of up to `max_run` - 1 tokens."""
        return cls(stage, build_mtp(stage, max(max_run - 1, 1), p_min=0.0) if mtp else None)

    def outputs(self, h: torch.Tensor, tokens, slots, positions, rows, want_hidden: bool):
        """(float32 logits of `rows` [R, n_vocab], every row's normed hidden state or None) from the
        layers' output `h`; the MTP block follows the batch (`tokens`) first."""
        stage = self.stage
        if self.mtp is None and not want_hidden:  # the output head's graphs, as a head's plain forward
            return stage.logits(h[rows.to(h.device)]), None
        x = stage.final_norm(h)
        if self.mtp is not None:
            self.mtp.observe(tokens, slots, positions, x)
        return stage.project(x[rows.to(x.device)]), (x if want_hidden else None)

    def draft(self, ask: DraftAsk) -> DraftReply:
        """DRAFT: the head's news of its slots, then its drafts. Sizes and slots were judged by the
        caller (`check_draft`)."""
        mtp = self.mtp
        for slot in ask.released:
            mtp.release(slot)
        for slot in ask.resting:
            mtp.rest(slot, True)
        for slot in ask.following:
            mtp.rest(slot, False)
        if not ask.slots:
            return DraftReply()
        drafts = mtp.greedy(ask.slots, ask.tokens, ask.positions, ask.ks, ask.p_mins)
        return DraftReply(counts=[len(d) for d in drafts], tokens=[t for d in drafts for t in d])

    def clear(self, slot: int) -> None:
        if self.mtp is not None:
            self.mtp.clear(slot)

    def restored(self, slot: int, n: int) -> None:
        """A moved state of n positions was placed in `slot`: it carried none of the block's (the
        state ops move this stage's layers), whose drafts are poorer until it refills."""
        if self.mtp is not None:
            self.mtp.restored(slot, n, None)


def check_draft(ask: DraftAsk, n_slots: int, n_ctx: int, n_vocab: int) -> str | None:
    """Why a DRAFT cannot run on a stage of `n_slots` x `n_ctx` (None: it can): the per-draft lists
    of one length, distinct slots that exist, tokens of the vocabulary, room for every draft."""
    n = len(ask.slots)
    if any(len(field) != n for field in (ask.tokens, ask.positions, ask.ks, ask.p_mins)):
        return "DRAFT's slots, tokens, positions, ks and p_mins must have one length"
    named = [*ask.released, *ask.resting, *ask.following, *ask.slots]
    if any(s >= n_slots for s in named):
        return f"DRAFT names a slot past this stage's {n_slots}"
    if len(set(ask.slots)) != n:
        return "DRAFT asks twice for one slot"
    if any(t >= n_vocab for t in ask.tokens):
        return f"DRAFT token id out of range 0..{n_vocab - 1}"
    if any(p + k > n_ctx for p, k in zip(ask.positions, ask.ks)):
        return f"DRAFT past the slot's {n_ctx} positions"
    return None
