"""The tiny vocabularies of synthetic GGUF files: SentencePiece for llama/gemma3, byte-level BPE (merges
learned from a word list) for the qwen family, enough for readable test prompts to tokenize."""

from __future__ import annotations

from collections import Counter

import gguf

# Words for the tiny vocabularies: enough for readable test prompts to tokenize into pieces.
_WORDS = (
    "the of and to in is was for on that with as by at from it his an were are which this be or has had "
    "not first one their its new after but who they have her she two been other when there all during into "
    "school time may years more most only over city some world would where later up such used many can "
    "state about national out known university united then made hello world once upon a time story model "
    "engine token layer split head peer worker quick brown fox jumps lazy dog water fire earth light dark "
    "red green blue small large day night year man woman child house tree river mountain sea sky sun moon "
    "star king queen war peace love life death book word name number people country music game power"
).split()


def tiny_vocab(arch: str, vocab_size: int | None):
    """(tokens, scores, types, merges, special-token roles) of a tiny SPM or BPE vocabulary."""
    if arch in ("llama", "gemma3"):
        tokens, scores, types, merges, special = _spm_vocab(arch)
    else:
        tokens, scores, types, merges, special = _bpe_vocab()
    if vocab_size is not None:
        if vocab_size < len(tokens):
            raise ValueError(f"vocab_size {vocab_size} is smaller than the base vocabulary of {len(tokens)}")
        i = 0
        have = set(tokens)
        space = "\u2581" if arch in ("llama", "gemma3") else "\u0120"
        while len(tokens) < vocab_size:
            piece = f"{space}x{i:x}"
            i += 1
            if piece not in have:
                tokens.append(piece)
                scores.append(-1e4 - i)
                types.append(gguf.TokenType.NORMAL)
    return tokens, scores, types, merges, special


def _spm_vocab(arch: str):
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"]
    types = [gguf.TokenType.CONTROL, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL, gguf.TokenType.UNKNOWN]
    if arch == "gemma3":
        tokens += ["<start_of_turn>", "<end_of_turn>"]
        types += [gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    scores = [-1000.0] * len(tokens)
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [gguf.TokenType.BYTE] * 256
    scores += [0.0] * 256
    # Word pieces: characters, then whole words with and without a leading "▁", then their
    # prefixes, so that merging reaches every word; longer pieces score higher.
    pieces: dict[str, float] = {}
    for c in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'\"-:;()\n\u2581":
        pieces[c] = -100.0
    for rank, word in enumerate(_WORDS):
        for piece in (f"\u2581{word}", word):
            for end in range(2, len(piece) + 1):
                pieces.setdefault(piece[:end], -50.0 + end - rank * 1e-3)
    tokens += list(pieces)
    scores += list(pieces.values())
    types += [gguf.TokenType.NORMAL] * len(pieces)
    special = {"bos": "<bos>", "eos": "<eos>", "unk": "<unk>", "pad": "<pad>"}
    return tokens, scores, types, [], special


def _bpe_vocab():
    byte_chars = list(_bytes_to_unicode().values())
    tokens = list(byte_chars)
    merges: list[str] = []
    # Learn merges greedily from the word list (each word preceded by a space, "Ġ"), as BPE training does.
    words = Counter({tuple("\u0120" + w): 3 for w in _WORDS} | {tuple(w): 1 for w in _WORDS})
    vocab = set(tokens)
    for _ in range(400):
        pairs: Counter = Counter()
        for word, n in words.items():
            for a, b in zip(word, word[1:]):
                pairs[a, b] += n
        if not pairs:
            break
        (a, b), _count = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        merges.append(f"{a} {b}")
        if a + b not in vocab:
            vocab.add(a + b)
            tokens.append(a + b)
        words = Counter({_merge(word, a, b): n for word, n in words.items()})
    types = [gguf.TokenType.NORMAL] * len(tokens)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens += specials
    types += [gguf.TokenType.CONTROL] * len(specials)
    scores = [0.0] * len(tokens)
    special = {"bos": "<|endoftext|>", "eos": "<|im_end|>", "pad": "<|endoftext|>"}
    return tokens, scores, types, merges, special


def _merge(word: tuple, a: str, b: str) -> tuple:
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and word[i] == a and word[i + 1] == b:
            out.append(a + b)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))
