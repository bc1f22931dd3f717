"""The drafter interface (`Drafter.draft_batch`) and what every drafter shares: a draft, a
request for one, the per-token draft step under p-min."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..serving.sampling import Rows, Stream, distribution, draw, uniform


@dataclass
class Draft:
    """Proposed tokens and, when they were sampled from a distribution, that distribution per token
    (`q[i]` over the vocabulary). `q is None` means each token was chosen deterministically.
    `filler`: tokens the verify runs after the draft that nobody drafted (`Speculator.plan` pads a
    verify to a length the target's graphs replay): their rows are discarded, as a rejected draft's,
    and no counter sees them (`len` is the draft's)."""

    tokens: list[int] = field(default_factory=list)
    q: torch.Tensor | None = None
    filler: int = 0

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def run(self) -> list[int]:
        """What the verify runs after the slot's last token: the draft, then its filler (the last
        draft token repeated: any id would do)."""
        return self.tokens + self.tokens[-1:] * self.filler

    def prefix(self, n: int) -> Draft:
        return self if n >= len(self.tokens) else Draft(self.tokens[:n], None if self.q is None else self.q[:n])


@dataclass
class DraftRequest:
    """One slot's ask: its whole history (prompt + output so far), how many tokens at most, the
    request's sampler (a draft model samples through it when temperature > 0) and its p-min."""

    slot: int
    tokens: list[int]
    k: int
    sampler: object | None = None  # sampling.Sampler
    p_min: float | None = None


class Drafter:
    """Proposes up to k next tokens for a slot. Hooks: `start(slot, prompt)` when a request takes a
    slot, `release(slot)` when it leaves; `draft_batch` may batch slots (the draft model does)."""

    def start(self, slot: int, prompt: list[int]) -> None:
        """A new request took `slot`."""

    def release(self, slot: int) -> None:
        """The request in `slot` finished; drop anything kept for it."""

    def draft(self, slot: int, tokens: list[int], k: int) -> list[int]:
        return self.draft_batch([DraftRequest(slot, tokens, k)])[0].tokens

    def draft_batch(self, requests: list[DraftRequest]) -> list[Draft]:
        raise NotImplementedError


# llama.cpp's drafters (draft-simple, MTP) pick greedily through a top-10 sampler and compare that
# candidate's probability over those 10 logits with p-min: a drafter drafts as far as there.
DRAFT_TOP_K = 10


def draft_step(draft: Draft, qs: list, req: DraftRequest, logits: torch.Tensor, p_min: float) -> bool:
    """Append the next draft token unless its probability falls below p-min (the request's, else the
    drafter's); True while the draft goes on."""
    tok, prob, q = pick(logits, req, req.tokens + draft.tokens)
    if prob < (p_min if req.p_min is None else req.p_min):
        return False
    draft.tokens.append(tok)
    if q is not None:
        qs.append(q)
    return len(draft.tokens) < req.k


def pick(logits: torch.Tensor, req: DraftRequest, history: list[int]):
    """(token, its draft probability, the distribution it was drawn from or None for argmax). A
    greedy pick's probability is over the top `DRAFT_TOP_K` logits only, as llama.cpp's."""
    s = req.sampler
    if s is not None and not s.params.greedy:
        rows = Rows.build([s], [history], logits.device)
        q = distribution(logits[None], rows)[0]
        tok = int(draw(q[None], uniform(rows, Stream.DRAFT))[0])
        return tok, float(q[tok]), q
    # A greedy pick is the argmax, as the target's greedy pick that verifies it: among tied logits the
    # lowest id (torch.argmax), which `topk` does not promise. 16-bit logits tie often (a GPU's output
    # head gives bfloat16): the top two were equal in 23 of 512 rows of a 50k-token synthetic file.
    tok = int(logits.argmax())
    top = logits.float().topk(min(DRAFT_TOP_K, logits.shape[-1]))
    return tok, float(torch.softmax(top.values, dim=-1)[0]), None


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i
