"""The output processor: turns what the scheduler appended to a sequence into `Event`s for its sink.

Streaming detokenization holds back half a UTF-8 character (`StreamDecoder`) and any text that may
still turn out to start a stop string; a stop string ends the request there (no text after it, and
tokens after it are taken back). It also keeps the per-request timings and adds each request's
prompt and predicted totals to the engine's stats.
"""

from __future__ import annotations

import time

import torch

from ..text.stream_decoder import StreamDecoder
from .scheduler import Sampled
from .sequence import Event, GenToken, Sequence


class _Stream:
    """One request's output state while it runs."""

    def __init__(self, seq: Sequence, tok):
        self.decoder = StreamDecoder(tok, keep=seq.req.preserved_tokens)
        self.n_seen = seq.n_prompt  # the sequence's tokens before this one (of `n_total`) went to the decoder
        self.held_text = ""  # text that may still turn out to start a stop string
        self.held_tokens: list[GenToken] = []
        self.emitted_in_held = 0  # chars of the first held tokens' text already passed on
        self.t_first: float | None = None
        self.t_last: float | None = None  # when its latest tokens came (inter-token latency)
        self.stop_word = ""  # the stop string that ended the request
        self.n_processed = seq.n_cached  # prompt tokens in the KV as last reported (return_progress)


class OutputProcessor:
    """Events for every sequence a step touched. `stats` takes the totals (`add_prompt`,
    `add_predicted`): the engine's `EngineStats`."""

    def __init__(self, tok, stats):
        self.tok = tok
        self.stats = stats
        self._streams: dict[Sequence, _Stream] = {}

    def process(self, seq: Sequence, sampled: Sampled | None = None, error: BaseException | None = None) -> None:
        """Send `seq`'s new output: its prompt logprobs, the text of its new tokens, and, when it has
        finished, what is held back and the final event."""
        st = self._streams.get(seq)
        if st is None:
            st = self._streams[seq] = _Stream(seq, self.tok)
            if seq.req.return_progress:  # llama-server's first report: the slot taken, only the cache
                self._progress(seq, seq.n_cached)
        if seq.req.return_progress and min(seq.n_past, seq.n_prompt) > st.n_processed:
            st.n_processed = min(seq.n_past, seq.n_prompt)
            self._progress(seq, st.n_processed)
        if sampled is not None and sampled.prompt_logprobs is not None:
            seq.req.sink(Event(prompt_logprobs=sampled.prompt_logprobs))
        new = seq.since(st.n_seen)
        if not seq.prefilling and st.t_first is None:
            st.t_first = st.t_last = time.perf_counter()
            self.stats.add_prompt(seq.n_prompt - seq.n_cached, st.t_first - seq.t_start, seq.n_cached)
            self.stats.add_first_token(st.t_first, st.t_first - seq.req.t_submit)
        elif new and st.t_last is not None:
            now = time.perf_counter()
            self.stats.add_tokens(now, now - st.t_last, len(new))
            st.t_last = now
        if seq.at_eog:
            new = new[:-1]  # the end-of-generation token counts in usage but is never shown
        logprobs = sampled.logprobs if sampled is not None else [None] * len(new)
        at_stop_string = False
        for i, tid in enumerate(new):
            piece = st.decoder.push(tid)
            st.held_tokens.append(GenToken(tid, piece, logprobs[i]))
            if self._release(seq, st, piece):
                seq.take_back(seq.n_total - (st.n_seen + i + 1))
                seq.finish_reason = "stop"
                at_stop_string = True
                break
        st.n_seen = seq.n_total
        if seq.finish_reason is not None:
            self._finish(seq, st, at_stop_string, error)

    @staticmethod
    def _progress(seq: Sequence, processed: int) -> None:
        t = timings(seq, None, time.perf_counter(), processed)
        progress = {"total": seq.n_prompt, "cache": seq.n_cached, "processed": processed, "time_ms": t["prompt_ms"]}
        seq.req.sink(Event(progress=progress, timings=t if seq.req.timings_per_token else None))

    def _release(self, seq: Sequence, st: _Stream, piece: str) -> bool:
        """Pass on text that can no longer start a stop string; True when a stop string ended the request."""
        text = st.held_text + piece
        stops = seq.req.stop
        found = [(i, s) for s in stops if (i := text.find(s)) >= 0]
        if found:
            cut, st.stop_word = min(found)
            st.held_text = text[:cut]
            return True
        keep = max(
            (k for s in stops for k in range(min(len(s) - 1, len(text)), 0, -1) if s.startswith(text[-k:])), default=0
        )
        st.held_text = text[len(text) - keep :]
        self._emit(seq, st, text[: len(text) - keep])
        return False

    def _emit(self, seq: Sequence, st: _Stream, text: str, final: bool = False) -> None:
        """Send `text` with the held tokens it covers (all of them when `final`)."""
        if final:
            tokens, st.held_tokens, st.emitted_in_held = st.held_tokens, [], 0
        else:
            avail, covered, n = st.emitted_in_held + len(text), 0, 0
            for t in st.held_tokens:
                if covered + len(t.text) > avail:
                    break
                covered += len(t.text)
                n += 1
            tokens, st.held_tokens = st.held_tokens[:n], st.held_tokens[n:]
            st.emitted_in_held = avail - covered
        if text or tokens:
            per_token = timings(seq, st.t_first, time.perf_counter()) if seq.req.timings_per_token else None
            seq.req.sink(Event(text=text, tokens=tokens, timings=per_token))

    def _finish(self, seq: Sequence, st: _Stream, at_stop_string: bool, error: BaseException | None) -> None:
        """Deliver what is held back (text after a stop string is dropped, otherwise nothing is) and
        the final event."""
        del self._streams[seq]
        now = time.perf_counter()
        if not at_stop_string:
            st.held_text += st.decoder.flush()
        self._emit(seq, st, st.held_text, final=True)
        if st.t_first is not None:
            self.stats.add_predicted(seq.n_gen, now - st.t_first)
        self.stats.add_finished(now)
        seq.req.sink(
            Event(
                finish_reason=seq.finish_reason,
                usage={
                    "prompt_tokens": seq.n_prompt,
                    "completion_tokens": seq.n_gen,
                    "total_tokens": seq.n_prompt + seq.n_gen,
                    "prompt_tokens_details": {"cached_tokens": seq.n_cached},
                },
                timings=timings(seq, st.t_first, now),
                error=error,
                hidden=torch.cat(seq.hidden) if seq.req.embedding and seq.finish_reason == "length" else None,
                stop_word=st.stop_word,
                truncated=seq.truncated,
            )
        )


