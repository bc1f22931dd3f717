"""Structured output on llguidance: a request's JSON Schema / GBNF / Lark grammar as a token mask.

The API turns a request's `response_format`, `json_schema` or `grammar` into one llguidance grammar
(`compile_grammar`; a bad one is an `InvalidParam` naming the field, so a 400 before anything runs)
and gives each engine request its own `Constraint` (a matcher built over the model's llguidance
tokenizer, which `Grammars` builds once per model, on first use: ~4 s for a 262k vocabulary).

In the engine step the constrained rows of the logits get their allowed-token bitmask: computed
on the host (one bit per token, llguidance's own format, ~0.05 ms per sequence), copied to the
logits' device as int32 words and unpacked there (`apply_bitmask`), so the full logits never go
to the host for it. Rows of unconstrained requests are untouched. A verified speculative draft
gets one mask per row, each after the draft tokens before it (`Constraint.draft_bitmask`); the
matcher is rolled back afterwards and advances only by the tokens the step accepts.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import llguidance
import torch

from ..serving.sampling_params import InvalidParam
from .tokenizer import CONTROL, UNKNOWN, Tokenizer

# JSON as compact as the schema allows: a free-whitespace grammar lets a model pad forever.
_JSON_OPTIONS = {"whitespace_flexible": False}


def compile_grammar(kind: str, source: Any, param: str) -> str:
    """The llguidance grammar of `source` ("json_schema": a schema dict; "gbnf": GBNF text, which
    may also be Lark; "lark"), checked; an error is an InvalidParam naming `param`."""
    try:
        if kind == "json_schema":
            if not isinstance(source, dict):
                raise ValueError("a JSON schema must be an object")
            grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(source), defaults=_JSON_OPTIONS)
        elif kind == "gbnf":
            if not isinstance(source, str) or not source.strip():
                raise ValueError("a grammar must be non-empty text")
            grammar = llguidance.grammar_from("gbnf", source)
        else:
            grammar = llguidance.grammar_from(kind, source)
    except (ValueError, TypeError) as e:
        raise InvalidParam(f"invalid {param}: {e}", param) from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise InvalidParam(f"invalid {param}: {error}", param)
    return grammar


class _TokenSource:
    """What `llguidance.TokenizerWrapper` reads from a tokenizer: every token's bytes, the special
    ids, and an encoder (llguidance re-tokenizes forced text with it)."""

    def __init__(self, tok: Tokenizer):
        self._tok = tok
        self.eos_token_id = tok.eos_id
        self.bos_token_id = tok.bos_id
        self.tokens = [tok.token_bytes(i) for i in range(tok.vocab_size)]
        # control / unknown: never produced by text, so never a grammar's bytes. User-defined tokens
        # are text (Gemma's newlines and runs of spaces are user-defined: a grammar needs them).
        self.special_token_ids = [i for i in range(tok.vocab_size) if tok.token_type(i) in (CONTROL, UNKNOWN)]

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        return self._tok.encode(text, add_special=False, parse_special=False, space_prefix=False)


class Constraint:
    """One request's grammar state. `advance` is called with every token the request emits;
    `finished` once the grammar is complete (or broken: nothing may follow)."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self.matcher = matcher

    def copy(self) -> Constraint:
        return Constraint(self.matcher.deep_copy())

    def fill_bitmask(self, row: torch.Tensor) -> None:
        """Write the allowed next tokens into `row` (int32 words, one bit per token, host memory)."""
        self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)

    def advance(self, tid: int) -> None:
        self.matcher.consume_token(tid)

    @property
    def finished(self) -> bool:
        return self.matcher.is_stopped() or self.matcher.is_error()

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens` the grammar accepts in a row from here (the state is unchanged)."""
        return self.matcher.validate_tokens(tokens)

    def draft_bitmask(self, draft: list[int], out: torch.Tensor) -> None:
        """`out[k+1, W]`: row i allows what may follow the emitted tokens plus `draft[:i]`. Rows
        after the first draft token the grammar refuses allow everything: that token is masked in
        its own row, so the accept step stops there and never reads them."""
        n = self.valid_prefix(draft)
        out[n + 1 :] = -1
        for i in range(n + 1):
            self.fill_bitmask(out[i])
            if i < n:
                self.matcher.consume_token(draft[i])
        if n:
            self.matcher.rollback(n)


class Grammars:
    """The model's llguidance tokenizer, built on first use (a thread-safe lazy build: startup does
    not pay for it), and the matchers built over it."""

    def __init__(self, tok: Tokenizer):
        self._tok = tok
        self._lock = threading.Lock()
        self._lltok: llguidance.LLTokenizer | None = None
        self._executor = llguidance.LLExecutor()  # computes a batch's masks in parallel

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._lltok is None:
                wrapper = llguidance.TokenizerWrapper(_TokenSource(self._tok))
                self._lltok = llguidance.LLTokenizer(wrapper, eos_token=sorted(self._tok.eog_ids))
            return self._lltok

    @property
    def words(self) -> int:
        """int32 words per bitmask row."""
        return (self.tokenizer.vocab_size + 31) // 32

    def constraint(self, grammar: str, param: str) -> Constraint:
        """A fresh matcher for a compiled grammar; what only the tokenizer can reject names `param`."""
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidParam(f"invalid {param}: {matcher.get_error()}", param)
        return Constraint(matcher)

    def bitmask(self, constraints: list[Constraint], pinned: bool) -> torch.Tensor:
        """`[len(constraints), W]` int32: each constraint's next-token mask, computed in parallel."""
        out = torch.empty((len(constraints), self.words), dtype=torch.int32, pin_memory=pinned)
        self._executor.unsafe_compute_mask_ptr(
            [(c.matcher, i) for i, c in enumerate(constraints)], out.data_ptr(), self.words * 4, len(constraints)
        )
        return out


_SHIFTS: dict[torch.device, torch.Tensor] = {}


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """`logits[B, V]` with -inf where `bitmask[B, W]` (host, int32 words) has a 0 bit; the mask is
    copied to the logits' device (asynchronously from pinned memory) and unpacked there. Tokens past
    the mask's width (a model vocabulary padded beyond the tokenizer's) are banned."""
    device = logits.device
    shifts = _SHIFTS.get(device)
    if shifts is None:
        shifts = _SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
    words = bitmask.to(device, non_blocking=True)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).view(words.shape[0], -1).bool()
    V = logits.shape[-1]
    if allowed.shape[1] < V:
        allowed = torch.nn.functional.pad(allowed, (0, V - allowed.shape[1]))
    return logits.masked_fill(~allowed[:, :V], float("-inf"))
