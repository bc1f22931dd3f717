"""A last peer that holds the output (`--output-stage last`): the logits come back instead of the
hidden states (FORWARD_OUT), and its MTP block drafts there (DRAFT)."""

from __future__ import annotations

import math
import time

import numpy as np
import torch

from ...contracts.rpc import AHEAD_DRAFT, MAX_RUN, Cmd, DraftAsk, DraftReply
from ...contracts.rpc import ReplyStatus as R
from ...contracts.wire_json import WireError
from ..device import host_buffer, to_host
from .exchange_lock import run_meanwhile
from .forward_frames import pack_forward_out
from .peer_errors import PeerError, PeerUnavailable
from .wire import FrameError, reply_status


class OutputOps:
    """`RemoteStage`'s output ops: they use its lock, `_send`, `_forward_reply`, `_settle`,
    `_request` and `_lost_on_error`. `output`/`mtp`: what its LOAD_STAGE asks the peer to hold."""

    output = mtp = False
    ahead_drafts: dict[int, tuple[int, int, list[int]]]  # slot -> (position, token, draft): `take_ahead`

    def run_output(self, h, slots, positions, tokens, rows, want_hidden: bool, argmax: bool, ahead=(), meanwhile=None):
        """This peer's layers over `h`, then its output: (float32 logits of `rows` [R, n_vocab] on
        `h`'s device, every row's normed hidden state or None). `tokens` (the batch's ids) go along
        when the peer's MTP block follows the target. With `argmax` only each row's argmax comes
        back (4 bytes, not 4 x n_vocab), and the rows are that token at 0 and -inf elsewhere: what a
        greedy pick reads of them. `ahead`: (slot, drafted, k, p_min) of the slots that verify a
        greedy draft in this batch; the drafts the peer makes from their outcome wait in
        `ahead_drafts` for the next step (`take_ahead`). The hidden states cross the socket even
        where a CUDA IPC channel exists: its outbox holds hidden states, not logit rows."""
        failed, busy = None, 0.0
        with self._lock:
            if self.state != "up":
                raise PeerUnavailable(f"peer {self.addr} is down ({self.error}); retry when it is back")
            with self._lost_on_error("failed mid-request"):
                self._settle()
                t0 = time.perf_counter()
                hidden = to_host(h)
                ids = to_host(tokens) if self.mtp else None
                frame = pack_forward_out(
                    self.epoch, hidden, slots.cpu(), positions.cpu(), rows.cpu(), ids, want_hidden, argmax, ahead
                )
                self._send(Cmd.FORWARD_OUT, frame)
                failed, busy = run_meanwhile(meanwhile)
                want = [((rows.numel(),), torch.int32) if argmax else ((rows.numel(), self.n_vocab), torch.float32)]
                want += [((hidden.shape[0], hidden.shape[1]), torch.float32)] if want_hidden else []
                most = len(ahead) * (AHEAD_DRAFT.size + 4 * MAX_RUN)
                compute_us = self._forward_reply(sum(4 * math.prod(shape) for shape, _ in want), most)
                outs = []
                for shape, dtype in want:
                    out = host_buffer(shape, dtype, h.device)
                    self._reader.read_into(memoryview(out.view(-1).view(torch.uint8).numpy()))
                    outs.append(out.to(h.device, non_blocking=True))  # from page-locked memory: the device orders it
                self._read_ahead(ahead)
            self.compute_ms = compute_us / 1e3
            self._rtts.note(max((time.perf_counter() - t0 - busy) * 1e3 - self.compute_ms, 0.0))
        if failed is not None:
            raise failed
        logits = outs[0]
        if argmax:
            picks, logits = logits.long(), torch.full((rows.numel(), self.n_vocab), -torch.inf, device=h.device)
            logits[torch.arange(rows.numel(), device=h.device), picks] = 0.0
        return logits, (outs[1] if want_hidden else None)

    def _read_ahead(self, ahead) -> None:
        """The reply's drafts ahead (the `_more` bytes after its tensors), one per entry asked for."""
        left = self._more
        for slot, _, k, _ in ahead:
            if left < AHEAD_DRAFT.size:
                raise FrameError(f"peer {self.addr}: FORWARD_OUT reply short of its drafts ahead")
            position, token, count = AHEAD_DRAFT.unpack(self._reader.read_exact(AHEAD_DRAFT.size))
            left -= AHEAD_DRAFT.size
            if count > k or 4 * count > left:
                raise FrameError(f"peer {self.addr}: a draft ahead of {count} tokens where at most {k} were asked")
            draft = np.frombuffer(bytes(self._reader.read_exact(4 * count)), dtype=np.int32).tolist()
            left -= 4 * count
            if any(not 0 <= t < self.n_vocab for t in (token, *draft)):
                raise FrameError(f"peer {self.addr}: a draft ahead with a token id outside 0..{self.n_vocab - 1}")
            self.ahead_drafts[slot] = (position, token, draft)
        if left:
            raise FrameError(f"peer {self.addr}: {left} bytes after a FORWARD_OUT reply's drafts ahead")

    def take_ahead(self, slot: int, position: int, token: int) -> list[int] | None:
        """The draft the last FORWARD_OUT made for `slot` when it starts from `token` at `position`
        (what the head emitted last), else None; taken once."""
        kept = self.ahead_drafts.pop(slot, None)
        return kept[2] if kept is not None and kept[:2] == (position, token) else None

    def draft(self, ask: DraftAsk) -> list[list[int]]:
        """DRAFT: the peer's MTP block's drafts, one list per slot asked (each at most its k)."""
        with self._lock:
            if self.state != "up":
                raise PeerUnavailable(f"peer {self.addr} is down ({self.error}); retry when it is back")
            with self._lost_on_error("failed drafting"):
                status, body = reply_status(self._exchange(Cmd.DRAFT, ask.encode()))
        if status != R.OK:
            raise PeerError(f"peer {self.addr} refused DRAFT: {body.decode('utf-8', 'replace')}")
        try:
            reply = DraftReply.decode(body)
        except WireError as e:
            raise PeerError(f"peer {self.addr} answered DRAFT badly: {e}") from None
        if len(reply.counts) != len(ask.slots) or sum(reply.counts) != len(reply.tokens):
            raise PeerError(f"peer {self.addr} answered DRAFT with {len(reply.counts)} drafts for {len(ask.slots)}")
        if any(n > k for n, k in zip(reply.counts, ask.ks)):
            raise PeerError(f"peer {self.addr} answered DRAFT with a draft longer than asked")
        if any(t >= self.n_vocab for t in reply.tokens):
            raise PeerError(f"peer {self.addr} answered DRAFT with a token id outside 0..{self.n_vocab - 1}")
        out, i = [], 0
        for n in reply.counts:
            out.append(reply.tokens[i : i + n])
            i += n
        return out
