"""llama-server's context shift (`--context-shift`): which tokens a full slot keeps.

When a generating slot's KV is full (its next position would be the context's last), llama-server
keeps the first `n_keep` tokens (+ the BOS), drops half of the rest and goes on with the tokens
after them moved down (tools/server/server-context.cpp, `pre_decode`). This module is only that
arithmetic; the scheduler applies it to the sequence and the KV manager to the KV
(`Stage.kv_shift`: K turned back by RoPE).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .sequence import Sequence

# A request's max_tokens without a bound (llama-server's n_predict -1): it ends on an
# end-of-generation token, a stop string, a grammar's end or, without context shift, the context's end. No torch here: the HTTP layer
# reads it before the model loads.
UNLIMITED = 2**31 - 1


def n_predict_of(max_tokens: int) -> int:
    """A request's max_tokens as llama-server reports its n_predict: -1 when unbounded."""
    return -1 if max_tokens == UNLIMITED else max_tokens


@dataclass(frozen=True)
class ContextShift:
    """`n_keep`: the server's `--keep` (prompt tokens kept; -1: all of the prompt), a request's
    `n_keep` over it; `add_bos`: the tokenizer adds a BOS, kept on top (llama-server's)."""

    n_keep: int = 0
    add_bos: bool = True

    def plan(self, seq: Sequence, n_ctx: int) -> tuple[int, int]:
        """(keep, discard) for `seq`, whose KV holds `seq.n_past` of a slot's `n_ctx` positions:
        positions [keep, keep + discard) go (the request's `n_discard`, else half of those after the
        kept ones; at least one stays, llama.cpp's clamp)."""
        n_keep = seq.req.n_keep if seq.req.n_keep is not None else self.n_keep
        keep = seq.n_prompt if n_keep < 0 else n_keep
        keep = max(0, min(n_ctx - 4, keep + self.add_bos))
        left = seq.n_past - keep
        discard = seq.req.n_discard or left // 2
        return keep, max(0, min(discard, left - 1))
