"""Both framings of the merged RPC port, with every length checked before any allocation.

Compute (ggml-rpc style):  request  `cmd u8 | size u64 LE | payload`,  response `size u64 LE | payload`.
Hydra control (the fork's): request  `<HBBHQH` magic 0x4859, op, flags, key_len, payload_len, trace_len,
                            then key, trace id, payload;
                            response status u8 | meta_len u24 | payload_len u64, then meta JSON, payload.

Parsers read from anything with `read_exact(n) -> bytes-like` (a socket or a byte buffer), so the
same code is fuzzed in memory and served on sockets. A malformed frame raises `FrameError`; the
server closes that one connection.
"""

from __future__ import annotations

import json
import select
import socket
import time
from dataclasses import dataclass

from ...contracts.rpc import (
    COMPUTE_HEADER,
    COMPUTE_SIZE,
    CONTROL_HEADER,
    CONTROL_MAGIC,
    CONTROL_RESPONSE,
    DRAIN_CHUNK,
    MAX_META,
    Status,
)

SEND_FLAGS = getattr(socket, "MSG_NOSIGNAL", 0)  # a dead peer must not SIGPIPE the worker


class FrameError(Exception):
    """A frame that breaks the framing: wrong magic, length over the limit, truncated stream."""


class FrameTimeout(FrameError):
    """A frame (or the wait for the next one) outlived its deadline."""


class Refused(FrameError):
    """A frame the server refuses before reading its payload; `reply` (may be empty) goes out first."""

    def __init__(self, message: str, reply: bytes = b""):
        super().__init__(message)
        self.reply = reply


class AuthFailed(Refused):
    """A handshake that failed to prove the token: the listener slows its sender down."""


class PeerClosed(FrameError):
    """The other side closed the connection (possibly between frames)."""


# --- transports -----------------------------------------------------------------------------------


def spin_until_readable(sock: socket.socket, budget_s: float) -> None:
    """Poll `sock` without sleeping until it has data or `budget_s` has passed (then the caller's
    blocking read takes over: behaviour is the same, only the wait differs)."""
    if budget_s <= 0:
        return
    deadline = time.perf_counter() + budget_s
    while not select.select([sock], [], [], 0)[0] and time.perf_counter() < deadline:
        pass


class SocketReader:
    """`read_exact` over a socket; counts bytes received. With `on_idle`, a socket timeout calls it
    (it raises to abort) and the read resumes where it was: no byte is lost to a timeout.
    `prefix`: bytes of the stream already taken off the socket (the listener's handshake reads).
    `expect(seconds)` sets a deadline for everything read until the next `expect`: a whole frame
    (or the wait for one) must arrive by then, however slowly its bytes trickle in. After a read
    under a deadline the socket's timeout goes back to `send_timeout`, which then bounds each
    send of the reply (a client that never reads cannot hold the server's thread)."""

    def __init__(self, sock: socket.socket, on_idle=None, prefix: bytes = b"", send_timeout: float | None = None):
        self.sock = sock
        self.on_idle = on_idle
        self.prefix = memoryview(bytes(prefix))
        self.send_timeout = send_timeout
        self.deadline: float | None = None
        self.bytes_in = 0

    def expect(self, seconds: float | None) -> None:
        self.deadline = None if seconds is None else time.monotonic() + seconds

    def read_exact(self, n: int) -> bytearray:
        buf = bytearray(n)
        self.read_into(memoryview(buf))
        return buf

    def read_into(self, view: memoryview, progress=None) -> None:
        """Fill `view`; `progress(n)` after each receive, with the bytes of `view` in so far."""
        view = view.cast("B")
        n = len(view)
        got = min(len(self.prefix), n)
        if got:
            view[:got] = self.prefix[:got]
            self.prefix = self.prefix[got:]
        while got < n:
            if self.deadline is not None:
                left = self.deadline - time.monotonic()
                if left <= 0:
                    raise FrameTimeout(f"deadline passed after {got} of {n} bytes")
                self.sock.settimeout(left)
            try:
                k = self.sock.recv_into(view[got:], n - got)
            except socket.timeout:
                if self.deadline is not None:
                    continue  # the loop head raises FrameTimeout
                if self.on_idle is None:
                    raise
                self.on_idle()
                continue
            if k == 0:
                raise PeerClosed(f"connection closed after {got} of {n} bytes")
            got += k
            if progress is not None:
                progress(got)
        if self.deadline is not None:
            self.sock.settimeout(self.send_timeout)
        self.bytes_in += n

    def drain(self, n: int) -> None:
        """Read and discard n bytes in 64 KiB chunks (never allocates n)."""
        chunk = bytearray(min(n, DRAIN_CHUNK))
        view = memoryview(chunk)
        while n > 0:
            k = min(n, len(chunk))
            self.read_into(view[:k])
            n -= k


