"""Frame readers and the Hydra control protocol's framing, declared once: the head's control server,
the decode head's PREFILL client (engine/rpc, engine/pd.py) and the console (app/control_client.py)
all pack and parse control frames here, so no side carries its own copy of the bytes.

Control (the fork's): request  `<HBBHQH` magic 0x4859, op, flags, key_len, payload_len, trace_len,
                                then key, trace id, payload;
                      response status u8 | meta_len u24 | payload_len u64, then meta JSON, payload.
The compute framing (ggml-rpc's) is the engine's alone: engine/rpc/wire.py, over the same readers.

Parsers read from anything with `read_exact(n) -> bytes-like` (a socket or a byte buffer), so the
same code is fuzzed in memory and served on sockets, with every length checked before any
allocation. A malformed frame raises `FrameError`; the server closes that one connection.
"""

from __future__ import annotations

import json
import socket
import time
from dataclasses import dataclass

from .rpc import CONTROL_HEADER, CONTROL_MAGIC, CONTROL_RESPONSE, DRAIN_CHUNK, MAX_META, Status


class FrameError(Exception):
    """A frame that breaks the framing: wrong magic, length over the limit, truncated stream."""


class FrameTimeout(FrameError):
    """A frame (or the wait for the next one) outlived its deadline."""


class PeerClosed(FrameError):
    """The other side closed the connection (possibly between frames)."""


# --- readers --------------------------------------------------------------------------------------


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
