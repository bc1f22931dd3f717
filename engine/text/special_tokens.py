"""Special tokens as llama.cpp knows them: the texts it treats as end-of-generation and as
fill-in-the-middle markers, and `SpecialIndex`, which finds the special-token texts that occur in a
text (the tokenizer's first step, as llama.cpp's `tokenizer_st_partition`)."""

from __future__ import annotations

# Texts llama.cpp treats as end-of-generation whatever the metadata says (and forces to CONTROL).
END_OF_TURN_TEXTS = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "[EOT]",
    "<｜end▁of▁sentence｜>",
)

# llama.cpp's FIM tokens: the GGUF's tokenizer.ggml.fim_*_token_id, else a vocab entry with a known text.
FIM_TEXTS = {
    "pre": (
        "<|fim_prefix|>",
        "<fim-prefix>",
        "<fim_prefix>",
        "<｜fim▁begin｜>",
        "<PRE>",
        "▁<PRE>",
        "<|code_prefix|>",
        "<|prefix|>",
    ),
    "suf": (
        "<|fim_suffix|>",
        "<fim-suffix>",
        "<fim_suffix>",
        "<｜fim▁hole｜>",
        "<SUF>",
        "▁<SUF>",
        "<|code_suffix|>",
        "<|suffix|>",
    ),
    "mid": (
        "<|fim_middle|>",
        "<fim-middle>",
        "<fim_middle>",
        "<｜fim▁end｜>",
        "<MID>",
        "▁<MID>",
        "<|code_middle|>",
        "<|middle|>",
    ),
    "rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "sep": ("<|file_sep|>",),
}
FIM_KEYS = {
    "pre": ("fim_pre", "prefix"),
    "suf": ("fim_suf", "suffix"),
    "mid": ("fim_mid", "middle"),
    "rep": ("fim_rep",),
    "sep": ("fim_sep",),
}


class SpecialIndex:
    """Which of many special-token texts occur in a text, without one substring search per token.

    A prefix tree whose nodes are only entered when their prefix occurs in the text: thousands of
    `<unusedN>` tokens cost one search for "<u" on text without it."""

    _LEAF = 16
    _MAX_DEPTH = 64  # long chains ("\n", "\n\n", ...) stop nesting here and are checked one by one

    def __init__(self, items: list[tuple[str, int]]):
        self._root = self._build("", items)

    def _build(self, prefix: str, items: list[tuple[str, int]]):
        if len(items) <= self._LEAF or len(prefix) >= self._MAX_DEPTH:
            return prefix, items, ()
        depth = len(prefix) + 1
        direct, groups = [], {}
        for item in items:
            if len(item[0]) < depth:
                direct.append(item)
            else:
                groups.setdefault(item[0][:depth], []).append(item)
        return prefix, direct, tuple(self._build(p, g) for p, g in groups.items())

    def occurring(self, text: str) -> list[tuple[str, int]]:
        found, stack = [], [self._root]
        while stack:
            _, items, children = stack.pop()
            found.extend(item for item in items if item[0] in text)
            stack.extend(child for child in children if child[0] in text)
        return found
