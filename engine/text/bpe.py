"""Byte-level BPE (`tokenizer.ggml.model == "gpt2"`: llama-3, qwen2/3) as llama.cpp's
`llm_tokenizer_bpe` runs it: GPT-2's byte<->unicode mapping, the regex pre-tokenizers chosen by
`tokenizer.ggml.pre`, and the merges ranked by their order in `tokenizer.ggml.merges`."""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping

import regex

# Pre-tokenizer regexes of llama.cpp's llm_tokenizer_bpe, applied in turn (each splits the pieces
# the previous one left, keeping the text between matches as pieces too).
_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3.5: letters and combining marks together (\p{M}), so an accented word stays one piece.
_QWEN35 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_DEFAULT = (
    r"[\p{P}\$\+<=>\^~\|]+",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
    r"\p{N}+",
    r"[0-9][0-9][0-9]",
)
# tokenizer.ggml.pre names as llama.cpp groups them
_LLAMA3_NAMES = ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2")
PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {
    "default": _DEFAULT,
    "gpt2": (_GPT2,),
    "gpt-2": (_GPT2,),
    "smaug-bpe": (_LLAMA3,),
    "qwen2": (_QWEN2,),
    "deepseek-r1-qwen": (_QWEN2,),
    "qwen35": (_QWEN35,),
    **{name: (_LLAMA3,) for name in _LLAMA3_NAMES},
}
# The llama-3 group takes a whole pre-token as one token, skipping merges, when the vocab has it,
# and adds BOS unless the metadata says otherwise.
IGNORE_MERGES_PRE = frozenset(_LLAMA3_NAMES)


def _gpt2_byte_to_unicode() -> list[str]:
    """GPT-2's reversible map of the 256 byte values onto printable unicode characters."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


BYTE_TO_UNICODE = _gpt2_byte_to_unicode()
UNICODE_TO_BYTE = {c: b for b, c in enumerate(BYTE_TO_UNICODE)}
LATIN1_TO_GPT2 = str.maketrans({chr(b): c for b, c in enumerate(BYTE_TO_UNICODE)})


def pre_tokenize(text: str, patterns: Iterable[regex.Pattern]) -> list[str]:
    """`text` split by each pre-tokenizer regex in turn (the text between matches stays a piece)."""
    pieces = [text]
    for pattern in patterns:
        split = []
        for piece in pieces:
            pos = 0
            for m in pattern.finditer(piece):
                if m.start() > pos:
                    split.append(piece[pos : m.start()])
                split.append(m.group())
                pos = m.end()
            if pos < len(piece):
                split.append(piece[pos:])
        pieces = split
    return pieces


def bpe_merge(word: str, t2i: Mapping[str, int], ranks: Mapping[str, int], whole_words: bool) -> tuple[int, ...]:
    """llm_tokenizer_bpe_session::tokenize on one pre-token: ids by `t2i` (vocab text -> id), pairs
    merged by `ranks` ("left right" -> rank); `whole_words`: a pre-token in the vocab is one token
    (the llama-3 group, `IGNORE_MERGES_PRE`)."""
    mapped = word.encode("utf-8").decode("latin-1").translate(LATIN1_TO_GPT2)
    if whole_words and mapped in t2i:
        return (t2i[mapped],)
    syms = list(mapped)
    n = len(syms)
    nxt = list(range(1, n + 1))
    nxt[-1] = -1
    prv = list(range(-1, n - 1))
    heap = []
    for i in range(n - 1):
        rank = ranks.get(syms[i] + " " + syms[i + 1])
        if rank is not None:
            heap.append((rank, i, i + 1, syms[i] + syms[i + 1]))
    heapq.heapify(heap)
    push, pop = heapq.heappush, heapq.heappop
    while heap:
        _, left, right, pair = pop(heap)
        ls, rs = syms[left], syms[right]
        if not ls or not rs or ls + rs != pair:
            continue  # outdated pair
        syms[left] = pair
        syms[right] = ""
        after = nxt[left] = nxt[right]
        if after >= 0:
            prv[after] = left
            rank = ranks.get(pair + " " + syms[after])
            if rank is not None:
                push(heap, (rank, left, after, pair + syms[after]))
        before = prv[left]
        if before >= 0:
            rank = ranks.get(syms[before] + " " + pair)
            if rank is not None:
                push(heap, (rank, before, left, syms[before] + pair))
    ids = []
    i = 0
    while i >= 0:
        tid = t2i.get(syms[i])
        if tid is not None:
            ids.append(tid)
        else:  # as llama.cpp: try the symbol's single bytes as tokens, drop what is not there
            ids.extend(t2i[chr(b)] for b in syms[i].encode("utf-8") if b < 0x80 and chr(b) in t2i)
        i = nxt[i]
    return tuple(ids)
