"""A tokenizer small enough to read: what the engine and its output processor use of one (bytes per
id, which ids are special, which end generation), with no model file."""

from __future__ import annotations

PIECES = [b"<s>", b"he", b"llo", b" wor", b"ld", b"\xc3", b"\xa9", b"!", b"</s>"]
EOS = 8


class FakeTokenizer:
    is_spm = False
    eog_ids = {EOS}
    vocab_size = len(PIECES)

    def is_special(self, tid: int) -> bool:
        return tid in (0, EOS)

    def token_bytes(self, tid: int) -> bytes:
        return PIECES[tid]