class BufferReader:
    """`read_exact` over bytes in memory (tests, fuzzing)."""

    def __init__(self, data: bytes):
        self.data = memoryview(data)
        self.pos = 0

    def read_exact(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise PeerClosed(f"stream ends after {len(self.data) - self.pos} of {n} bytes")
        out = bytes(self.data[self.pos : self.pos + n])
        self.pos += n
        return out

    def drain(self, n: int) -> None:
        self.read_exact(n)  # bounds-checked before copying


def send_all(sock: socket.socket, *parts) -> int:
    """Send buffers back to back with MSG_NOSIGNAL, coping with partial sends; returns bytes sent."""
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    total = sum(len(v) for v in views)
    while views:
        sent = sock.sendmsg(views, [], SEND_FLAGS)
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


# --- control framing ------------------------------------------------------------------------------


@dataclass
class ControlHeader:
    op: int
    flags: int
    key_len: int
    payload_len: int
    trace_len: int


@dataclass
class ControlRequest:
    op: int
    flags: int
    key: bytes
    trace: bytes
    payload_len: int


def read_control_header(reader) -> ControlHeader:
    magic, op, flags, key_len, payload_len, trace_len = CONTROL_HEADER.unpack(reader.read_exact(CONTROL_HEADER.size))
    if magic != CONTROL_MAGIC:
        raise FrameError(f"bad control magic 0x{magic:04x} (want 0x{CONTROL_MAGIC:04x})")
    return ControlHeader(op, flags, key_len, payload_len, trace_len)


def read_control_request(reader) -> ControlRequest:
    """Header, key and trace id; the payload stays on the stream (the server decides to read or drain)."""
    return read_control_body(reader, read_control_header(reader))


def read_control_body(reader, h: ControlHeader) -> ControlRequest:
    key = bytes(reader.read_exact(h.key_len))  # u16 lengths: at most 64 KiB each
    trace = bytes(reader.read_exact(h.trace_len))
    return ControlRequest(h.op, h.flags, key, trace, h.payload_len)


def pack_control_request(op: int, payload: bytes = b"", key: bytes = b"", trace: bytes = b"", flags: int = 0) -> bytes:
    return CONTROL_HEADER.pack(CONTROL_MAGIC, op, flags, len(key), len(payload), len(trace)) + key + trace + payload


def pack_control_response(status: int, meta: dict | None = None, payload: bytes = b"") -> bytes:
    return control_response_head(status, meta, len(payload)) + payload


def control_response_head(status: int, meta: dict | None, payload_len: int) -> bytes:
    """A control response up to its payload (a large payload then goes out as its own buffers)."""
    meta_bytes = json.dumps(meta, separators=(",", ":")).encode() if meta is not None else b""
    if len(meta_bytes) > MAX_META:
        raise ValueError(f"control meta of {len(meta_bytes)} bytes does not fit u24")
    return CONTROL_RESPONSE.pack(status | len(meta_bytes) << 8, payload_len) + meta_bytes


@dataclass
class ControlResponse:
    status: int
    meta: dict
    payload: bytes


def read_control_response(reader, max_frame: int, payload=None) -> ControlResponse:
    """`payload(n)`: reads an OK reply's n payload bytes off `reader` itself and answers what they
    make (default, and for any other status: the bytes)."""
    word, payload_len = CONTROL_RESPONSE.unpack(reader.read_exact(CONTROL_RESPONSE.size))
    status, meta_len = word & 0xFF, word >> 8
    if payload_len > max_frame:
        raise FrameError(f"control response payload of {payload_len} bytes exceeds the {max_frame}-byte limit")
    meta_raw = reader.read_exact(meta_len)
    try:
        meta = json.loads(bytes(meta_raw)) if meta_len else {}
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FrameError(f"control response meta is not JSON: {e}") from None
    if payload is None or status != Status.OK:
        return ControlResponse(status, meta, reader.read_exact(payload_len))
    return ControlResponse(status, meta, payload(payload_len))