def timings(seq: Sequence, t_first: float | None, now: float, processed: int | None = None) -> dict:
    """llama-server's `timings`: prompt time runs from taking the slot to the first token; while the
    prompt is computed (a progress report), `processed` prompt tokens are in the KV so far and the
    time runs to `now` (0 before the first batch). Generation rates are over decode steps: the first
    token comes with the prompt's last batch."""
    if processed is not None:
        n = processed - seq.n_cached
        prompt_ms, predicted_ms = ((now - seq.t_start) * 1e3 if n else 0.0), 0.0
    else:
        t_first = t_first if t_first is not None else now
        prompt_ms = (t_first - seq.t_start) * 1e3
        predicted_ms = (now - t_first) * 1e3
        n = seq.n_prompt - seq.n_cached  # prompt tokens computed: the cached prefix cost nothing
    steps = max(seq.n_gen - 1, 0)
    return {
        "cache_n": seq.n_cached,
        "prompt_n": n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / n if n else 0.0,
        "prompt_per_second": n / prompt_ms * 1e3 if prompt_ms > 0 else 0.0,
        "predicted_n": seq.n_gen,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / steps if steps else 0.0,
        "predicted_per_second": steps / predicted_ms * 1e3 if predicted_ms > 0 else 0.0,
        "draft_n": seq.n_drafted,
        "draft_n_accepted": seq.n_accepted,
        **(
            {
                "transfer_bytes": seq.transfer.bytes,
                "transfer_ms": seq.transfer.ms,
                "transfer_fallback": seq.transfer.fallback,
            }
            if seq.transfer is not None
            else {}
        ),
    }
