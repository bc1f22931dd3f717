"""Both frame parsers, in memory: round trips, limits before allocation, and property-based fuzzing
(any byte string either parses or raises FrameError — never another exception)."""

from __future__ import annotations

import socket
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hydra_console.contracts.rpc import FORWARD_HEADER
from hydra_console.engine.rpc import wire
from hydra_console.engine.rpc.forward_frames import pack_forward, unpack_forward
from hydra_console.engine.rpc.resident import ComputeError
from hydra_console.engine.rpc.wire import BufferReader, FrameError, SocketReader

pytestmark = pytest.mark.unit

MAX = 1 << 16


@given(cmd=st.integers(0, 255), payload=st.binary(max_size=512))
def test_compute_request_round_trip(cmd, payload):
    frame = wire.pack_compute_request(cmd, payload)
    assert wire.read_compute_request(BufferReader(frame), MAX) == (cmd, payload)


@given(
    op=st.integers(0, 255),
    flags=st.integers(0, 255),
    key=st.binary(max_size=32),
    trace=st.binary(max_size=32),
    payload=st.binary(max_size=256),
)
def test_control_request_round_trip(op, flags, key, trace, payload):
    r = BufferReader(wire.pack_control_request(op, payload, key=key, trace=trace, flags=flags))
    req = wire.read_control_request(r)
    assert (req.op, req.flags, req.key, req.trace, req.payload_len) == (op, flags, key, trace, len(payload))
    assert r.read_exact(req.payload_len) == payload


@given(
    status=st.integers(0, 6), meta=st.dictionaries(st.text(max_size=8), st.integers()), payload=st.binary(max_size=64)
)
def test_control_response_round_trip(status, meta, payload):
    resp = wire.read_control_response(BufferReader(wire.pack_control_response(status, meta, payload)), MAX)
    assert (resp.status, resp.meta, resp.payload) == (status, meta, payload)


def test_control_header_is_the_forks_16_bytes():
    frame = wire.pack_control_request(0x41, b"xy", key=b"3", trace=b"t")
    assert frame[:16] == struct.pack("<HBBHQH", 0x4859, 0x41, 0, 1, 2, 1)
    assert frame[1] == 0x48 and frame[0] == 0x59  # little-endian magic: frames start with 0x59


def test_oversized_compute_frame_is_refused_before_reading_the_payload():
    # Declares 2^63 bytes but carries none: the limit check must come first (no allocation, no read).
    frame = struct.pack("<BQ", 34, 1 << 63)
    with pytest.raises(FrameError, match="exceeds"):
        wire.read_compute_request(BufferReader(frame), MAX)


def test_truncated_frames_raise_frame_errors():
    full = wire.pack_compute_request(33, b"blk.0.attn_q.weight")
    for cut in range(len(full)):
        with pytest.raises(FrameError):
            wire.read_compute_request(BufferReader(full[:cut]), MAX)
    ctl = wire.pack_control_request(0x41, b"{}", key=b"1")
    for cut in range(16 + 1):  # header and key
        with pytest.raises(FrameError):
            wire.read_control_request(BufferReader(ctl[:cut]))


def test_bad_magic():
    frame = struct.pack("<HBBHQH", 0x1234, 0x41, 0, 0, 0, 0)
    with pytest.raises(FrameError, match="magic"):
        wire.read_control_request(BufferReader(frame))


@settings(max_examples=300)
@given(data=st.binary(max_size=64))
def test_fuzz_compute_parser(data):
    try:
        cmd, payload = wire.read_compute_request(BufferReader(data), MAX)
    except FrameError:
        return
    assert len(payload) == struct.unpack_from("<Q", data, 1)[0] and 0 <= cmd < 256


@settings(max_examples=300)
@given(data=st.binary(max_size=64))
def test_fuzz_control_parser(data):
    try:
        req = wire.read_control_request(BufferReader(data))
    except FrameError:
        return
    assert len(req.key) + len(req.trace) + 16 <= len(data)


@settings(max_examples=200)
@given(data=st.binary(max_size=96), with_hidden=st.booleans())
def test_fuzz_forward_payload(data, with_hidden):
    """FORWARD's and FORWARD_IPC's payload check: any bytes parse consistently or raise ComputeError."""
    try:
        epoch, hidden, slots, positions = unpack_forward(bytearray(data), with_hidden=with_hidden)
    except ComputeError:
        return
    assert hidden.shape[0] == slots.shape[0] == positions.shape[0]
    assert hidden.is_meta != with_hidden


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_forward_payload_is_bit_exact(dtype):
    h = torch.randn(5, 8).to(dtype)
    slots, positions = torch.tensor([0, 0, 1, 1, 1]), torch.tensor([3, 4, 0, 1, 2])
    payload = b"".join(bytes(memoryview(p).cast("B")) for p in pack_forward(7, h, slots, positions))
    epoch, h2, s2, p2 = unpack_forward(bytearray(payload))
    assert epoch == 7 and h2.dtype == dtype and torch.equal(h2.view(torch.uint8), h.view(torch.uint8))
    assert torch.equal(s2, slots) and torch.equal(p2, positions)
    # FORWARD_IPC: the same frame without the hidden bytes; shape and dtype still travel.
    payload = b"".join(bytes(memoryview(p).cast("B")) for p in pack_forward(7, h, slots, positions, with_hidden=False))
    epoch, h3, s3, p3 = unpack_forward(bytearray(payload), with_hidden=False)
    assert len(payload) == FORWARD_HEADER.size + 8 * 5 and h3.is_meta and h3.shape == (5, 8) and h3.dtype == dtype
    assert torch.equal(s3, slots) and torch.equal(p3, positions)
    with pytest.raises(ComputeError):
        unpack_forward(bytearray(payload))  # a FORWARD must carry them


def test_spin_gives_up_after_its_budget_and_leaves_the_data_for_the_read():
    import socket

    a, b = socket.socketpair()
    with a, b:
        wire.spin_until_readable(a, 0.02)  # nothing sent: returns once the budget is spent
        b.sendall(b"frame")
        wire.spin_until_readable(a, 30.0)  # data waiting: returns without using the budget
        a.settimeout(1.0)
        assert a.recv(16) == b"frame"


def test_frame_deadlines_stay_settable_for_any_announced_size():
    from hydra_console.contracts.rpc import HEADER_DEADLINE_S, frame_deadline

    assert frame_deadline(0) == HEADER_DEADLINE_S and frame_deadline(1 << 20) == HEADER_DEADLINE_S + 1
    a, b = socket.socketpair()
    with a, b:
        reader = SocketReader(a)
        reader.expect(frame_deadline((1 << 64) - 1))  # a u64 length from the wire: still a valid socket timeout
        b.sendall(b"abc")
        assert bytes(reader.read_exact(3)) == b"abc"
