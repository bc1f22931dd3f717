"""Tokenizer: llama.cpp's ids on the default model, SPM/BPE mechanics on hand-built vocabularies,
decoding, streaming, and loading from a GGUF written by gguf.GGUFWriter."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hydra_console.engine.default_model import default_model_path
from hydra_console.engine.errors import UserError
from hydra_console.engine.gguf_file import GGUFFile
from hydra_console.engine.text.bpe import BYTE_TO_UNICODE
from hydra_console.engine.text.special_tokens import SpecialIndex
from hydra_console.engine.text.stream_decoder import StreamDecoder
from hydra_console.engine.text.tokenizer import (
    BYTE,
    CONTROL,
    NORMAL,
    USER_DEFINED,
    Tokenizer,
)

# Upstream llama.cpp's tokenizations of the default model (copied from shared/reference into the repo).
REFERENCE = Path(__file__).parent / "data" / "reference" / "gemma3-270m" / "tokenize.jsonl"


@pytest.fixture(scope="module")
def gemma() -> Tokenizer:
    return Tokenizer.from_gguf(GGUFFile(default_model_path()))


# ---- the default model against upstream llama.cpp ------------------------------------------------


def test_every_reference_case(gemma):
    cases = [json.loads(line) for line in REFERENCE.read_text().splitlines() if line.strip()]
    assert len(cases) > 400
    wrong = []
    for c in cases:
        ids = gemma.encode(c["text"], add_special=True, parse_special=c["parse_special"])
        if ids != c["ids"]:
            wrong.append((c["text"], c["parse_special"], ids, c["ids"]))
    assert not wrong, f"{len(wrong)} of {len(cases)} differ from llama.cpp, first: {wrong[:3]}"
    # and llama.cpp's ids decode back to the text (after the BOS it added)
    undecoded = [c["text"] for c in cases if gemma.decode(c["ids"]) != "<bos>" + c["text"]]
    assert not undecoded, undecoded[:3]


def test_gemma_user_defined_tokens_split_even_without_parse_special(gemma):
    # llama.cpp quirk reproduced on purpose: Gemma's vocab marks HTML-ish tags such as "</s>" and
    # runs of spaces/newlines/tabs as USER_DEFINED, and those are always split out of the text,
    # while control tokens ("<bos>") are only with parse_special.
    t2i = gemma.token_to_id
    assert gemma.token_type(t2i["</s>"]) == USER_DEFINED
    ids = gemma.encode("a</s>b<bos>", add_special=False, parse_special=False)
    assert t2i["</s>"] in ids and gemma.bos_id not in ids
    ids = gemma.encode("a</s>b<bos>", add_special=False, parse_special=True)
    assert ids[-1] == gemma.bos_id and t2i["</s>"] in ids
    assert gemma.encode("x   y", add_special=False) == [t2i["x"], t2i["   "], t2i["y"]]


def test_gemma_ids_and_end_of_generation(gemma):
    assert gemma.token_text(gemma.bos_id) == "<bos>"
    assert gemma.token_text(gemma.eos_id) == "<eos>"
    assert gemma.eog_ids == {gemma.eos_id, gemma.token_to_id["<end_of_turn>"]}
    assert gemma.vocab_size == 262144
    assert gemma.encode("") == [gemma.bos_id]
    assert gemma.encode("", add_special=False) == []
    assert gemma.is_special(gemma.bos_id) and gemma.is_special(gemma.token_to_id["<start_of_turn>"])
    assert not gemma.is_special(gemma.token_to_id["\n"])  # user-defined: plain text
    assert not gemma.is_special(gemma.token_to_id["▁the"])


ROUND_TRIP = [
    "Hello, world!",
    "  two leading spaces and trailing  ",
    "new\nlines\n\n\nand\ttabs\t\t",
    "ümlaut façade naïve — «quotes» ½",
    "中文字符测试 日本語のテキスト 한국어",
    "emoji 🐍🚀 and byte-fallback ones 🪿🦩𓀀",
    "code: def f(x):\n    return x ** 2  # comment",
    "a vocab piece across words: > </ b",
]


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_round_trip(gemma, text):
    assert gemma.decode(gemma.encode(text, add_special=False)) == text
    ids = gemma.encode(text)
    assert ids[0] == gemma.bos_id
    assert gemma.decode(ids, skip_special=True) == text
    assert gemma.decode(ids) == "<bos>" + text


def test_byte_fallback_and_token_bytes(gemma):
    ids = gemma.encode("🪿", add_special=False)
    assert [gemma.token_type(i) for i in ids] == [BYTE] * 4
    assert b"".join(gemma.token_bytes(i) for i in ids) == "🪿".encode()
    assert gemma.token_bytes(gemma.token_to_id["▁the"]) == b" the"
    assert gemma.token_text(gemma.token_to_id["▁the"]) == "▁the"


def test_stream_decoder_holds_back_partial_characters(gemma):
    ids = gemma.encode("goose 🪿!", add_special=False)
    dec = StreamDecoder(gemma)
    pieces = [dec.push(i) for i in ids]
    assert "".join(pieces) + dec.flush() == "goose 🪿!"
    goose = pieces.index("🪿")
    assert pieces[goose - 3 : goose] == ["", "", ""]  # three lead bytes gave nothing yet
    assert all("\ufffd" not in p for p in pieces)


def test_stream_decoder_flush_and_specials(gemma):
    first_byte = gemma.encode("🪿", add_special=False)[0]
    dec = StreamDecoder(gemma)
    assert dec.push(first_byte) == ""
    assert dec.flush() == "\ufffd"  # an incomplete character at the end is replaced, not lost
    assert dec.push(gemma.token_to_id["▁ok"]) == " ok"
    assert dec.push(gemma.token_to_id["<end_of_turn>"]) == ""
    assert StreamDecoder(gemma, skip_special=False).push(gemma.token_to_id["<end_of_turn>"]) == "<end_of_turn>"


def test_bad_input_is_a_user_error(gemma):
    for bad in ([-1], [gemma.vocab_size], ["3"], [1.5]):
        with pytest.raises(UserError, match="outside the vocabulary"):
            gemma.decode(bad)
    with pytest.raises(UserError, match="must be a string"):
        gemma.encode(b"bytes")
    # a lone surrogate (as JSON "\ud83d" gives) is replaced, not a crash
    assert gemma.decode(gemma.encode("a\ud83db", add_special=False)) == "a?b"


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet="ab c.▁>/<\nxé", max_size=40))
def test_spm_word_split_equals_whole_text_merge(gemma, text):
    # encode merges word by word (and caches words); that must equal one merge over the whole text.
    escaped = text.replace(" ", "▁")
    if not escaped:
        return
    out: list[int] = []
    gemma._encode_spm(escaped, out)
    assert out == list(gemma._spm_merge(escaped))


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet="<>ab/\n", max_size=30))
def test_special_index_finds_exactly_the_occurring_texts(text):
    items = [
        (s, i)
        for i, s in enumerate(["<a>", "<b>", "</a>", "\n", "\n\n", "a", "<", "ab", *(f"<a{k}>" for k in range(40))])
    ]
    assert sorted(SpecialIndex(items).occurring(text)) == sorted(it for it in items if it[0] in text)


def test_special_index_on_a_long_chain_of_prefixes():
    items = [("a" * k, k) for k in range(1, 3000)]
    assert sorted(SpecialIndex(items).occurring("b" + "a" * 100)) == items[:100]


# ---- SPM on a hand-built vocabulary --------------------------------------------------------------


def spm_metadata(pieces: dict[str, float], *, user_defined=(), add_space_prefix=True, bytes_=True) -> dict:
    tokens = ["<unk>", "<s>", "</s>", "<start_of_turn>"]
    types = [2, CONTROL, CONTROL, CONTROL]
    scores = [0.0] * 4
    if bytes_:
        tokens += [f"<0x{b:02X}>" for b in range(256)]
        types += [BYTE] * 256
        scores += [0.0] * 256
    for text in user_defined:
        tokens.append(text), types.append(USER_DEFINED), scores.append(0.0)
    for text, score in pieces.items():
        tokens.append(text), types.append(NORMAL), scores.append(score)
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_space_prefix": add_space_prefix,
    }


def texts(tok: Tokenizer, ids: list[int]) -> list[str]:
    return [tok.token_text(i) for i in ids]


def test_spm_merges_highest_score_first():
    base = {"a": -5.0, "b": -5.0, "c": -5.0}
    tok = Tokenizer.from_metadata(spm_metadata({**base, "ab": -2.0, "bc": -1.0}, add_space_prefix=False))
    assert texts(tok, tok.encode("abc", add_special=False)) == ["a", "bc"]
    tok = Tokenizer.from_metadata(spm_metadata({**base, "ab": -1.0, "bc": -2.0}, add_space_prefix=False))
    assert texts(tok, tok.encode("abc", add_special=False)) == ["ab", "c"]


def test_spm_equal_scores_merge_leftmost_first():
    tok = Tokenizer.from_metadata(spm_metadata({"a": -5.0, "aa": -1.0}, add_space_prefix=False))
    assert texts(tok, tok.encode("aaa", add_special=False)) == ["aa", "a"]


def test_spm_merges_only_through_vocab_pieces():
    # "abcd" is in the vocab but unreachable: no "abc" or "bcd" to merge through, as in SentencePiece.
    tok = Tokenizer.from_metadata(
        spm_metadata({"a": -5, "b": -5, "c": -5, "d": -5, "ab": -1, "cd": -1, "abcd": -0.5}, add_space_prefix=False)
    )
    assert texts(tok, tok.encode("abcd", add_special=False)) == ["abcd"]
    tok = Tokenizer.from_metadata(
        spm_metadata({"a": -5, "b": -5, "c": -5, "d": -5, "abcd": -0.5}, add_space_prefix=False)
    )
    assert texts(tok, tok.encode("abcd", add_special=False)) == ["a", "b", "c", "d"]


def test_spm_space_prefix_bos_and_round_trip():
    tok = Tokenizer.from_metadata(spm_metadata({"▁": -3, "a": -3, "b": -3, "▁a": -1, "▁b": -1}))
    ids = tok.encode("a b")
    assert ids[0] == tok.bos_id and texts(tok, ids[1:]) == ["▁a", "▁b"]
    assert tok.decode(ids, skip_special=True) == "a b"
    assert tok.decode(ids[1:]) == "a b"
    # after a special token the next text gets the space prefix again
    ids = tok.encode("<start_of_turn>a", add_special=False)
    assert texts(tok, ids) == ["<start_of_turn>", "▁a"]
    assert texts(tok, tok.encode("<start_of_turn>", add_special=False, parse_special=False))[0] == "▁"


def test_spm_word_crossing_piece_is_found():
    # a piece spanning a space: the word-by-word shortcut must not hide it
    tok = Tokenizer.from_metadata(
        spm_metadata({"a": -5, "▁": -5, "b": -5, "a▁": -2, "a▁b": -1}, add_space_prefix=False)
    )
    assert texts(tok, tok.encode("a b", add_special=False)) == ["a▁b"]


def test_spm_byte_fallback_and_stream():
    tok = Tokenizer.from_metadata(spm_metadata({"▁": -1, "h": -1, "i": -1}))
    ids = tok.encode("hi é", add_special=False)
    assert texts(tok, ids) == ["▁", "h", "i", "▁", "<0xC3>", "<0xA9>"]
    assert tok.decode(ids) == "hi é"
    dec = StreamDecoder(tok)
    assert [dec.push(i) for i in ids] == [" ", "h", "i", " ", "", "é"]


def test_spm_minimal_vocab_of_bytes_and_specials():
    tok = Tokenizer.from_metadata(spm_metadata({}, add_space_prefix=False))
    ids = tok.encode("Hi 👋<start_of_turn>")
    assert ids[0] == tok.bos_id and ids[-1] == 3
    assert all(tok.token_type(i) == BYTE for i in ids[1:-1])
    assert tok.decode(ids, skip_special=True) == "Hi 👋"


def test_special_tokens_longest_first_not_leftmost_first():
    # llama.cpp cuts each special token out in order of length, so "abc" wins over an earlier "xa".
    tok = Tokenizer.from_metadata(spm_metadata({"x": -1}, user_defined=["xa", "abc"], add_space_prefix=False))
    assert texts(tok, tok.encode("xabc", add_special=False)) == ["x", "abc"]
    assert texts(tok, tok.encode("xab", add_special=False)) == ["xa", "<0x62>"]


# ---- byte-level BPE on a hand-built vocabulary ---------------------------------------------------

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def bpe_metadata(merges: list[str], pre: str = "qwen2", extra: tuple[str, ...] = (), add_bos=None) -> dict:
    tokens = list(BYTE_TO_UNICODE)
    for m in merges:
        if m.replace(" ", "") not in tokens:
            tokens.append(m.replace(" ", ""))
    tokens += [t for t in extra if t not in tokens]
    types = [NORMAL] * len(tokens) + [CONTROL] * len(SPECIALS)
    tokens += SPECIALS
    md = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.eos_token_id": tokens.index("<|endoftext|>"),
        "tokenizer.ggml.bos_token_id": tokens.index("<|endoftext|>"),
    }
    if add_bos is not None:
        md["tokenizer.ggml.add_bos_token"] = add_bos
    return md


HELLO_MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d"]


def test_bpe_merges_and_round_trip():
    tok = Tokenizer.from_metadata(bpe_metadata(HELLO_MERGES))
    ids = tok.encode("hello world")
    assert texts(tok, ids) == ["hello", "Ġworld"]  # qwen2 adds no BOS
    assert tok.decode(ids) == "hello world"
    assert tok.token_bytes(ids[1]) == b" world"
    for text in ["héllo wörld!", "tabs\tand\nnewlines\n\n", "emoji 🐍", "  spaces  "]:
        assert tok.decode(tok.encode(text)) == text


def test_bpe_merge_rank_decides():
    tok = Tokenizer.from_metadata(bpe_metadata(["b c", "a b"]))
    assert texts(tok, tok.encode("abc")) == ["a", "bc"]
    tok = Tokenizer.from_metadata(bpe_metadata(["a b", "b c"]))
    assert texts(tok, tok.encode("abc")) == ["ab", "c"]
    tok = Tokenizer.from_metadata(bpe_metadata(["a a"]))
    assert texts(tok, tok.encode("aaa")) == ["aa", "a"]


def test_bpe_multibyte_characters_go_through_byte_mapping():
    # "é" is bytes C3 A9, mapped to "Ã" "©"; a merge of those two gives one token
    tok = Tokenizer.from_metadata(bpe_metadata(["Ã ©"]))
    assert texts(tok, tok.encode("é")) == ["Ã©"]
    assert tok.decode(tok.encode("éé")) == "éé"
    dec = StreamDecoder(Tokenizer.from_metadata(bpe_metadata([])))
    tok0 = dec.tok
    assert [dec.push(i) for i in tok0.encode("é")] == ["", "é"]


def test_bpe_pre_tokenizers_differ_on_digits_and_whole_words():
    merges = ["1 2", "12 3", "4 5"]
    qwen = Tokenizer.from_metadata(bpe_metadata(merges, pre="qwen2"))
    llama3 = Tokenizer.from_metadata(bpe_metadata(merges, pre="llama-bpe"))
    assert texts(qwen, qwen.encode("12345")) == ["1", "2", "3", "4", "5"]  # qwen2: one digit per pre-token
    assert texts(llama3, llama3.encode("12345", add_special=False)) == ["123", "45"]  # llama3: up to 3
    # llama3 takes a pre-token that is in the vocab as one token, merges or not
    md = bpe_metadata([], pre="llama-bpe", extra=("Ġxyz",))
    tok = Tokenizer.from_metadata(md)
    assert texts(tok, tok.encode(" xyz", add_special=False)) == ["Ġxyz"]
    md["tokenizer.ggml.pre"] = "gpt2"
    tok = Tokenizer.from_metadata(md)
    assert texts(tok, tok.encode(" xyz")) == ["Ġ", "x", "y", "z"]
    # llama3 adds BOS by default, qwen2 does not; the metadata key overrides
    assert llama3.encode("1")[0] == llama3.bos_id and qwen.encode("1")[0] != qwen.bos_id
    with_bos = Tokenizer.from_metadata(bpe_metadata([], add_bos=True))
    assert with_bos.encode("1")[0] == with_bos.bos_id


def test_bpe_contractions_and_default_pre():
    tok = Tokenizer.from_metadata(bpe_metadata(["' s", "Ġ i", "Ġi t", "i t"], pre="gpt2"))
    assert texts(tok, tok.encode("it's it")) == ["it", "'s", "Ġit"]
    tok = Tokenizer.from_metadata(bpe_metadata(["Ġ (", "( (", "1 2", "12 3"], pre="default"))
    # llama.cpp's "default" pre-tokenizer cuts punctuation runs and 3-digit groups first
    assert texts(tok, tok.encode(" ((12345")) == ["Ġ", "((", "123", "4", "5"]


def test_bpe_special_tokens():
    tok = Tokenizer.from_metadata(bpe_metadata(HELLO_MERGES))
    ids = tok.encode("<|im_start|>hello<|im_end|>")
    assert texts(tok, ids) == ["<|im_start|>", "hello", "<|im_end|>"]
    assert tok.decode(ids) == "<|im_start|>hello<|im_end|>"
    assert tok.decode(ids, skip_special=True) == "hello"
    plain = tok.encode("<|im_end|>", parse_special=False)
    assert tok.token_to_id["<|im_end|>"] not in plain and tok.decode(plain) == "<|im_end|>"
    assert tok.eog_ids == {tok.token_to_id["<|endoftext|>"], tok.token_to_id["<|im_end|>"]}


def test_bad_vocabularies_are_user_errors():
    with pytest.raises(UserError, match="tokenizer.ggml.model"):
        Tokenizer.from_metadata({**bpe_metadata([]), "tokenizer.ggml.model": "t5"})
    with pytest.raises(UserError, match="tokenizer.ggml.pre"):
        Tokenizer.from_metadata({**bpe_metadata([]), "tokenizer.ggml.pre": "no-such-pre"})
    with pytest.raises(UserError, match="tokenizer.ggml.tokens"):
        Tokenizer.from_metadata({"tokenizer.ggml.model": "llama"})
    with pytest.raises(UserError, match="token_type has 3 entries for 259 tokens"):
        Tokenizer.from_metadata({**bpe_metadata([]), "tokenizer.ggml.token_type": [1, 1, 1]})


def test_odd_vocabularies_still_load():
    # a special-token id outside the vocab is ignored (llama.cpp warns and goes on)
    tok = Tokenizer.from_metadata({**bpe_metadata([]), "tokenizer.ggml.eos_token_id": 10**6})
    assert tok.eos_id is None and tok.eog_ids == {tok.find_token("<|endoftext|>"), tok.find_token("<|im_end|>")}
    # empty texts get llama.cpp's placeholder, NULs inside texts do not confuse lookups
    md = spm_metadata({"a\x00b": -1.0, "": -1.0, "▁": -1.0})
    tok = Tokenizer.from_metadata(md)
    n = len(md["tokenizer.ggml.tokens"])
    assert tok.find_token("a\x00b") == n - 3 and tok.token_text(n - 2) == f"[EMPTY_{n - 2}]"
    assert tok.find_token("▁") == n - 1 and tok.find_token("") is None
    assert tok.decode(tok.encode("a\x00b c"), skip_special=True) == "a\x00b c"


# ---- loading from a real GGUF file ---------------------------------------------------------------


def write_vocab_gguf(path: Path, arch: str, md: dict) -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_tokenizer_model(md["tokenizer.ggml.model"])
    if "tokenizer.ggml.pre" in md:
        w.add_tokenizer_pre(md["tokenizer.ggml.pre"])
    w.add_token_list(md["tokenizer.ggml.tokens"])
    w.add_token_types(md["tokenizer.ggml.token_type"])
    if "tokenizer.ggml.scores" in md:
        w.add_token_scores([float(x) for x in md["tokenizer.ggml.scores"]])
    if "tokenizer.ggml.merges" in md:
        w.add_token_merges(md["tokenizer.ggml.merges"])
    w.add_bos_token_id(md["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(md["tokenizer.ggml.eos_token_id"])
    if "tokenizer.ggml.add_space_prefix" in md:
        w.add_add_space_prefix(md["tokenizer.ggml.add_space_prefix"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize(
    "arch, md",
    [
        ("qwen2", bpe_metadata(HELLO_MERGES)),
        ("llama", spm_metadata({"▁": -3, "h": -3, "i": -3, "▁h": -2, "▁hi": -1})),
    ],
)
def test_from_gguf_file(tmp_path, arch, md):
    g = GGUFFile(write_vocab_gguf(tmp_path / "vocab.gguf", arch, md))
    from_file, from_dict = Tokenizer.from_gguf(g), Tokenizer.from_metadata(md)
    text = "<|im_start|>hello world hi é<|im_end|>"
    assert from_file.encode(text) == from_dict.encode(text)
    assert from_file.decode(from_file.encode(text)) == from_dict.decode(from_dict.encode(text))
    assert from_file.vocab_size == len(md["tokenizer.ggml.tokens"])


# ---- byte-level BPE against Hugging Face `tokenizers` as an independent oracle -------------------


@pytest.mark.parametrize("pre, ignore_merges", [("qwen2", False), ("llama-bpe", True), ("gpt2", False)])
def test_bpe_matches_hf_tokenizers(pre, ignore_merges):
    hf_tok = pytest.importorskip("tokenizers")
    import inspect
    import random

    from hydra_console.engine.text import tokenizer as module
    from hydra_console.engine.text.bpe import PRE_TOKENIZERS

    corpus = "\n".join(inspect.getdoc(obj) or "" for _, obj in inspect.getmembers(module))
    corpus += " naïve façade 中文字符测试 Ελληνικά 🐍🚀 12345 1,000,000 it's I'LL we've\r\n\t  x"
    hf = hf_tok.Tokenizer(hf_tok.models.BPE(ignore_merges=ignore_merges))
    hf.pre_tokenizer = hf_tok.pre_tokenizers.Sequence(
        [
            hf_tok.pre_tokenizers.Split(hf_tok.Regex(PRE_TOKENIZERS[pre][0]), behavior="isolated"),
            hf_tok.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = hf_tok.trainers.BpeTrainer(
        vocab_size=1200, initial_alphabet=hf_tok.pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    hf.train_from_iterator([corpus], trainer)
    model = json.loads(hf.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    tok = Tokenizer.from_metadata(
        {
            "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.pre": pre,
            "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.add_bos_token": False,
        }
    )
    rnd = random.Random(0)
    samples = [corpus[i : i + rnd.randint(1, 200)] for i in (rnd.randrange(len(corpus)) for _ in range(300))]
    samples += ["".join(rnd.choice("ab AB1 2'\n\r\t.,é中🐍-_") for _ in range(rnd.randint(1, 30))) for _ in range(300)]
    wrong = [(s, hf.encode(s).ids, tok.encode(s)) for s in samples if hf.encode(s).ids != tok.encode(s)]
    assert not wrong, f"{len(wrong)} of {len(samples)} differ, first: {wrong[:2]}"


def test_spm_matches_sentencepiece():
    # llama-2 style: add_space_prefix (SentencePiece's dummy prefix), byte fallback, no normalization
    spm = pytest.importorskip("sentencepiece")
    import inspect
    import io
    import random

    from hydra_console.engine.text import tokenizer as module

    corpus = "\n".join(inspect.getdoc(obj) or "" for _, obj in inspect.getmembers(module))
    corpus += "\nnaïve façade 中文字符测试 Ελληνικά 12345"
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter([line for line in corpus.split("\n") if line.strip()]),
        model_writer=model,
        vocab_size=800,
        model_type="bpe",
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=True,
        allow_whitespace_only_pieces=True,
        minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    ids = range(sp.get_piece_size())
    kinds = [(sp.is_unknown, 2), (sp.is_control, CONTROL), (sp.is_byte, BYTE), (sp.is_unused, 5)]
    tok = Tokenizer.from_metadata(
        {
            "tokenizer.ggml.model": "llama",
            "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in ids],
            "tokenizer.ggml.scores": [sp.get_score(i) for i in ids],
            "tokenizer.ggml.token_type": [next((t for test, t in kinds if test(i)), NORMAL) for i in ids],
            "tokenizer.ggml.bos_token_id": sp.bos_id(),
            "tokenizer.ggml.eos_token_id": sp.eos_id(),
            "tokenizer.ggml.unknown_token_id": sp.unk_id(),
        }
    )
    assert tok.add_space_prefix  # the SPM default
    rnd = random.Random(0)
    samples = [corpus[i : i + rnd.randint(1, 200)] for i in (rnd.randrange(len(corpus)) for _ in range(300))]
    samples += ["".join(rnd.choice("ab AB1 2'\n.,é中🐍-_") for _ in range(rnd.randint(1, 30))) for _ in range(300)]
    wrong = [(s, sp.encode(s)) for s in samples if sp.encode(s) != tok.encode(s, add_special=False)]
    assert not wrong, f"{len(wrong)} of {len(samples)} differ, first: {wrong[:2]}"
    assert all(tok.decode(tok.encode(s)[1:]) == s for s in samples)
