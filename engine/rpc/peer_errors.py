"""What the head's peer client raises, and the `--peer HOST:PORT` address it parses."""

from __future__ import annotations

from ..errors import Unavailable, UserError


class PeerError(RuntimeError):
    """A peer could not run a request; the runtime fails that request."""


class PeerUnavailable(PeerError, Unavailable):
    """A peer is down or died mid-request: the request fails (HTTP 503) and the head re-attaches."""


class PeerMismatch(UserError):
    """The peer serves a different model, refuses our protocol version, or rejects our token."""


def parse_addr(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"--peer {text!r}: expected HOST:PORT (the peer's RPC port)")
    return host.strip("[]"), int(port)
