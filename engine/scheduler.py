"""The scheduler: which sequences hold the slots and what goes into the next forward.

It only changes sequence state (nano-vllm's scheduler): `admit` fills free slots from the FIFO
queue, `schedule` builds a `Batch` (prompt chunks within a token budget, one token per decoding
sequence, speculative drafts), `postprocess` appends what the step sampled, advances `n_past` and
marks sequences finished on end-of-generation or length. No thread, no text, no forward: the
engine runs the batch and the output processor turns tokens into text.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from .config import DEFAULT_BATCH_TOKENS  # noqa: F401  (the engine's default, set by --batch-size)
from .sampling import TokenLogprob
from .sequence import Request, Sequence

if TYPE_CHECKING:
    from .speculative import Draft, Speculator

# Prompt-scoring chunks are smaller: each row brings a full-vocabulary logits row.
SCORING_CHUNK = 64


@dataclass
class Chunk:
    """One sequence's share of a batch: tokens [start, end) of `seq.tokens`, whether the step samples
    its next token (its last row's logits), whether every row is scored (prompt logprobs), and a
    draft proposed after `seq.tokens[start]`, verified in this step (k+1 rows)."""

    seq: Sequence
    start: int
    end: int
    sample: bool
    score: bool = False
    draft: Draft | None = None

    @property
    def prefill(self) -> bool:
        return self.start < self.seq.n_prompt

    @property
    def hidden(self) -> bool:
        """An embedding request's chunk: every row's hidden state comes back, no logits."""
        return self.seq.req.embedding


@dataclass
class Batch:
    """The next forward: its chunks, flattened by `inputs()` into one row per token."""

    chunks: list[Chunk] = field(default_factory=list)

    def inputs(self) -> tuple[list[int], list[int], list[int], list[int]]:
        """(token ids, slots, positions, logits rows): the arguments of `Pipeline.forward`."""
        tokens, slots, positions, rows = [], [], [], []
        for c in self.chunks:
            drafted = c.draft.tokens if c.draft else []
            n = c.end - c.start + len(drafted)
            first_row = len(tokens)
            tokens += c.seq.tokens[c.start : c.end] + drafted
            slots += [c.seq.slot] * n
            positions += range(c.start, c.start + n)
            if c.score or drafted:
                rows += range(first_row, first_row + n)
            elif c.sample:
                rows.append(first_row + n - 1)
        return tokens, slots, positions, rows

    def hidden_rows(self) -> list[int]:
        """Rows of `inputs()` whose final-norm hidden states the step returns (embedding chunks)."""
        rows, first = [], 0
        for c in self.chunks:
            n = c.end - c.start + (len(c.draft.tokens) if c.draft else 0)
            if c.hidden:
                rows += range(first, first + n)
            first += n
        return rows

    @property
    def n_prefill(self) -> int:
        return sum(c.end - c.start for c in self.chunks if c.prefill)


@dataclass
class Sampled:
    """What a step got for one chunk: the tokens to append (a verified draft gives several), their
    logprobs when asked, and the prompt logprobs of a scored chunk."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob | None] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None


class Scheduler:
    """Continuous batching over `n_slots` slots of `n_ctx` tokens. `mixed_steps`: prefill chunks ride
    along with the decoding sequences' tokens (True) or a step with prefill runs only prefill
    (False). `speculator` proposes drafts for the decoding sequences (`plan`) and hears when a slot
    is taken or left (`start`, `release`); `eog_ids` end a request unless it ignores them."""

    def __init__(self, n_slots: int, n_ctx: int, batch_tokens: int, mixed_steps: bool, speculator: Speculator,
                 eog_ids: set[int], kv_generation: Callable[[], int] = lambda: 0, recurrent: bool = False):  # fmt: skip
        self.n_ctx = n_ctx
        self.batch_tokens = batch_tokens
        self.mixed_steps = mixed_steps
        self.spec = speculator
        self.eog_ids = eog_ids
        self.slots: list[Sequence | None] = [None] * n_slots
        self.waiting: deque[Request] = deque()
        self._next_id = 0
        # Prompt cache: the tokens whose KV a finished request left in each idle slot, valid while
        # the pipeline's KV generation is the one they were recorded under.
        self.cached: list[list[int]] = [[] for _ in range(n_slots)]
        self._kv_generation = kv_generation
        self._cached_generation = kv_generation()
        # A recurrent model's state cannot be cut back to a shorter prefix: only a whole cached
        # sequence is reusable there (the last position re-run is within its checkpoints).
        self.recurrent = recurrent

    @property
    def running(self) -> list[Sequence]:
        return [s for s in self.slots if s is not None]

    def add(self, req: Request) -> None:
        self._next_id += 1
        req.id = self._next_id
        self.waiting.append(req)

    def admit(self) -> list[Sequence]:
        """End cancelled sequences (returned: they still owe their consumer a final event), drop
        cancelled requests from the queue, then fill free slots in arrival order."""
        cancelled = [s for s in self.running if s.req.cancelled]
        for seq in cancelled:
            seq.finish_reason = "cancelled"
            self.free(seq)
        if any(r.cancelled for r in self.waiting):
            self.waiting = deque(r for r in self.waiting if not r.cancelled)
        if self._kv_generation() != self._cached_generation:
            self.cached = [[] for _ in self.slots]
            self._cached_generation = self._kv_generation()
        free = [i for i, s in enumerate(self.slots) if s is None]
        while free and self.waiting:
            req = self.waiting.popleft()
            # The free slot holding the longest prefix of this prompt, else the one with the least
            # cached (keep other prefixes for their requests); its KV rows need no clearing:
            # positions >= n_past are overwritten.
            def shared(j: int) -> int:
                n = _common_prefix(self.cached[j], req.prompt) if req.cache_prompt else 0
                return 0 if self.recurrent and n < len(self.cached[j]) else n

            i = max(free, key=lambda j: (shared(j), -len(self.cached[j])))
            free.remove(i)
            seq = self.slots[i] = Sequence(req, i)
            req.slot = i
            # A scored prompt needs every row's logits, an embedding every row's hidden state.
            if req.cache_prompt and req.prompt_logprobs is None and not req.embedding:
                seq.n_past = seq.n_cached = max(0, min(shared(i), len(req.prompt) - 1))
            self.cached[i] = []
            self.spec.start(i, seq.tokens)
        return cancelled

    def free(self, seq: Sequence) -> None:
        if self.slots[seq.slot] is seq:
            self.slots[seq.slot] = None
            self.spec.release(seq.slot)
            # What a failed step left in the slot is not trusted.
            self.cached[seq.slot] = seq.tokens[: seq.n_past] if seq.finish_reason != "error" else []

    def schedule(self) -> Batch:
        """Decoding sequences take one token each, plus their drafts (unless prefill runs alone);
        prefill chunks share what is left of the token budget, oldest request first."""
        running = [s for s in self.running if not s.remote_prefill]  # their state is still on its way
        decoding = [s for s in running if not s.prefilling]
        if not self.mixed_steps and len(decoding) < len(running):
            decoding = []
        drafts = self.spec.plan(decoding, self.n_ctx)
        chunks = [Chunk(s, s.n_past, s.n_past + 1, True, False, d) for s, d in zip(decoding, drafts)]
        budget = max(self.batch_tokens - len(chunks) - sum(len(d) for d in drafts if d), 1)
        for s in sorted((s for s in running if s.prefilling), key=lambda s: s.req.id):
            if budget <= 0:
                break
            score = s.req.prompt_logprobs is not None
            n = min(s.n_prompt - s.n_past, budget, SCORING_CHUNK if score else budget)
            end = s.n_past + n
            chunks.append(Chunk(s, s.n_past, end, end == s.n_prompt and s.req.max_tokens > 0, score))
            budget -= n
        return Batch(chunks)

    def postprocess(self, batch: Batch, sampled: list[list[int]]) -> None:
        """Advance each chunk's sequence past what the step computed and append its sampled tokens,
        stopping at the first that ends it. Rejected draft positions stay behind `n_past`: their KV
        (here and on peers) is overwritten by the next step."""
        for c, tokens in zip(batch.chunks, sampled):
            seq = c.seq
            seq.n_past = c.end
            if c.draft:
                accepted = len(tokens) - 1
                seq.n_past += accepted
                seq.n_drafted += len(c.draft)
                seq.n_accepted += accepted
            for tid in tokens:
                seq.append(tid)
                if tid in self.eog_ids and not seq.req.ignore_eos:
                    seq.finish_reason, seq.at_eog = "stop", True
                    break
                if seq.req.constraint is not None and seq.req.constraint.finished:  # the grammar is complete
                    seq.finish_reason = "stop"
                    break
                if seq.n_gen >= seq.req.max_tokens or len(seq.tokens) >= self.n_ctx:
                    seq.finish_reason = "length"
                    break
            if not seq.prefilling and seq.req.max_tokens == 0:
                seq.finish_reason = "length"


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
