"""A separate draft GGUF model drafting for the target (same vocabulary), with its own KV per slot."""

from __future__ import annotations

import torch

from ..errors import UserError
from .drafter import Draft, Drafter, DraftRequest, common_prefix, draft_step


class DraftModelDrafter(Drafter):
    """A smaller GGUF with the target's vocabulary drafts autoregressively on its own `Pipeline`
    (its own per-slot KV cache). All slots that ask in one step draft together: one draft forward
    per drafted position for the whole batch. Greedy requests draft the draft model's argmax (q is a
    point mass); sampled requests draw from the draft distribution under the request's sampling
    transforms and return it as q for rejection sampling. Drafting stops at the first token whose
    draft probability is below `p_min`. Called from the engine thread only."""

    def __init__(self, pipeline, p_min: float = 0.75):
        self.pipeline = pipeline
        self.p_min = p_min
        self._cached: dict[int, list[int]] = {}  # slot -> tokens whose KV the draft cache holds

    def start(self, slot: int, prompt: list[int]) -> None:
        self._cached.pop(slot, None)

    def release(self, slot: int) -> None:
        """The slot's draft KV is never reused (a new request feeds it from position 0): its pooled
        blocks go back now, or idle slots would hold the draft pool the target's makes room in."""
        self._cached.pop(slot, None)
        self.pipeline.clear_slot(slot)

    def draft_batch(self, requests: list[DraftRequest]) -> list[Draft]:
        out = [Draft() for _ in requests]
        live = [i for i, r in enumerate(requests) if r.k > 0 and r.tokens]
        qs: dict[int, list[torch.Tensor]] = {i: [] for i in live}
        # Feed per slot what its draft cache lacks (new prompt, accepted tokens, the last target
        # token); positions past the common prefix are simply overwritten.
        feeds: dict[int, tuple[list[int], int]] = {}
        for i in live:
            r = requests[i]
            cached = self._cached.get(r.slot, [])
            common = common_prefix(cached, r.tokens)
            if common == len(r.tokens):  # always recompute the last position's logits
                common -= 1
            feeds[i] = (r.tokens[common:], common)
            self._cached[r.slot] = list(r.tokens)
        while live:
            toks, slots, pos, rows = [], [], [], []
            for i in live:
                feed, p0 = feeds[i]
                toks += feed
                slots += [requests[i].slot] * len(feed)
                pos += range(p0, p0 + len(feed))
                rows.append(len(toks) - 1)
            logits = self.pipeline.forward(
                torch.tensor(toks, dtype=torch.long),
                torch.tensor(slots, dtype=torch.long),
                torch.tensor(pos, dtype=torch.long),
                torch.tensor(rows, dtype=torch.long),
            )
            still = []
            for row, i in enumerate(live):
                r = requests[i]
                if draft_step(out[i], qs[i], r, logits[row], self.p_min):
                    tok = out[i].tokens[-1]
                    feeds[i] = ([tok], len(r.tokens) + len(out[i].tokens) - 1)
                    self._cached[r.slot].append(tok)
                    still.append(i)
            live = still
        for i, q in qs.items():
            if q:
                out[i].q = torch.stack(q)
        return out


def check_same_vocab(target, draft) -> None:
    """A draft model must share the target's token ids, or its proposals mean other text."""
    t_tokens = target.metadata.get("tokenizer.ggml.tokens")
    d_tokens = draft.metadata.get("tokenizer.ggml.tokens")
    if t_tokens is None or d_tokens is None:
        raise UserError("draft model check: a GGUF has no tokenizer.ggml.tokens vocabulary")
    if len(t_tokens) != len(d_tokens):
        raise UserError(
            f"draft model vocabulary has {len(d_tokens)} tokens, the target has {len(t_tokens)}: "
            "--model-draft must use the same tokenizer as --model"
        )
    if list(t_tokens) != list(d_tokens):
        first = next(i for i, (a, b) in enumerate(zip(t_tokens, d_tokens)) if a != b)
        raise UserError(
            f"draft model vocabulary differs from the target's at token {first} "
            f"({d_tokens[first]!r} vs {t_tokens[first]!r}): --model-draft must use the same tokenizer"
        )


# ---------------------------------------------------------------- verification (pure functions)
