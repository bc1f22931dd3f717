"""The compute framing (ggml-rpc's) and the engine's socket helpers; the readers and the control
framing are the contracts' (contracts/framing.py), shared with the console, and re-exported here.

Compute (ggml-rpc style):  request  `cmd u8 | size u64 LE | payload`,  response `size u64 LE | payload`.
Hydra control (the fork's): contracts/framing.py.

Parsers read from anything with `read_exact(n) -> bytes-like` (a socket or a byte buffer), so the
same code is fuzzed in memory and served on sockets. A malformed frame raises `FrameError`; the
server closes that one connection.
"""

from __future__ import annotations

import select
import socket
import time

from ...contracts.framing import (
    BufferReader,
    ControlHeader,
    ControlRequest,
    ControlResponse,
    FrameError,
    FrameTimeout,
    PeerClosed,
    SocketReader,
    control_response_head,
    pack_control_request,
    pack_control_response,
    read_control_body,
    read_control_header,
    read_control_request,
    read_control_response,
)
from ...contracts.rpc import COMPUTE_HEADER, COMPUTE_SIZE

__all__ = [
    "AuthFailed",
    "BufferReader",
    "ControlHeader",
    "ControlRequest",
    "ControlResponse",
    "FrameError",
    "FrameTimeout",
    "PeerClosed",
    "Refused",
    "SocketReader",
    "control_response_head",
    "pack_compute_request",
    "pack_control_request",
    "pack_control_response",
    "read_compute_header",
    "read_compute_request",
    "read_compute_response",
    "read_compute_response_size",
    "read_control_body",
    "read_control_header",
    "read_control_request",
    "read_control_response",
    "send_all",
    "spin_until_readable",
]

SEND_FLAGS = getattr(socket, "MSG_NOSIGNAL", 0)  # a dead peer must not SIGPIPE the worker


class Refused(FrameError):
    """A frame the server refuses before reading its payload; `reply` (may be empty) goes out first."""

    def __init__(self, message: str, reply: bytes = b""):
        super().__init__(message)
        self.reply = reply


class AuthFailed(Refused):
    """A handshake that failed to prove the token: the listener slows its sender down."""


# --- transports -----------------------------------------------------------------------------------


def spin_until_readable(sock: socket.socket, budget_s: float) -> None:
    """Poll `sock` without sleeping until it has data or `budget_s` has passed (then the caller's
    blocking read takes over: behaviour is the same, only the wait differs)."""
    if budget_s <= 0:
        return
    deadline = time.perf_counter() + budget_s
    while not select.select([sock], [], [], 0)[0] and time.perf_counter() < deadline:
        pass


def send_all(sock: socket.socket, *parts, on_idle=None) -> int:
    """Send buffers back to back with MSG_NOSIGNAL, coping with partial sends; returns bytes sent.
    With `on_idle`, a socket timeout (the other side not reading: busy with earlier frames) calls
    it (it raises to abort) and the send resumes: a timed-out send sent nothing."""
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    total = sum(len(v) for v in views)
    while views:
        try:
            sent = sock.sendmsg(views, [], SEND_FLAGS)
        except socket.timeout:
            if on_idle is None:
                raise
            on_idle()
            continue
        while sent:
            if sent >= len(views[0]):
                sent -= len(views[0])
                views.pop(0)
            else:
                views[0] = views[0][sent:]
                sent = 0
    return total


# --- compute framing ------------------------------------------------------------------------------


def read_compute_header(reader, max_frame: int) -> tuple[int, int]:
    cmd, size = COMPUTE_HEADER.unpack(reader.read_exact(COMPUTE_HEADER.size))
    if size > max_frame:
        raise FrameError(f"compute frame of {size} bytes exceeds the {max_frame}-byte limit (cmd {cmd})")
    return cmd, size


def read_compute_request(reader, max_frame: int) -> tuple[int, bytes]:
    cmd, size = read_compute_header(reader, max_frame)
    return cmd, reader.read_exact(size)


def pack_compute_request(cmd: int, payload: bytes = b"") -> bytes:
    return COMPUTE_HEADER.pack(cmd, len(payload)) + payload


def read_compute_response_size(reader, max_frame: int) -> int:
    (size,) = COMPUTE_SIZE.unpack(reader.read_exact(COMPUTE_SIZE.size))
    if size > max_frame:
        raise FrameError(f"compute response of {size} bytes exceeds the {max_frame}-byte limit")
    return size


def read_compute_response(reader, max_frame: int) -> bytes:
    return reader.read_exact(read_compute_response_size(reader, max_frame))


def reply_status(reply) -> tuple[int, bytes]:
    """A compute reply's status byte and body."""
    if not reply:
        raise FrameError("empty reply")
    return reply[0], bytes(reply[1:])
