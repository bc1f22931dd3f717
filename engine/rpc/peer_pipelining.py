"""A prompt's chunks sent to a peer without waiting (FORWARD_ACK): the head computes the next chunk
while the peer computes this one, and the replies are read later, in order."""

from __future__ import annotations

import time

import torch

from ...contracts.rpc import CAP_FORWARD_ACK, Cmd, StaleEpoch
from ..device import to_host
from .forward_frames import pack_forward, pack_forward_out
from .peer_errors import PeerError, PeerUnavailable


class PipelinedSends:
    """`RemoteStage`'s pipelined sends: they use its lock, `_send`, `_forward_reply`, `_down`,
    `_account` and the `_unread` count its other exchanges settle first."""

    def can_pipeline(self) -> bool:
        """Whether `send_layers` may be used: pipelining is on, the peer knows FORWARD_ACK, and the
        hidden states go over the socket (a CUDA IPC channel has one inbox: one frame at a time)."""
        return self.pipeline_depth > 0 and bool(self._caps & CAP_FORWARD_ACK) and self._ipc is None

    def send_layers(self, h: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor) -> None:
        """This peer's layers over `h`, no output wanted (a prompt chunk before its last, this the
        last stage): the frame goes out and the caller goes on while the peer computes. The peer runs
        its frames in order; their replies are read before anything else uses this connection
        (`settle`), and before this frame when `pipeline_depth` of them are already waiting. Where
        an MTP block there follows every batch, the chunk goes as FORWARD_OUT asking for no rows,
        with the `tokens` the block reads (FORWARD_ACK carries none); its reply is the status alone
        as well."""
        with self._lock:
            if self.state != "up":
                raise PeerUnavailable(f"peer {self.addr} is down ({self.error}); retry when it is back")
            with self._lost_on_error("failed mid-request"):
                if self._unread >= self.pipeline_depth:
                    self._read_acks(1)
                hidden, slots, positions = to_host(h), slots.cpu(), positions.cpu()
                if self.mtp:
                    no_rows = torch.zeros(0, dtype=torch.long)
                    frame = pack_forward_out(self.epoch, hidden, slots, positions, no_rows, to_host(tokens), False)
                    self._send(Cmd.FORWARD_OUT, frame)
                else:
                    self._send(Cmd.FORWARD_ACK, pack_forward(self.epoch, hidden, slots, positions))
                self._unread += 1
                self.pipelined += 1
                self._pipelined_at = time.monotonic()

    def settle(self) -> None:
        """Read the replies of the pipelined chunks still outstanding (see `_settle`)."""
        with self._lock:
            if self._unread:
                with self._lost_on_error("failed mid-request"):
                    self._settle()

    def _settle(self) -> None:
        """Every outstanding FORWARD_ACK reply, read (the caller holds the lock). A peer that
        replaced its resident set meanwhile: StaleEpoch once all are read (the pipeline re-attaches and
        replays). A chunk it could not run leaves its KV unknown: the session is dropped (the
        watcher re-attaches and the pipeline replays the active slots), PeerUnavailable."""
        stale = None
        while self._unread:
            try:
                self._read_acks(1)
            except StaleEpoch as e:
                stale = e
        if stale is not None:
            raise stale

    def _read_acks(self, n: int) -> None:
        for _ in range(n):
            self._unread -= 1
            try:
                self.compute_ms = self._forward_reply(0) / 1e3
            except StaleEpoch:
                raise
            except PeerError as e:
                raise PeerUnavailable(f"a pipelined prompt chunk failed there ({e})") from None
