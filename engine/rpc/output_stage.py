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

from ...contracts.rpc import MAX_RUN, DraftAsk, DraftReply
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

    def outputs(self, h: torch.Tensor, tokens, slots, positions, rows, want_hidden: bool, ahead=()):
        """(float32 logits of `rows` [R, n_vocab], every row's normed hidden state or None, the drafts
        ahead) from the layers' output `h`; the MTP block follows the batch (`tokens`) first."""
        stage = self.stage
        if self.mtp is None and not want_hidden:  # the output head's graphs, as a head's plain forward
            return stage.logits(h[rows.to(h.device)]), None, []
        x = stage.final_norm(h)
        if self.mtp is not None:
            self.mtp.observe(tokens, slots, positions, x)
        logits = stage.project(x[rows.to(x.device)])
        return logits, (x if want_hidden else None), self._ahead(logits, tokens, slots, positions, rows, ahead)

    def _ahead(self, logits, tokens, slots, positions, rows, ahead) -> list[tuple[int, int, list[int]]]:
        """Per AHEAD entry (slot, drafted, k, p_min), what the head's greedy verification of the slot
        will emit last and the draft from it: the target's argmax rows as `accept_greedy` reads them
        (the drafted tokens are the slot's next inputs), then up to k greedy tokens of the block from
        the first row that disagreed (or the last), at its position: (position, token, draft)."""
        if not ahead:
            return []
        picks, s, r = logits.argmax(-1).tolist(), slots.tolist(), rows.tolist()
        starts, ks, p_mins = [], [], []
        for slot, drafted, k, p_min in ahead:
            own = [i for i, row in enumerate(r) if s[row] == slot][: drafted + 1]  # its logit rows, in order
            first = r[own[0]]
            n = 0
            while n < drafted and int(tokens[first + 1 + n]) == picks[own[n]]:
                n += 1
            starts.append((slot, picks[own[n]], int(positions[first]) + n + 1))
            ks.append(max(0, min(k, self.stage.n_ctx - starts[-1][2])))
            p_mins.append(p_min)
        live = [i for i, k in enumerate(ks) if k > 0]
        drafts = (
            self.mtp.greedy(
                [starts[i][0] for i in live],
                [starts[i][1] for i in live],
                [starts[i][2] for i in live],
                [ks[i] for i in live],
                [p_mins[i] for i in live],
            )
            if live
            else []
        )
        out = [(pos, tok, []) for _, tok, pos in starts]
        for i, draft in zip(live, drafts):
            out[i] = (out[i][0], out[i][1], draft)
        return out

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


def check_ahead(ahead, slots, rows, n_slots: int) -> str | None:
    """Why FORWARD_OUT's drafts ahead cannot be made from this batch (None: they can): distinct
    slots that exist, each with its drafted tokens' rows and one more among the logit rows, k and
    p-min in their ranges."""
    s = slots.tolist()
    counts: dict[int, int] = {}
    for row in rows.tolist():
        counts[s[row]] = counts.get(s[row], 0) + 1
    named = [slot for slot, _, _, _ in ahead]
    if len(set(named)) != len(named) or any(not 0 <= slot < n_slots for slot in named):
        return f"FORWARD_OUT drafts ahead name a slot twice or past this stage's {n_slots}"
    for slot, drafted, k, p_min in ahead:
        if counts.get(slot, 0) < drafted + 1:
            return f"FORWARD_OUT draft ahead of slot {slot}: {drafted} drafted tokens need {drafted + 1} logit rows"
        if not 1 <= k < MAX_RUN or not 0.0 <= p_min <= 1.0:
            return f"FORWARD_OUT draft ahead of slot {slot}: k must be 1..{MAX_RUN - 1} and p_min 0..1"
    return None


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
