"""The one owner of the slots' KV and recurrent memory, asked by the scheduler.

The model holds the memory: each Stage's block table (model/kv_blocks.py: a block of a whole
context per slot, or a `--kv-unified` pool the slots take blocks from as they grow) and its
recurrent (DeltaNet) state rows. A stage fits blocks as it writes positions and refuses a step its
pool cannot hold (KVPoolFull), a peer's stage alike: that is its guard, not a policy. Every decision
about that memory is made here:

- `take`: which free slot a request gets and how much of its prompt the slot's KV already holds
  (the prompt cache: the tokens a finished request left in an idle slot; a recurrent state cannot
  be cut back, so there only a prompt extending all the slot holds reuses it);
- `fits`: whether the slots can hold a step's lengths (the idle slots' prompt cache counts as free);
- `make_room`: the idle slots' prompt cache taken back, on every stage, for a step that needs it;
- `release`: a slot left by its sequence keeps what its KV holds as prompt cache;
- `shift`: a busy slot's context shift (`--context-shift`), on every stage;
- `cached` / `hold` / `idle_holding`: the prompt cache /slots saves, restores, erases and P/D hands over.

The pool is read from the head's own stage: the head's forwards and clears reach every stage, so
each holds the same blocks per slot. The prompt cache is valid while the pipeline's
`kv_generation` (bumped whenever a stage lost KV: a rebuild, a re-split, an eviction) is the one it
was recorded under. The drafters' own stages keep pools of the same size that follow the target's:
the MTP block's slot is cleared with the target's (`Pipeline.clear_slot`), a draft model's when its
request leaves (its KV is never reused).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from ..model.kv_blocks import KVBlocks
    from .sequence import Request

log = logging.getLogger("hydra.kv")


class KVManager:
    """The memory of `n_slots` slots: `blocks` (the head stage's table; None or reserved: every slot
    holds its whole context, nothing to decide), a `recurrent` model's state, `kv_generation()` (the
    pipeline's count of KV losses) and `evict(slots)` (clears idle slots on every stage)."""

    def __init__(
        self,
        n_slots: int,
        blocks: KVBlocks | None = None,
        *,
        recurrent: bool = False,
        kv_generation: Callable[[], int] = lambda: 0,
        evict: Callable[[list[int]], None] | None = None,
        shift: Callable[[int, int, int, int], None] | None = None,
    ):
        self.blocks = blocks if blocks is not None and blocks.pooled else None
        self.recurrent = recurrent
        self._kv_generation = kv_generation
        self._generation = kv_generation()
        self._evict = evict
        self._shift = shift
        self._cached: list[list[int]] = [[] for _ in range(n_slots)]
        # Slots a sequence holds. A list, not a set: other threads read it (`busy_slots`) while the
        # engine thread takes and releases slots.
        self._busy = [False] * n_slots

    @classmethod
    def of(cls, pipeline, n_slots: int) -> KVManager:
        """The owner of `pipeline`'s slots (a stand-in without stages or KV losses: reserved slots)."""
        return cls(
            n_slots,
            getattr(getattr(pipeline, "local", None), "kv_blocks", None),
            recurrent=getattr(getattr(pipeline, "cfg", None), "recurrent", False),
            kv_generation=lambda: getattr(pipeline, "kv_generation", 0),
            evict=getattr(pipeline, "evict", None),
            shift=getattr(pipeline, "kv_shift", None),
        )

    def busy_slots(self) -> set[int]:
        """Slots a sequence holds: the KV a rebuild replays and no eviction takes."""
        return {slot for slot, busy in enumerate(self._busy) if busy}

    # ---- the scheduler's questions -------------------------------------------------------------

    def take(self, free: list[int], req: Request) -> tuple[int, int]:
        """The slot of `free` for `req` and the prompt tokens its KV already holds: the slot with the
        longest prefix of the prompt, else the one with the least cached (other prefixes stay for
        their requests). A scored prompt needs every row's logits, an embedding every row's hidden
        state: they reuse nothing. At least the last prompt token is run (its logits); positions
        past the reused ones are overwritten, nothing needs clearing. The slot's cache is spent."""
        self._check_generation()

        def shared(j: int) -> int:
            n = _common_prefix(self._cached[j], req.prompt) if req.cache_prompt else 0
            return 0 if self.recurrent and n < len(self._cached[j]) else n

        slot = max(free, key=lambda j: (shared(j), -len(self._cached[j])))
        reused = 0
        if req.cache_prompt and req.prompt_logprobs is None and not req.embedding:
            reused = max(0, min(shared(slot), len(req.prompt) - 1))
        self._cached[slot] = []
        self._busy[slot] = True
        return slot, reused

    def release(self, slot: int, tokens: list[int]) -> None:
        """The slot's sequence left it; its KV holds `tokens` (none: not trusted), the prompt cache."""
        self._busy[slot] = False
        self._cached[slot] = tokens

    def shift(self, slot: int, keep: int, discard: int, n: int) -> None:
        """Busy `slot`'s context shift: of the `n` positions it holds, [keep, keep + discard) go and
        the rest move down, on every stage (`Pipeline.kv_shift`: K re-rotated). Its prompt cache,
        recorded at `release`, is the sequence's tokens after the shift, which match."""
        if self._shift is None:
            raise ValueError("this pipeline cannot shift a slot's KV")
        self._shift(slot, keep, discard, n)

    def fits(self, ends: dict[int, int]) -> bool:
        """Whether the slots can hold these lengths ({slot: positions}) beside the busy slots' KV:
        always with reserved slots; a pool counts the idle slots' prompt cache as free (`make_room`
        takes it back when a step needs it)."""
        if self.blocks is None:
            return True
        keep = self.busy_slots() | ends.keys()
        idle = sum(len(held) for slot, held in enumerate(self.blocks.held) if slot not in keep)
        return self.blocks.shortfall(ends) <= idle

    def make_room(self, ends: dict[int, int]) -> None:
        """A pool short of blocks for a step about to run ({slot: positions}) takes back every idle
        slot's prompt cache, on every stage. Still short: the stages refuse the step (KVPoolFull)
        before computing anything."""
        if self.blocks is None or self._evict is None or not self.blocks.shortfall(ends):
            return
        keep = self.busy_slots() | ends.keys()
        idle = [slot for slot, held in enumerate(self.blocks.held) if held and slot not in keep]
        if idle:
            self._evict(idle)  # bumps the pipeline's kv_generation: every idle slot's cache goes
            log.info("KV pool short: took back the prompt cache of %d idle slots", len(idle))

    # ---- the prompt cache of idle slots (/slots, P/D) ------------------------------------------

    def cached(self, slot: int) -> list[int]:
        """The tokens whose KV `slot` holds for the next request (its prompt cache)."""
        self._check_generation()
        return list(self._cached[slot])

    def hold(self, slot: int, tokens: list[int]) -> None:
        """`slot`'s prompt cache is now `tokens` (a state placed into it; none: emptied)."""
        self._cached[slot] = list(tokens)

    def idle_holding(self, tokens: list[int]) -> int | None:
        """An idle slot whose prompt cache is exactly `tokens`, or None."""
        self._check_generation()
        for slot, cached in enumerate(self._cached):
            if not self._busy[slot] and cached == tokens:
                return slot
        return None

    def _check_generation(self) -> None:
        """A stage lost KV since the prompt cache was recorded: only the busy slots' was rebuilt."""
        generation = self._kv_generation()
        if generation != self._generation:
            self._cached = [[] for _ in self._cached]
            self._generation = generation


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
