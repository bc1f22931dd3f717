"""What one HTTP client may hold of a worker's HTTP server (config.HttpLimits), enforced where
uvicorn's h11 protocol meets the socket, before any request exists:

- connection caps: open connections in all (`--max-connections`, below the descriptor limit) and
  per client address (`--max-client-connections`); a connection beyond either is answered 503 in
  OpenAI's shape at once and closed (once its client has, or after LINGER_S: what it sends
  meanwhile is dropped), so the descriptors never run out and other clients are served;
- a header deadline (`--header-timeout`): a request's headers must be complete within it, counted
  from the connection's start or from the end of the previous response; else the connection is
  closed (slowloris: sockets that send part of their headers and wait);
- a body deadline (`--body-timeout`): once the headers are in, the body must be too within it;
  else 408 (if nothing was answered yet) and the connection is closed.

The header deadline also closes an idle kept-alive connection (uvicorn's own `timeout_keep_alive` is
set to it: worker.py says why); h11's `max_incomplete_event_size` (16 KiB) bounds the headers'
size.
"""

from __future__ import annotations

import asyncio
import json
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..config import HttpLimits

log = logging.getLogger("hydra.http")

LINGER_S = 0.5  # a refused connection is closed once its client has, or after this


def _answer(status: int, reason: str, message: str, type_: str, code: str, extra: str = "") -> bytes:
    body = json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}}).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
        f"{extra}connection: close\r\n\r\n"
    )
    return head.encode() + body


class Throttled:
    """A warning at most every `every` seconds, with how many like it were not written: a flood of
    refused sockets must not flood the log."""

    def __init__(self, every: float = 5.0):
        self.every, self.last, self.held = every, float("-inf"), 0

    def warn(self, loop: asyncio.AbstractEventLoop, msg: str, *args) -> None:
        now = loop.time()
        if now - self.last < self.every:
            self.held += 1
            return
        more = f" (and {self.held} more like it)" if self.held else ""
        log.warning(msg + more, *args)
        self.last, self.held = now, 0


class Connections:
    """Open connections, in all and per client address."""

    def __init__(self, limits: HttpLimits):
        self.limits = limits
        self.total = 0
        self.by_client: dict[str | None, int] = {}

    def admit(self, client: str | None) -> str | None:
        """Count a new connection in; or why it is refused (nothing counted)."""
        if self.total >= self.limits.max_connections:
            return f"the server holds its limit of {self.limits.max_connections} connections (--max-connections)"
        if self.by_client.get(client, 0) >= self.limits.max_client_connections:
            return (
                f"{client} holds its limit of {self.limits.max_client_connections} connections "
                "(--max-client-connections)"
            )
        self.total += 1
        self.by_client[client] = self.by_client.get(client, 0) + 1
        return None

    def release(self, client: str | None) -> None:
        self.total -= 1
        left = self.by_client[client] - 1
        if left:
            self.by_client[client] = left
        else:
            del self.by_client[client]


def guarded_h11(limits: HttpLimits) -> type[H11Protocol]:
    """uvicorn's h11 protocol with `limits`' caps and deadlines: a class per server (its counts)."""
    connections = Connections(limits)
    refused, expired = Throttled(), Throttled()

    class GuardedH11(H11Protocol):
        counted = False
        deadline: asyncio.TimerHandle | None = None
        phase = ""  # "headers": waiting for a request's headers; "body": for its body; "": neither
        before = None  # the cycle that was current when the headers' deadline was set

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self.address = self.client[0] if self.client else None
            why = connections.admit(self.address)
            if why is not None:
                refused.warn(self.loop, "connection from %s refused: %s", self.address, why)
                self.transport.write(
                    _answer(503, "Service Unavailable", why, "unavailable_error", "unavailable", "retry-after: 1\r\n")
                )
                # A lingering close: what the client sent is read and dropped for a moment, so that its
                # request arriving does not turn our close into a reset that loses the answer.
                if self.transport.can_write_eof():
                    self.transport.write_eof()
                self.deadline = self.loop.call_later(LINGER_S, self.transport.close)
                return
            self.counted = True
            self._expect_headers()

        def connection_lost(self, exc) -> None:
            self._disarm()
            if self.counted:
                self.counted = False
                connections.release(self.address)
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if not self.counted:  # refused: what it sends is dropped
                return
            super().data_received(data)
            self._progress()

        def on_response_complete(self) -> None:
            self._expect_headers()  # first: a pipelined request may be read before this returns
            super().on_response_complete()
            self._progress()

        def _expect_headers(self) -> None:
            self._arm("headers", limits.header_timeout)
            self.before = self.cycle

        def _progress(self) -> None:
            """Move the deadline on as the request arrives."""
            if self.phase == "headers" and self.cycle is not self.before:  # a new request's headers are in
                self._disarm()
                if self.conn.their_state is h11.SEND_BODY:
                    self._arm("body", limits.body_timeout)
            if self.phase == "body" and self.conn.their_state is not h11.SEND_BODY:
                self._disarm()

        def _arm(self, phase: str, seconds: float) -> None:
            self._disarm()
            self.phase = phase
            self.deadline = self.loop.call_later(seconds, self._expired)

        def _disarm(self) -> None:
            if self.deadline is not None:
                self.deadline.cancel()
            self.deadline, self.phase = None, ""

        def _expired(self) -> None:
            phase, self.deadline, self.phase = self.phase, None, ""
            if self.transport.is_closing():
                return
            cycle = self.cycle
            if phase == "body" and cycle is not None and not cycle.response_started:
                why = f"the request body did not arrive within --body-timeout ({limits.body_timeout:g} s)"
                self.transport.write(_answer(408, "Request Timeout", why, "invalid_request_error", "request_timeout"))
            expired.warn(self.loop, "connection from %s closed: no complete request %s in time", self.address, phase)
            if cycle is not None and not cycle.response_complete:
                cycle.disconnected = True  # the app's answer, if any comes, goes nowhere
                cycle.message_event.set()
            self.transport.close()

    return GuardedH11
