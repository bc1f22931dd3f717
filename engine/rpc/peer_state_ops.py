"""A peer's layers of a slot, out and in (contracts.slot_state): STATE_META / STATE_GET / STATE_PUT,
each on a connection of its own joined to the head's session, so a slot's state streams while the
forwards go on over the main connection."""

from __future__ import annotations

from ...contracts.rpc import STATE_SLOT, Cmd, StateGetRequest, StateMeta
from ...contracts.rpc import ReplyStatus as R
from ...contracts.wire_json import WireError
from .peer_errors import PeerError, PeerUnavailable
from .wire import FrameError, read_compute_response, reply_status


class SlotStateOps:
    """`RemoteStage`'s state ops: they use its `_handshake`, `_exchange`, `_send`, `state_key`, `state`,
    `layer_range`, `max_frame` and byte counters."""

    def state_meta(self, slot: int) -> dict:
        return self._state_reply(self._state_call(Cmd.STATE_META, [STATE_SLOT.pack(slot)]))

    def state_get(self, slot: int, tokens: list[int]) -> memoryview:
        """The state of `slot`'s first len(tokens) positions on this peer's layers (a view of the
        reply as it was received: no copy)."""
        limit = 1 + self._tensors.slot_state_bound([self.layer_range], len(tokens))  # + the status byte
        return self._state_call(Cmd.STATE_GET, [StateGetRequest(slot=slot, tokens=list(tokens)).encode()], limit)

    def state_put(self, slot: int, state) -> dict:
        """Place a state of this peer's layers into `slot`; a refusal (PeerError) leaves it as it was."""
        return self._state_reply(self._state_call(Cmd.STATE_PUT, [STATE_SLOT.pack(slot), state]))

    def _state_reply(self, body) -> dict:
        """A `StateMeta` reply, checked against its layout, as JSON."""
        try:
            return StateMeta.decode(body).to_json()
        except WireError as e:
            raise PeerError(f"peer {self.addr}: {e}") from None

    def _state_call(self, cmd: int, parts: list, limit: int | None = None) -> memoryview:
        """One state op on a connection of its own, joined to our session (STATE_JOIN): a slot's
        state streams while the forwards go on over the main connection. A peer that fails here is
        not marked down (the main connection's next exchange tells)."""
        if self.state != "up":
            raise PeerUnavailable(f"peer {self.addr} is down ({self.error})")
        link = None
        try:
            link = self._handshake()
            status, body = reply_status(self._exchange(Cmd.STATE_JOIN, self.state_key, link))
            if status != R.OK:
                raise PeerError(f"peer {self.addr}: {body.decode('utf-8', 'replace')}")
            self._send(cmd, parts, link)
            reply = read_compute_response(link[1], min(limit or self.max_frame, self.max_frame))
        except (OSError, FrameError) as e:
            raise PeerUnavailable(f"peer {self.addr} failed during a state op: {e}") from None
        finally:
            if link is not None:
                link[0].close()
                self.bytes_recv += link[1].bytes_in
        if not reply:
            raise PeerError(f"peer {self.addr} sent an empty reply")
        body = memoryview(reply)[1:]
        if reply[0] != R.OK:
            raise PeerError(f"peer {self.addr}: {bytes(body).decode('utf-8', 'replace')}")
        return body
