"""The scheduler: which sequences hold the slots and what goes into the next forward.

It only changes sequence state (nano-vllm's scheduler): `admit` fills free slots from the FIFO
queue, `schedule` builds a `Batch` (prompt chunks within a token budget, one token per decoding
sequence, speculative drafts), `launched` advances `n_past` past what a launched batch computes,
`postprocess` appends what the step sampled and marks sequences finished on end-of-generation or
length. No thread, no text, no forward: the engine runs the batch and the output processor turns
tokens into text.

Overlap (the runtime's): a plain decoding batch may be scheduled before the host has read the
previous step's tokens. A sequence then has a token in flight: `n_past` already counts the position
the previous step ran, and `Batch.inputs` gives PENDING for an input the host does not hold yet (the
engine takes it from the device). A sequence whose in-flight token reaches max_tokens or the context
is not scheduled again; one that ends on an end-of-generation token or a stop string was already in
the next batch, whose row for it the engine drops.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .context_shift import ContextShift
from .kv_manager import KVManager
from .sampling import PENDING
from .sampling_params import TokenLogprob
from .sequence import Request, Sequence

if TYPE_CHECKING:
    from ..spec import Draft, Speculator

log = logging.getLogger("hydra.scheduler")

# Prompt-scoring chunks are smaller: each row brings a full-vocabulary logits row.
SCORING_CHUNK = 64
# The error of a sequence shed from a batch (`Batch.shed`): llama-server's for a full context.
SHED = (
    "KV pool full: the context size has been exceeded, this request does not fit beside the others "
    "(-c/--ctx-size sets the pool with --kv-unified)"
)


@dataclass
class Chunk:
    """One sequence's share of a batch: tokens [start, end) of `seq.tokens`, whether the step samples
    its next token (its last row's logits), whether every row is scored (prompt logprobs), and a
    draft proposed after `seq.tokens[start]`, verified in this step (k+1 rows, and its filler's)."""

    seq: Sequence
    start: int
    end: int
    sample: bool
    score: bool = False
    draft: Draft | None = None

    @property
    def prefill(self) -> bool:
        return self.start + self.seq.n_discarded < self.seq.n_prompt

    @property
    def hidden(self) -> bool:
        """An embedding request's chunk: every row's hidden state comes back, no logits."""
        return self.seq.req.embedding

    @property
    def greedy_rows(self) -> bool:
        """Whether its logits rows are read for their argmax alone: greedy, no logit bias (an ignored
        EOS is one), penalty, grammar, logprobs or prompt scoring."""
        p = self.seq.req.params
        plain = not self.score and self.seq.req.constraint is None and p.logprobs is None
        return plain and p.greedy and not p.penalised and not p.logit_bias


@dataclass
class Batch:
    """The next forward: its chunks, flattened by `inputs()` into one row per token."""

    chunks: list[Chunk] = field(default_factory=list)
    # Sequences a pooled KV cache could not hold, ended by this schedule (their consumers are owed
    # an error): the others go on.
    shed: list[Sequence] = field(default_factory=list)

    def inputs(self) -> tuple[list[int], list[int], list[int], list[int]]:
        """(token ids, slots, positions, logits rows): the arguments of `Pipeline.forward`; PENDING
        stands for a token the previous step sampled that the host has not read yet."""
        tokens, slots, positions, rows = [], [], [], []
        for c in self.chunks:
            drafted = c.draft.run if c.draft else []
            n = c.end - c.start + len(drafted)
            first_row = len(tokens)
            known = c.seq.tokens[c.start : c.end]
            tokens += known + [PENDING] * (c.end - c.start - len(known)) + drafted
            slots += [c.seq.slot] * n
            positions += range(c.start, c.start + n)
            if c.score or drafted:  # a draft's filler rows need no logits
                rows += range(first_row, first_row + n - (c.draft.filler if c.draft else 0))
            elif c.sample:
                rows.append(first_row + n - 1)
        return tokens, slots, positions, rows

    def hidden_rows(self) -> list[int]:
        """Rows of `inputs()` whose final-norm hidden states the step returns (embedding chunks)."""
        rows, first = [], 0
        if not any(c.hidden for c in self.chunks):
            return rows
        for c in self.chunks:
            n = c.end - c.start + (len(c.draft.run) if c.draft else 0)
            if c.hidden:
                rows += range(first, first + n)
            first += n
        return rows

    @property
    def n_prefill(self) -> int:
        return sum(c.end - c.start for c in self.chunks if c.prefill)


def mixed_by_default(device_type: str) -> bool:
    """Whether prefill chunks ride along with the decoding slots' tokens in one forward (True) or a
    step with prefill runs only prefill (False, nano-vllm's way), unless asked. Measured with
    benchmarks/bench_api.py --scheduling (4 streams decoding, a 512-token prompt arrives): on an H200
    (1.1B llama) prefill-only wins everything — TTFT 154 vs 526 ms, longest decode stall 155 vs 201
    ms, 477 vs 288 tok/s — since a mixed step loses the CUDA-graph decode path; on CPU (Gemma 3 270M,
    2 cores) mixing halves the decoders' longest stall (290-384 vs 642-669 ms) at a similar TTFT
    (636-857 vs 607-632 ms) and throughput (43-53 vs 44-48 tok/s). So: mixed off CUDA."""
    return device_type != "cuda"


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
    is taken or left (`start`, `release`); `eog_ids` end a request unless it ignores them.
    `context_shift`: a generating sequence whose slot is full shifts its context and goes on
    (None: it ends there, "length", truncated)."""

    def __init__(
        self,
        n_slots: int,
        n_ctx: int,
        batch_tokens: int,
        mixed_steps: bool,
        speculator: Speculator,
        eog_ids: set[int],
        kv: KVManager | None = None,
        context_shift: ContextShift | None = None,
    ):
        """`kv`: the owner of the slots' KV and recurrent memory, asked which slot a request takes,
        what its prompt cache saves and whether a step fits (None: reserved slots, nothing lost)."""
        self.n_ctx = n_ctx
        self.kv = kv or KVManager(n_slots)
        self.batch_tokens = batch_tokens
        self.mixed_steps = mixed_steps
        self.spec = speculator
        self.eog_ids = eog_ids
        self.context_shift = context_shift
        self.slots: list[Sequence | None] = [None] * n_slots
        self.waiting: deque[Request] = deque()
        self._next_id = 0

    @property
    def running(self) -> list[Sequence]:
        return [s for s in self.slots if s is not None]

    def add(self, req: Request) -> None:
        self._next_id += 1
        req.id = self._next_id
        self.waiting.append(req)

    def admit(self) -> list[Sequence]:
        """End cancelled sequences (returned: they still owe their consumer a final event), drop
        cancelled requests from the queue, then fill free slots in arrival order (a request pinned
        to a busy slot by its id_slot keeps its place; those behind it go on)."""
        # A sequence whose prompt state is on its way keeps its slot until the transfer ends: the
        # state may be going into the slot right now (the engine frees it then).
        cancelled = [s for s in self.running if s.req.cancelled and not s.remote_prefill]
        for seq in cancelled:
            seq.finish_reason = "cancelled"
            self.free(seq)
        if any(r.cancelled for r in self.waiting):
            self.waiting = deque(r for r in self.waiting if not r.cancelled)
        free = [i for i, s in enumerate(self.slots) if s is None]
        pinned_waiting: deque[Request] = deque()  # asked for a slot that is busy: they keep their place
        while free and self.waiting:
            req = self.waiting.popleft()
            if req.id_slot >= 0 and req.id_slot not in free:
                pinned_waiting.append(req)
                continue
            i, reused = self.kv.take([req.id_slot] if req.id_slot >= 0 else free, req)
            free.remove(i)
            seq = self.slots[i] = Sequence(req, i)
            req.slot = i
            seq.n_past = seq.n_cached = reused
            self.spec.start(i, seq.tokens)
        pinned_waiting.extend(self.waiting)
        self.waiting = pinned_waiting
        return cancelled

    def free(self, seq: Sequence) -> None:
        if self.slots[seq.slot] is seq:
            self.slots[seq.slot] = None
            self.spec.release(seq.slot)
            # What a failed step left in the slot is not trusted. With a token in flight, `n_past`
            # still equals the tokens the host holds: the step in flight runs the last of them.
            self.kv.release(seq.slot, seq.tokens[: seq.n_past] if seq.finish_reason != "error" else [])

    def overlappable(self) -> bool:
        """Whether the next batch may launch before the host reads the step in flight: only when every
        running sequence just decodes (its next input is the token the device already holds). Prefill
        chunks, speculative drafts (they read the tokens so far), grammar masks (the matcher advances
        on the host), embeddings and P/D transfers need the host first; so does a context shift (it
        moves the tokens the next input is read after)."""
        return (
            bool(self.running)
            and self.spec.mtp is None  # the MTP block follows every token: each step's inputs are read first
            and all(
                not s.prefilling
                and not s.remote_prefill
                and s.req.constraint is None
                and not s.req.embedding
                and not (s.req.spec or self.spec.config).active
                and not self._full(s)
                for s in self.running
            )
        )

    def schedule(self) -> Batch:
        """Decoding sequences take one token each, plus their drafts; prefill chunks share what is
        left of the token budget, oldest request first. Without mixed steps a step with prefill runs
        only prefill, unless no prompt has room in the KV pool: the decoding sequences run then (they
        end and give blocks back)."""
        running = [s for s in self.running if not s.remote_prefill]  # their state is still on its way
        prefilling = sorted((s for s in running if s.prefilling), key=lambda s: s.req.id)
        if not self.mixed_steps and prefilling:
            chunks, _ = self._prefill([], prefilling, self.batch_tokens)
            if chunks:
                return Batch(chunks)
        # With a token in flight that reaches max_tokens or the context, a sequence is done.
        decoding, done = [], []
        for s in running:
            if not s.prefilling:
                if self._full(s):  # nothing in flight then (not `overlappable`)
                    self._shift(s)
                last = s.n_past + s.n_discarded + 1 - s.n_prompt >= s.req.max_tokens or s.n_past + 1 >= self.n_ctx
                (done if last else decoding).append(s)
        drafts = self.spec.plan(decoding, self.n_ctx)
        chunks = [Chunk(s, s.n_past, s.n_past + 1, True, False, d) for s, d in zip(decoding, drafts)]
        # A KV pool without room for every sequence's next positions: the newest wait for the oldest
        # to end and give their blocks back.
        chunks.sort(key=lambda c: c.seq.req.id)
        blocked = bool(prefilling) and not self.mixed_steps  # here: no prompt had room
        while chunks and not self.kv.fits(_ends(chunks)):
            blocked = bool(chunks.pop())
        if self.mixed_steps:
            budget = max(self.batch_tokens - len(chunks) - sum(len(c.draft.run) for c in chunks if c.draft), 1)
            chunks, waiting = self._prefill(chunks, prefilling, budget)
            blocked = blocked or waiting
        if not chunks and blocked:
            return self._shed(running, done)
        return Batch(chunks)

    def _full(self, s: Sequence) -> bool:
        """A generating sequence due a context shift: its next position would be the slot's last
        (llama-server shifts there, one position early)."""
        return self.context_shift is not None and not s.prefilling and s.n_past + 1 >= self.n_ctx

    def _shift(self, s: Sequence) -> None:
        keep, discard = self.context_shift.plan(s, self.n_ctx)
        log.info("slot %d: context shift, n_keep = %d, n_discard = %d of %d", s.slot, keep, discard, s.n_past)
        self.kv.shift(s.slot, keep, discard, s.n_past)
        s.shift(keep, discard)

    def _prefill(self, chunks: list[Chunk], prefilling: list[Sequence], budget: int) -> tuple[list[Chunk], bool]:
        """`chunks` and the prompt chunks of `prefilling` (in order) that fit beside them in `budget`
        tokens; and whether a prompt waits for room in the KV pool."""
        for s in prefilling:
            if budget <= 0:
                return chunks, False
            score = s.req.prompt_logprobs is not None
            n = min(s.n_prompt - s.n_past, budget, SCORING_CHUNK if score else budget)
            end = s.n_past + n
            # A prompt starts only when the pool can hold all of it.
            if not self.kv.fits({**_ends(chunks), s.slot: end if s.n_past > s.n_cached else s.n_prompt}):
                return chunks, True
            chunks = [*chunks, Chunk(s, s.n_past, end, end == s.n_prompt and s.req.max_tokens > 0, score)]
            budget -= n
        return chunks, False

    def _shed(self, running: list[Sequence], done: list[Sequence]) -> Batch:
        """Nothing fits the KV pool. Sequences whose last token is in flight give their blocks back
        once the host reads it: an empty batch waits for them. Else the newest sequence that holds KV
        ends with an error (llama-server's "context size has been exceeded"), never as if it had
        reached its length, and its blocks go to the others; prompts waiting for room hold none and
        wait on (unless no running sequence holds any: the newest ends, rather than wait unbounded)."""
        if done:
            return Batch()
        seq = max([s for s in running if s.n_past > 0] or running, key=lambda s: s.req.id)
        seq.finish_reason = "error"
        self.free(seq)
        return Batch([], [seq])

    def launched(self, batch: Batch) -> None:
        """The batch is on its way: each chunk's sequence has its KV through `c.end` (the next
        schedule continues there, before the host reads what this one samples). A pool short of
        blocks for it takes back the idle slots' prompt cache first."""
        self.kv.make_room(_ends(batch.chunks))
        for c in batch.chunks:
            c.seq.n_past = max(c.seq.n_past, c.end)

    def postprocess(self, batch: Batch, sampled: list[list[int]]) -> None:
        """Advance each chunk's sequence past what the step computed and append its sampled tokens,
        stopping at the first that ends it. Rejected draft positions (and a draft's filler) stay
        behind `n_past`: their KV (here and on peers) is overwritten by the next step."""
        for c, tokens in zip(batch.chunks, sampled):
            seq = c.seq
            seq.n_past = max(seq.n_past, c.end)
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
                if len(seq.tokens) >= self.n_ctx and self.context_shift is None:  # llama-server's truncated
                    seq.finish_reason, seq.truncated = "length", True
                    break
                if seq.n_gen >= seq.req.max_tokens:
                    seq.finish_reason = "length"
                    break
            if not seq.prefilling and seq.req.max_tokens == 0:
                seq.finish_reason = "length"


def _ends(chunks: list[Chunk]) -> dict[int, int]:
    """The positions each chunk's slot holds once the chunk (and its draft) ran."""
    return {c.seq.slot: c.end + (len(c.draft.run) if c.draft else 0) for c in chunks}
