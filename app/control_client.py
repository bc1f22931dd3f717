"""Minimal client of the Hydra control protocol (DESIGN §4) for the console's few ops.

Request: 16-byte header `<HBBHQH` (magic 0x4859, op, flags, key_len, payload_len, trace_len),
then key, trace id, payload. Response: status u8 + meta_len u24 + payload_len u64 (12 bytes),
then meta JSON and payload. Lengths are checked before anything is allocated.
"""

from __future__ import annotations

import asyncio
import json
import struct
from dataclasses import dataclass

MAGIC = 0x4859
OP_CONFIGURE = 0x40
OP_INFO = 0x41
_REQ = struct.Struct("<HBBHQH")
STATUS_NAMES = {0: "OK", 1: "NOT_FOUND", 2: "ERROR", 3: "PARTIAL", 4: "BUSY", 5: "BAD_REQUEST", 6: "NOT_IMPLEMENTED"}
OK, NOT_IMPLEMENTED = 0, 6
MAX_RESPONSE = 16 << 20  # the console only reads small JSON replies


class ControlError(Exception):
    """The control port could not be reached or answered something that is not a frame."""


@dataclass(frozen=True)
class ControlReply:
    status: int
    meta: dict
    payload: bytes

    @property
    def status_name(self) -> str:
        return STATUS_NAMES.get(self.status, f"status {self.status}")

    @property
    def ok(self) -> bool:
        return self.status == OK


def encode_request(op: int, payload: bytes = b"", key: bytes = b"", trace: bytes = b"", flags: int = 0) -> bytes:
    return _REQ.pack(MAGIC, op, flags, len(key), len(payload), len(trace)) + key + trace + payload


def decode_response_header(header: bytes) -> tuple[int, int, int]:
    if len(header) != 12:
        raise ControlError(f"short response header ({len(header)} bytes)")
    status = header[0]
    meta_len = int.from_bytes(header[1:4], "little")
    (payload_len,) = struct.unpack_from("<Q", header, 4)
    return status, meta_len, payload_len


async def request(host: str, port: int, op: int, payload: bytes = b"", *, timeout: float = 10.0) -> ControlReply:
    """One request on a fresh connection (the console's ops are rare)."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except (OSError, asyncio.TimeoutError) as e:
        raise ControlError(f"cannot connect to {host}:{port}: {e or 'timed out'}") from None
    try:
        writer.write(encode_request(op, payload))
        await writer.drain()
        status, meta_len, payload_len = decode_response_header(await asyncio.wait_for(reader.readexactly(12), timeout))
        if meta_len + payload_len > MAX_RESPONSE:
            raise ControlError(f"response of {meta_len + payload_len} bytes exceeds {MAX_RESPONSE}")
        meta_raw = await asyncio.wait_for(reader.readexactly(meta_len), timeout) if meta_len else b""
        body = await asyncio.wait_for(reader.readexactly(payload_len), timeout) if payload_len else b""
    except asyncio.IncompleteReadError:
        raise ControlError(f"{host}:{port} closed the connection mid-reply") from None
    except (OSError, asyncio.TimeoutError) as e:
        raise ControlError(f"{host}:{port}: {e or 'timed out'}") from None
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except OSError:
            pass
    try:
        meta = json.loads(meta_raw) if meta_raw else {}
    except ValueError:
        meta = {"raw": meta_raw.decode("utf-8", "replace")}
    return ControlReply(status, meta if isinstance(meta, dict) else {"value": meta}, body)


async def configure(host: str, port: int, settings: dict, *, timeout: float = 120.0) -> ControlReply:
    """CONFIGURE with a JSON body; a live re-split is `{"split": [9, 9]}` (layer counts, head first)."""
    return await request(host, port, OP_CONFIGURE, json.dumps(settings).encode(), timeout=timeout)


async def info(host: str, port: int, *, timeout: float = 5.0) -> ControlReply:
    return await request(host, port, OP_INFO, timeout=timeout)
