"""The model runner (nano-vllm's `ModelRunner`): what one scheduled `Batch` does on the device.

`ModelRunner.run(step)` builds the batch's inputs, runs them through one `Pipeline.forward`, and
samples on the device: a speculative draft is verified on the host (`Speculator.verify`, the
grammar's mask row by row), a prompt chunk asked for scores gets its prompt logprobs, every other
sampling row is drawn in one `sample` over the request's logit bias and grammar mask. The hidden
states go to the MTP drafter (every forward's, when it wants them) and to the embedding chunks'
sequences. The sampled tokens start their copy to the host; `Launched.read` waits for them.

Overlap (vLLM's and SGLang's overlap scheduling; the engine's `overlap`, on by default on a GPU,
`--no-overlap` turns it off): a plain decoding batch launches before the host reads the previous
step's tokens. Its inputs are those tokens where they already are (`_last`, each slot's latest
sample, on the device, gathered by a per-batch-of-slots device index kept across steps: no host
tensor goes to the device on a plain decode step; the scheduler marks them PENDING in
`Batch.inputs`), and while it runs the host copies the previous step's tokens through page-locked
memory and does the detokenizing, stop strings, events and metrics, as soon as the new step's
layers are queued: with a split this fills the time a peer takes to queue its part
(`Pipeline.forward`'s `meanwhile`). A sequence that ended at step n was already in step n+1: the
engine drops that row's output. The row ran the sequence's last token, so the KV (or recurrent
state) it wrote is that token's own, and the slot's prompt cache counts it. Batches that need a
host decision before they launch take the synchronous path: prefill chunks, speculative
verification, grammar-constrained rows, embeddings, P/D transfers (`Scheduler.overlappable`). On a
CPU the forward runs in the engine's thread anyway, so there is nothing to overlap and it stays off
unless asked for.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from ..device import to_device
from ..spec import Speculator
from ..text.structured import Grammars, apply_bitmask
from .sampling import PENDING, Picks, Rows, logprobs, sample, token_logprobs
from .sampling_params import TokenLogprob
from .scheduler import Batch, Chunk, Sampled
from .sequence import Sequence

SLOT_INDEXES_KEPT = 256  # batches of slots whose device index is kept (`_slot_index`)


@functools.lru_cache(maxsize=SLOT_INDEXES_KEPT)
def _slot_index(slots: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """`slots` on the device, read only, kept per batch of slots: consecutive decode steps run the
    same ones, and a fresh copy each step cost the host more than launching the step's graph."""
    return to_device(torch.tensor(slots, dtype=torch.long), device)


@dataclass
class Launched:
    """A step on its way: its batch, the cancelled sequences it reports, its start, what the host
    already has per chunk (verified drafts, prompt logprobs), and the device's sampled tokens
    (`picks`, row j for chunk `rows[j]`)."""

    batch: Batch
    cancelled: list[Sequence]
    t0: float
    sampled: list[Sampled] = field(init=False)
    rows: list[int] = field(default_factory=list)
    picks: Picks | None = None

    def __post_init__(self):
        self.sampled = [Sampled() for _ in self.batch.chunks]

    def read(self) -> list[Sampled]:
        """Each chunk's tokens on the host: waits for the device's picks to arrive."""
        if self.picks is not None:
            for i, tid, lp in zip(self.rows, *self.picks.read()):
                self.sampled[i].tokens, self.sampled[i].logprobs = [tid], [lp]
        return self.sampled


