"""OpenAI's logprobs objects from the engine's: the completions API's parallel lists
(`CompletionLogprobs`, `merge_logprobs`) and the chat API's `content` entries (`chat_logprob_content`);
a token as its text, or as `token_id:N` (`return_tokens_as_token_ids`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..serving.sampling_params import TokenLogprob
    from ..serving.sequence import GenToken
    from .handle import Head


def token_str(head: Head, tid: int, as_ids: bool, text: str | None = None) -> str:
    if as_ids:
        return f"token_id:{tid}"
    return text if text is not None else head.tok.token_bytes(tid).decode("utf-8", "replace")


class CompletionLogprobs:
    """OpenAI completions logprobs: parallel lists tokens / token_logprobs / top_logprobs / text_offset."""

    def __init__(self, head: Head, as_ids: bool, offset: int = 0):
        self.head, self.as_ids, self.offset = head, as_ids, offset

    def add(self, entries: list[tuple[TokenLogprob, str | None]]) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for lp, text in entries:
            s = token_str(self.head, lp.token, self.as_ids, text)
            out["tokens"].append(s)
            out["token_logprobs"].append(lp.logprob)
            out["top_logprobs"].append(
                None if lp.logprob is None else {token_str(self.head, t, self.as_ids): v for t, v in lp.top}
            )
            out["text_offset"].append(self.offset)
            self.offset += len(text if text is not None else s)
        return out


def merge_logprobs(parts: list[dict]) -> dict:
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for p in parts:
        for k in out:
            out[k] += p[k]
    return out


def chat_logprob_content(head: Head, tokens: list[GenToken], as_ids: bool) -> list[dict]:
    def entry(tid: int, lp: float, text: str | None = None) -> dict:
        s = token_str(head, tid, as_ids, text)
        return {"token": s, "logprob": lp, "bytes": list(head.tok.token_bytes(tid))}

    return [
        {**entry(t.id, t.logprob.logprob, t.text), "top_logprobs": [entry(i, v) for i, v in t.logprob.top]}
        for t in tokens
        if t.logprob is not None
    ]
