"""SentencePiece (`tokenizer.ggml.model == "llama"`: llama-2, gemma) as llama.cpp's `llm_tokenizer_spm`
runs it: spaces become U+2581, adjacent symbols merge by a heap on (score desc, left index asc),
pieces outside the vocab fall back to `<0xNN>`."""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence

import regex

SPM_SPACE = "\u2581"  # "▁"
SPM_SPACE_UTF8 = SPM_SPACE.encode("utf-8")

# A word: "▁"s and what follows up to the next "▁". A vocab text with "▁" after another character
# (from that character on) is the only kind a merge across words can make.
SPM_WORD = regex.compile(SPM_SPACE + "+[^" + SPM_SPACE + "]*|[^" + SPM_SPACE + "]+")
SPM_CROSSING = regex.compile("[^\x00" + SPM_SPACE + "]" + SPM_SPACE + "[^\x00]*")


def spm_merge(
    text: str, t2i: Mapping[str, int], scores: Sequence[float], byte_ids: Sequence[int | None]
) -> tuple[int, ...]:
    """llm_tokenizer_spm_session::tokenize on one piece (spaces already "▁"): ids by `t2i` (vocab
    text -> id), adjacent symbols merged by `scores` (per id); a character outside the vocab becomes
    its UTF-8 bytes' `byte_ids` (the `<0xNN>` tokens, None: none)."""
    syms = list(text)
    n = len(syms)
    nxt = list(range(1, n + 1))
    nxt[-1] = -1
    prv = list(range(-1, n - 1))
    heap = []
    for i in range(n - 1):
        tid = t2i.get(syms[i] + syms[i + 1])
        if tid is not None:
            heap.append((-scores[tid], i, i + 1, 2))
    heapq.heapify(heap)
    push, pop = heapq.heappush, heapq.heappop
    while heap:
        _, left, right, size = pop(heap)
        ls, rs = syms[left], syms[right]
        if not ls or not rs or len(ls) + len(rs) != size:
            continue  # one side was merged since this pair was queued
        merged = syms[left] = ls + rs
        syms[right] = ""
        after = nxt[left] = nxt[right]
        if after >= 0:
            prv[after] = left
            tid = t2i.get(merged + syms[after])
            if tid is not None:
                push(heap, (-scores[tid], left, after, len(merged) + len(syms[after])))
        before = prv[left]
        if before >= 0:
            tid = t2i.get(syms[before] + merged)
            if tid is not None:
                push(heap, (-scores[tid], before, left, len(syms[before]) + len(merged)))
    ids = []
    i = 0
    while i >= 0:
        tid = t2i.get(syms[i])
        if tid is not None:
            ids.append(tid)
        else:  # a character outside the vocab: its UTF-8 bytes as <0xNN> tokens
            ids.extend(b for b in (byte_ids[x] for x in syms[i].encode("utf-8")) if b is not None)
        i = nxt[i]
    return tuple(ids)