class ModelRunner:
    """Runs scheduled batches through `pipeline` on its local stage's device. `speculator` verifies
    drafts and follows the hidden states (MTP); `grammars` makes the constrained rows' masks."""

    def __init__(self, pipeline, n_slots: int, speculator: Speculator, grammars: Grammars):
        self.pipeline = pipeline
        self.device = torch.device(getattr(pipeline.local, "device", "cpu"))
        self.spec = speculator
        self.grammars = grammars
        if hasattr(pipeline, "side_state"):  # the MTP block's per-slot state moves with the slot's
            pipeline.side_state = speculator.side_state
        self._last = torch.zeros(n_slots, dtype=torch.long, device=self.device)  # each slot's latest sampled token

    def run(self, step: Launched, meanwhile=None) -> None:
        """Forward and sampling queued on the device; the sampled tokens start their copy to the host.
        `meanwhile` runs once the layers are queued (`Pipeline.forward`), before the sampling."""
        logits, hidden = self._forward(step.batch, meanwhile)
        self._sample(step.batch, logits, step)
        self._keep_hidden(step.batch, hidden)

    def _forward(self, batch: Batch, meanwhile=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits, the embedding chunks' hidden states or None). Inputs the host has not read yet
        (PENDING) are each slot's latest sampled token, taken on the device."""
        ids, slot_ids, pos, rows = batch.inputs()
        slots, positions = torch.tensor(slot_ids, dtype=torch.long), torch.tensor(pos, dtype=torch.long)
        rows = None if len(rows) == len(ids) else torch.tensor(rows, dtype=torch.long)  # decode: no gather
        if PENDING not in ids:
            tokens = torch.tensor(ids, dtype=torch.long)
        else:  # a plain decode step builds nothing on the host: every input is on the device already
            tokens = self._last[_slot_index(tuple(slot_ids), self.device)]
            if ids.count(PENDING) < len(ids):  # a mixed batch: the known inputs replace theirs
                known = to_device(torch.tensor(ids, dtype=torch.long), self.device)
                tokens = torch.where(known == PENDING, tokens, known)
        hidden_rows = batch.hidden_rows()
        if not (self.spec.wants_hidden or hidden_rows):
            argmax, ahead = self._argmax_alone(batch), self.spec.ahead(batch.chunks)
            logits = self.pipeline.forward(
                tokens, slots, positions, rows, meanwhile=meanwhile, argmax=argmax, ahead=ahead
            )
            return logits, None
        logits, hidden = self.pipeline.forward(tokens, slots, positions, rows, hidden=True, meanwhile=meanwhile)
        if self.spec.wants_hidden:
            self.spec.observe(tokens, slots, positions, hidden)  # the MTP block follows every token the target ran
        return logits, hidden[torch.tensor(hidden_rows).to(hidden.device)] if hidden_rows else None

    def _argmax_alone(self, batch: Batch) -> bool:
        """Whether every logits row of `batch` is read for its argmax alone (`Chunk.greedy_rows`). A last
        peer that holds the output then sends each row's argmax instead of the row (`Pipeline.forward`)."""
        if getattr(self.pipeline, "output_remote", None) is None:
            return False
        return all(c.greedy_rows for c in batch.chunks if c.sample or c.draft or c.score)

    @staticmethod
    def _keep_hidden(batch: Batch, hidden: torch.Tensor | None) -> None:
        """Each embedding chunk's rows go to its sequence (the output processor sends them whole)."""
        if hidden is None:
            return
        hidden, row = hidden.cpu(), 0
        for c in batch.chunks:
            if c.hidden:
                n = c.end - c.start
                c.seq.hidden.append(hidden[row : row + n])
                row += n

    def _sample(self, batch: Batch, logits: torch.Tensor, step: Launched) -> None:
        """Per chunk: the verified draft and the target's next token (on the host), or one token
        sampled on the device (`step.picks`), or none (a prompt chunk before the last); a scored chunk
        also gets its prompt logprobs."""
        to_sample: list[tuple[int, int]] = []  # (chunk index, its logits row)
        row = 0
        for i, c in enumerate(batch.chunks):
            if c.draft:  # k + 1 rows (a draft's filler has none: `Batch.inputs`)
                rows = logits[row : row + len(c.draft) + 1]
                tids = self.spec.verify(self._draft_mask(rows, c), c.draft, c.seq.sampler, c.seq.tokens, c.seq.slot)
                step.sampled[i] = Sampled(tids, self._draft_logprobs(c.seq, rows, tids))
                row += len(c.draft) + 1
            elif c.score:
                n = c.end - c.start
                step.sampled[i].prompt_logprobs = self._score_prompt(c, logits[row : row + n])
                row += n
                if c.sample:
                    to_sample.append((i, row - 1))
            elif c.sample:
                to_sample.append((i, row))
                row += 1
        if not to_sample:
            return
        seqs = [batch.chunks[i].seq for i, _ in to_sample]
        ends = [batch.chunks[i].end for i, _ in to_sample]
        idx = [r for _, r in to_sample]
        rows = logits if idx == list(range(logits.shape[0])) else logits[idx]  # decode-only steps: no copy
        slots = _slot_index(tuple(s.slot for s in seqs), self.device)
        in_flight = any(e > len(s.tokens) for s, e in zip(seqs, ends))  # a penalty window ends on a PENDING token
        picked = Rows.build(
            [s.sampler for s in seqs],
            [s.tokens for s in seqs],
            rows.device,
            ends,
            self._last[slots] if in_flight else None,
        )
        step.picks = sample(rows, picked, self._mask(seqs)).copy()
        self._last[slots] = step.picks.tokens  # the next step's input, should it launch before this one is read
        step.rows = [i for i, _ in to_sample]

    @staticmethod
    def _draft_logprobs(seq: Sequence, rows: torch.Tensor, tids: list[int]) -> list[TokenLogprob | None]:
        """Row j's logprob of `tids[j]` and its top alternatives (row j follows the tokens so far and
        the j accepted draft tokens before it), when the request asked for them."""
        if seq.req.params.logprobs is None:
            return [None] * len(tids)
        n = len(tids)
        picked = Rows.build([seq.sampler] * n, [seq.tokens + tids[:j] for j in range(n)], rows.device)
        return logprobs(rows[:n], picked, tids)

    def _mask(self, seqs: list[Sequence]):
        """The grammar mask of the constrained rows among `seqs` (None when there are none), applied
        after the logit bias; the raw rows stay for the logprobs. Others' rows pay nothing."""
        constrained = [i for i, s in enumerate(seqs) if s.req.constraint is not None]
        if not constrained:
            return None
        bitmask = self.grammars.bitmask(
            [seqs[i].req.constraint for i in constrained], pinned=self.device.type == "cuda"
        )

        def mask(x: torch.Tensor) -> torch.Tensor:
            if len(constrained) == len(seqs):
                return apply_bitmask(x, bitmask)
            idx = torch.tensor(constrained, device=x.device)
            return x.index_copy(0, idx, apply_bitmask(x[idx], bitmask))

        return mask

    def _draft_mask(self, rows: torch.Tensor, c: Chunk) -> torch.Tensor:
        """A draft's k+1 verified rows with, row by row, the grammar's mask after the draft tokens
        before that row: a draft the grammar refuses is rejected there (the logit bias comes in the
        sampler: a ban and a mask commute)."""
        constraint = c.seq.req.constraint
        if constraint is None:
            return rows
        mask = torch.empty((rows.shape[0], self.grammars.words), dtype=torch.int32, pin_memory=rows.is_cuda)
        constraint.draft_bitmask(c.draft.tokens, mask)
        return apply_bitmask(rows, mask)

    @staticmethod
    def _score_prompt(c: Chunk, logits: torch.Tensor) -> list[TokenLogprob]:
        """Row p predicts token p+1: the logprobs of the prompt tokens this chunk's rows predict."""
        seq = c.seq
        targets = seq.tokens[c.start + 1 : min(c.end + 1, seq.n_prompt)]
        out = token_logprobs(logits[: len(targets)], targets, seq.req.prompt_logprobs)
        if c.start == 0:
            out.insert(0, TokenLogprob(seq.tokens[0], None, []))
        return out
