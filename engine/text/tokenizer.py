"""Tokenizers from GGUF metadata, token for token as llama.cpp's `llama-vocab.cpp` runs them.

Two vocabulary models: SPM (`tokenizer.ggml.model == "llama"`, the merges in `spm.py`) and
byte-level BPE (`"gpt2"`, `bpe.py`).
Both first split special tokens out of the text (longest first), as llama.cpp's
`tokenizer_st_partition` does. Lookup tables are built on first use so that loading stays cheap.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from functools import cached_property

import numpy as np
import regex

from ..errors import UserError
from .bpe import IGNORE_MERGES_PRE, PRE_TOKENIZERS, UNICODE_TO_BYTE, bpe_merge, pre_tokenize
from .special_tokens import END_OF_TURN_TEXTS, FIM_KEYS, FIM_TEXTS, SpecialIndex
from .spm import SPM_CROSSING, SPM_SPACE, SPM_SPACE_UTF8, SPM_WORD, spm_merge

log = logging.getLogger(__name__)

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_END_OF_TURN = frozenset(END_OF_TURN_TEXTS)

_CACHE_MAX = 1 << 16


class TokenizerError(UserError):
    """A vocabulary that cannot be used, or token ids outside it."""


class Tokenizer:
    """One GGUF vocabulary: encode text to ids and ids back to bytes/text."""

    def __init__(
        self,
        *,
        model: str,
        tokens: list[str],
        scores: Iterable[float] | None = None,
        token_types: Iterable[int] | None = None,
        merges: list[str] | None = None,
        bos_id: int | None = None,
        eos_id: int | None = None,
        unk_id: int | None = None,
        pad_id: int | None = None,
        eot_id: int | None = None,
        eom_id: int | None = None,
        add_bos: bool | None = None,
        add_eos: bool | None = None,
        add_space_prefix: bool | None = None,
        pre: str | None = None,
    ):
        if model not in ("llama", "gpt2"):
            raise TokenizerError(
                f"unsupported tokenizer.ggml.model {model!r} (supported: 'llama' = SentencePiece, 'gpt2' = byte-level BPE)"
            )
        if not tokens:
            raise TokenizerError("the model has an empty vocabulary (tokenizer.ggml.tokens)")
        self.model = model
        self.is_spm = model == "llama"
        n = len(tokens)
        # llama.cpp renames empty tokens: an empty special text would match everywhere.
        self._tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)] if "" in tokens else list(tokens)
        types = np.full(n, NORMAL, np.int32) if token_types is None else np.asarray(token_types, np.int32).copy()
        if len(types) != n:
            raise TokenizerError(f"tokenizer.ggml.token_type has {len(types)} entries for {n} tokens")
        self._scores_src = scores
        self._merges = list(merges) if merges is not None else []
        if self.is_spm:  # llama.cpp's defaults when the keys are absent
            bos_id, eos_id, unk_id = _default(bos_id, 1), _default(eos_id, 2), _default(unk_id, 0)
            self.add_bos, self.add_space_prefix = _default(add_bos, True), _default(add_space_prefix, True)
            self.pre = "default"
        else:
            self.pre = pre or "default"
            if self.pre not in PRE_TOKENIZERS:
                raise TokenizerError(
                    f"unsupported tokenizer.ggml.pre {self.pre!r} (supported: {', '.join(sorted(PRE_TOKENIZERS))})"
                )
            self.add_bos = _default(add_bos, self.pre in IGNORE_MERGES_PRE)
            self.add_space_prefix = _default(add_space_prefix, False)
        self.add_eos = _default(add_eos, False)
        self.bos_id, self.eos_id, self.unk_id, self.pad_id = (
            self._valid_id(name, tid)
            for name, tid in (("bos", bos_id), ("eos", eos_id), ("unknown", unk_id), ("padding", pad_id))
        )
        eot_id, eom_id = self._valid_id("eot", eot_id), self._valid_id("eom", eom_id)

        eog = {tid for tid in (self.eos_id, eot_id, eom_id) if tid is not None}
        for text in _END_OF_TURN.intersection(self._tokens):
            tid = self.find_token(text)
            eog.add(tid)
            types[tid] = CONTROL
        self.eog_ids: set[int] = eog
        self._types = types
        self._word_cache: dict[str, tuple[int, ...]] = {}  # pre-token -> ids
        self._pieces: dict[int, bytes] = {}  # id -> bytes, filled as tokens are decoded

    def _valid_id(self, name: str, tid: int | None) -> int | None:
        if tid is not None and not 0 <= tid < len(self._tokens):
            # as llama.cpp: a bad special-token id is warned about and ignored, the model still loads
            log.warning(
                "tokenizer.ggml.%s_token_id %d is outside the vocabulary of %d tokens; ignored",
                name,
                tid,
                len(self._tokens),
            )
            return None
        return tid

    def find_token(self, text: str) -> int | None:
        """Id of the vocab entry `text`, None if absent (the last one if repeated, as llama.cpp)."""
        built = self.__dict__.get("token_to_id")
        if built is not None:
            return built.get(text)
        try:  # a scan is cheaper than building the dict when only a few texts are looked up
            return len(self._tokens) - 1 - self._tokens[::-1].index(text)
        except ValueError:
            return None

    # ---- construction ---------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, g) -> Tokenizer:
        """The tokenizer of an open `GGUFFile` (reads only `tokenizer.ggml.*` metadata)."""
        return cls.from_metadata(g.metadata)

    @classmethod
    def from_metadata(cls, md: Mapping[str, object]) -> Tokenizer:
        if "tokenizer.ggml.tokens" not in md:
            raise TokenizerError("the model has no vocabulary (metadata key tokenizer.ggml.tokens is missing)")

        def opt_int(key):
            v = md.get(key)
            return None if v is None else int(v)

        def opt_bool(key):
            v = md.get(key)
            return None if v is None else bool(v)

        return cls(
            model=str(md.get("tokenizer.ggml.model", "llama")),
            tokens=list(md["tokenizer.ggml.tokens"]),
            scores=md.get("tokenizer.ggml.scores"),
            token_types=md.get("tokenizer.ggml.token_type"),
            merges=md.get("tokenizer.ggml.merges"),
            bos_id=opt_int("tokenizer.ggml.bos_token_id"),
            eos_id=opt_int("tokenizer.ggml.eos_token_id"),
            unk_id=opt_int("tokenizer.ggml.unknown_token_id"),
            pad_id=opt_int("tokenizer.ggml.padding_token_id"),
            eot_id=opt_int("tokenizer.ggml.eot_token_id"),
            eom_id=opt_int("tokenizer.ggml.eom_token_id"),
            add_bos=opt_bool("tokenizer.ggml.add_bos_token"),
            add_eos=opt_bool("tokenizer.ggml.add_eos_token"),
            add_space_prefix=opt_bool("tokenizer.ggml.add_space_prefix"),
            pre=md.get("tokenizer.ggml.pre"),
        )

    # ---- lookup tables, built on first use ------------------------------------------------------

    @cached_property
    def token_to_id(self) -> dict[str, int]:
        return {t: i for i, t in enumerate(self._tokens)}

    @cached_property
    def _score_list(self) -> list[float]:
        src = self._scores_src
        if src is None:
            return [0.0] * len(self._tokens)
        scores = np.asarray(src, np.float32).tolist()
        if len(scores) != len(self._tokens):
            raise TokenizerError(f"tokenizer.ggml.scores has {len(scores)} entries for {len(self._tokens)} tokens")
        return scores

    @cached_property
    def _merge_ranks(self) -> dict[str, int]:
        return {m: r for r, m in enumerate(self._merges)}

    @cached_property
    def _spm_byte_ids(self) -> list[int | None]:
        return [self.token_to_id.get(f"<0x{b:02X}>", self.unk_id) for b in range(256)]

    @cached_property
    def _spm_crossing(self) -> list[str]:
        """Vocab texts with "▁" after another character (from that character on): the only ones a
        merge across words can make. One regex pass over all texts joined by NULs."""
        return SPM_CROSSING.findall("\x00".join(self._tokens))

    @cached_property
    def _special(self) -> list[tuple[str, int]]:
        """(text, id) of the tokens split out of text before the merges."""
        types = self._types
        ids = np.nonzero((types == CONTROL) | (types == USER_DEFINED) | (types == UNKNOWN))[0].tolist()
        return [(self._tokens[i], i) for i in ids]

    @cached_property
    def _special_index(self) -> SpecialIndex:
        return SpecialIndex(self._special)

    @cached_property
    def _user_defined_index(self) -> SpecialIndex:
        return SpecialIndex([s for s in self._special if self._types[s[1]] == USER_DEFINED])

    @cached_property
    def _pre_regexes(self) -> list[regex.Pattern]:
        return [regex.compile(p) for p in PRE_TOKENIZERS[self.pre]]

    # ---- properties -----------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    def token_text(self, tid: int) -> str:
        """The vocabulary entry as stored (SPM "▁the", BPE "Ġthe", "<0x0A>", "<eos>")."""
        return self._tokens[self._check(tid)]

    def token_type(self, tid: int) -> int:
        return int(self._types[self._check(tid)])

    def is_special(self, tid: int) -> bool:
        """Control and unknown tokens: the ones `decode(..., skip_special=True)` leaves out."""
        return self._check(tid) in self._skipped

    @cached_property
    def _skipped(self) -> frozenset[int]:
        """Control and unknown ids: a set lookup per streamed token, not a numpy scalar's."""
        return frozenset(np.nonzero((self._types == CONTROL) | (self._types == UNKNOWN))[0].tolist())

    def _check(self, tid) -> int:
        if not isinstance(tid, (int, np.integer)) or isinstance(tid, bool) or not 0 <= tid < len(self._tokens):
            raise TokenizerError(f"token id {tid!r} is outside the vocabulary [0, {len(self._tokens)})")
        return int(tid)

    # ---- encode ---------------------------------------------------------------------------------

    def encode(
        self, text: str, add_special: bool = True, parse_special: bool = True, space_prefix: bool = True
    ) -> list[int]:
        """Token ids of `text`. add_special adds BOS/EOS as the model asks; parse_special lets
        control-token texts ("<start_of_turn>") in the text become those tokens; space_prefix=False
        encodes text that continues a stream (no SPM space prefix even where the model asks for one)."""
        if not isinstance(text, str):
            raise TokenizerError(f"text to tokenize must be a string, not {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates, e.g. from JSON "\ud83d"
            text = text.encode("utf-8", "replace").decode("utf-8")
        out: list[int] = []
        if add_special and self.add_bos and self.bos_id is not None:
            out.append(self.bos_id)
        prev_special = True  # SPM: a space prefix goes on the first text and on text after a special token
        for frag in self._partition(text, parse_special):
            if isinstance(frag, int):
                out.append(frag)
                prev_special = True
                continue
            if self.is_spm:
                piece = text[frag[0] : frag[1]]
                if self.add_space_prefix and prev_special and space_prefix:
                    piece = " " + piece
                self._encode_spm(piece.replace(" ", SPM_SPACE), out)
            else:
                self._encode_bpe(text[frag[0] : frag[1]], out)
            prev_special = False
        if add_special and self.add_eos and self.eos_id is not None:
            out.append(self.eos_id)
        return out

    def _partition(self, text: str, parse_special: bool) -> list[tuple[int, int] | int]:
        """Raw-text spans (start, end) and special-token ids, as llama.cpp's tokenizer_st_partition:
        each special token in turn (longest first) is cut out of every remaining span."""
        if not text:
            return []
        index = self._special_index if parse_special else self._user_defined_index
        present = index.occurring(text)
        frags: list[tuple[int, int] | int] = [(0, len(text))]
        if not present:
            return frags
        present.sort(key=lambda item: (-len(item[0]), item[1]))  # longest first; ties by id, a stable order
        for special, tid in present:
            out = []
            for frag in frags:
                if isinstance(frag, int):
                    out.append(frag)
                    continue
                start, end = frag
                while (m := text.find(special, start, end)) >= 0:
                    if m > start:
                        out.append((start, m))
                    out.append(tid)
                    start = m + len(special)
                if start < end:
                    out.append((start, end))
            frags = out
        return frags

    def _cached(self, word: str, compute) -> tuple[int, ...]:
        ids = self._word_cache.get(word)
        if ids is None:
            if len(self._word_cache) >= _CACHE_MAX:
                self._word_cache.clear()
            ids = self._word_cache[word] = compute(word)
        return ids

    def _encode_spm(self, text: str, out: list[int]) -> None:
        # Merges never cross a "▁" that follows another character unless the vocab holds a token
        # spanning one (`SPM_CROSSING`); so words merge independently and their ids can be cached.
        if any(c in text for c in self._spm_crossing):
            out.extend(self._spm_merge(text))
            return
        for word in SPM_WORD.findall(text):
            out.extend(self._cached(word, self._spm_merge))

    def _spm_merge(self, text: str) -> tuple[int, ...]:
        return spm_merge(text, self.token_to_id, self._score_list, self._spm_byte_ids)

    def _encode_bpe(self, text: str, out: list[int]) -> None:
        for piece in pre_tokenize(text, self._pre_regexes):
            out.extend(self._cached(piece, self._bpe_merge))

    def _bpe_merge(self, word: str) -> tuple[int, ...]:
        return bpe_merge(word, self.token_to_id, self._merge_ranks, self.pre in IGNORE_MERGES_PRE)

    # ---- decode ---------------------------------------------------------------------------------

    def token_bytes(self, tid: int) -> bytes:
        """The bytes this token stands for (a byte-fallback token is one byte, maybe half a character)."""
        tid = self._check(tid)
        piece = self._pieces.get(tid)
        if piece is None:
            piece = self._pieces[tid] = self._piece(tid)
        return piece

    def _piece(self, tid: int) -> bytes:
        text, kind = self._tokens[tid], self._types[tid]
        if kind == UNUSED:
            return b""
        if kind == BYTE:
            try:
                return bytes([int(text[3:-1], 16)])
            except ValueError:
                return text.encode("utf-8")
        if kind != NORMAL:
            return text.encode("utf-8")
        if self.is_spm:
            return text.replace(SPM_SPACE, " ").encode("utf-8")
        return b"".join(bytes([UNICODE_TO_BYTE[c]]) if c in UNICODE_TO_BYTE else c.encode("utf-8") for c in text)

    def decode_bytes(self, ids: Iterable[int], skip_special: bool = False) -> bytes:
        ids = list(ids)
        if skip_special:
            ids = [t for t in ids if not self.is_special(t)]
        pieces = [self.token_bytes(t) for t in ids]
        # add_space_prefix: encode put a space before the text; take it off again, also after a
        # leading BOS (llama_detokenize does not there) so that decode(encode(text)) == text.
        if self.add_space_prefix and pieces:
            first = 1 if ids[0] == self.bos_id and len(ids) > 1 else 0
            if self._types[ids[first]] == NORMAL and pieces[first].startswith(b" "):
                pieces[first] = pieces[first][1:]
        text = b"".join(pieces)
        # "▁" means a space in SPM, also when it came as byte-fallback tokens (vocab without "▁")
        return text.replace(SPM_SPACE_UTF8, b" ") if self.is_spm else text

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of `ids`; byte-fallback tokens are joined into UTF-8 first (bad bytes become U+FFFD)."""
        return self.decode_bytes(ids, skip_special).decode("utf-8", "replace")

    def __repr__(self) -> str:
        kind = "SPM" if self.is_spm else f"BPE/{self.pre}"
        return f"Tokenizer({kind}, vocab={self.vocab_size}, bos={self.bos_id}, eos={self.eos_id})"


def _default(value, default):
    return default if value is None else value


def fim_tokens(tok: Tokenizer, md: Mapping[str, object]) -> dict[str, int | None]:
    """Fill-in-the-middle token ids {pre, suf, mid, rep, sep} (None: the model has none), found as
    llama.cpp finds them: the metadata key first, then the vocabulary's known FIM texts."""
    out: dict[str, int | None] = {}
    for kind, keys in FIM_KEYS.items():
        tid = next(
            (int(md[f"tokenizer.ggml.{k}_token_id"]) for k in keys if f"tokenizer.ggml.{k}_token_id" in md), None
        )
        if tid is None or not 0 <= tid < tok.vocab_size:
            tid = next((t for t in map(tok.find_token, FIM_TEXTS[kind]) if t is not None), None)
        out[kind] = tid
    return out
