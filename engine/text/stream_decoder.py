"""Generated token ids to text as they come (the tokenizer's streaming side)."""

from __future__ import annotations

import codecs

from .spm import SPM_SPACE
from .tokenizer import Tokenizer


class StreamDecoder:
    """Turns generated ids into text as they come, never emitting half a UTF-8 character.

    skip_special defaults to True: control tokens are not part of generated text, as llama-server
    prints it, but for those in `keep`. No space is stripped (a continuation keeps its leading space)."""

    def __init__(self, tok: Tokenizer, skip_special: bool = True, keep: frozenset[int] = frozenset()):
        self.tok = tok
        self.skip_special = skip_special
        self.keep = keep
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, tid: int) -> str:
        if self.skip_special and self.tok.is_special(tid) and tid not in self.keep:
            return ""
        text = self._utf8.decode(self.tok.token_bytes(tid))
        return text.replace(SPM_SPACE, " ") if self.tok.is_spm else text

    def flush(self) -> str:
        """What is still held back (an incomplete character becomes U+FFFD); resets the decoder."""
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text
