"""A slot's state on the wire and on disk: what moves when a request moves (P/D, STATE_GET/PUT,
slot save/restore). Declared once for the worker that writes it and the one that reads it.

    MAGIC | header_len u32 | header JSON | crc32 u32 per chunk | crc32 u32 of the header and table | body

The body is the tensors' raw bytes, back to back in header order, in one piece (so a reader places
tensors straight from the bytes it received, no copy); each CHUNK_BYTES of it has its crc32 in the
table, and a last crc32 covers the header JSON and the table. The table comes first so that a
reader off a socket checks each chunk as it arrives (`check_body`'s `fill`): no pass over the
whole body afterwards, and a bad chunk is refused before the rest is read. The header JSON is
padded with spaces so that the body starts 64-byte aligned. The header names the model
(fingerprint), the layer range, the tokens whose state this is, and every tensor: per layer the K
and V of positions [0, n_tokens), for recurrent layers their whole state (conv, ssm), so a hybrid
model's slot moves in the same format; the head's state may add the MTP block's own (`mtp.k`, `mtp.v`, and `mtp.h`, the
trunk's hidden state at the last position).

crc32 is zlib's (CRC-32/ISO-HDLC), computed with zlib-ng's vectorised implementation: the same
numbers as `zlib.crc32` at ~15x its speed.
"""

from __future__ import annotations

import json
import struct
from dataclasses import asdict, dataclass, field
from typing import TypedDict

from zlib_ng.zlib_ng import crc32

from .errors import UserError

MAGIC = b"HYSLOT\x00\x01"
VERSION = 2
HEADER_LEN = struct.Struct("<I")
CRC = struct.Struct("<I")
CHUNK_BYTES = 1 << 20
MAX_HEADER = 1 << 24  # token ids and tensor names of a long slot fit well inside
ALIGN = 64


class SlotStateError(UserError):
    """A slot state that cannot be placed here; the message says why. The target slot is untouched."""


@dataclass(frozen=True)
class TensorEntry:
    name: str  # "blk.3.k", "blk.3.v", "blk.4.ssm", "mtp.k", ...
    shape: list[int]
    dtype: str  # torch name: float32, bfloat16, float16
    nbytes: int


@dataclass(frozen=True)
class SlotHeader:
    fingerprint: str
    layers: list[int]  # [a, b)
    tokens: list[int]  # positions 0..len-1
    dtype: str
    kv_type: str
    tensors: list[TensorEntry] = field(default_factory=list)
    version: int = VERSION

    @property
    def body_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def n_chunks(self) -> int:
        return -(-self.body_bytes // CHUNK_BYTES)

    def _json(self) -> bytes:
        raw = self.to_json()
        fixed = len(MAGIC) + HEADER_LEN.size + CRC.size * (self.n_chunks + 1)
        return raw + b" " * (-(fixed + len(raw)) % ALIGN)

    @property
    def prefix_bytes(self) -> int:
        """Bytes before the body."""
        return len(MAGIC) + HEADER_LEN.size + len(self._json()) + CRC.size * (self.n_chunks + 1)

    def encode(self, crcs: list[int]) -> bytes:
        """Everything before the body, given the body's chunk checksums (`chunk_crcs`)."""
        if len(crcs) != self.n_chunks:
            raise ValueError(f"{len(crcs)} chunk checksums for a body of {self.n_chunks} chunks")
        raw = self._json()
        table = struct.pack(f"<{len(crcs)}I", *crcs)
        return MAGIC + HEADER_LEN.pack(len(raw)) + raw + table + CRC.pack(crc32(table, crc32(raw)))

    @classmethod
    def decode(cls, read) -> tuple[SlotHeader, list[int]]:
        """(header, the body's chunk checksums) from `read(n) -> bytes`; every length is checked
        before it is read, and the header and table against their own checksum."""
        if read(len(MAGIC)) != MAGIC:
            raise SlotStateError("not a Hydra slot state (bad magic)")
        (n,) = HEADER_LEN.unpack(read(HEADER_LEN.size))
        if n > MAX_HEADER:
            raise SlotStateError(f"slot state header of {n} bytes (at most {MAX_HEADER})")
        raw = bytes(read(n))
        header = cls.from_json(raw)
        table = bytes(read(CRC.size * header.n_chunks))
        (want,) = CRC.unpack(read(CRC.size))
        if crc32(table, crc32(raw)) != want:
            raise SlotStateError("slot state header fails its checksum")
        return header, list(struct.unpack(f"<{header.n_chunks}I", table))

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> SlotHeader:
        """The header in `raw` (JSON), its version and sizes checked."""
        try:
            doc = json.loads(raw)
            header = cls(**{**doc, "tensors": [TensorEntry(**t) for t in doc["tensors"]]})
            if header.body_bytes < 0 or any(t.nbytes < 0 for t in header.tensors):
                raise ValueError("negative tensor size")
        except (ValueError, TypeError, KeyError) as e:
            raise SlotStateError(f"slot state header is malformed: {e}") from None
        if header.version != VERSION:
            raise SlotStateError(f"slot state version {header.version}, this worker reads {VERSION}")
        return header


class IpcSlotState(TypedDict):
    """A slot state handed over on one GPU (PREFILL between a prefill worker and a head that share
    it): the header as JSON with its crc32, and the body left in the sender's device memory, as a
    CUDA IPC handle of a uint8 buffer of exactly `body_bytes` (engine/rpc/cuda_ipc.py
    `export_tensor`). The checksum covers the header only, not the device memory: the body never
    crosses a wire; its size is checked against the header's, and the header against the model."""

    header: str
    header_crc: int
    body: dict


def chunk_crcs(body) -> list[int]:
    """The crc32 of each CHUNK_BYTES of `body` (views: no copy)."""
    view = memoryview(body).cast("B")
    return [crc32(view[i : i + CHUNK_BYTES]) for i in range(0, len(view), CHUNK_BYTES)]


def check_body(body, header: SlotHeader, crcs: list[int], fill=None) -> None:
    """A body that is not exactly the header's size or fails a chunk's checksum raises, naming where.
    `fill(view, progress)`: the body's bytes are still to come (a socket's `read_into`), which
    calls `progress(n)` as the first n arrive: each chunk is checked as soon as it is complete,
    while its bytes are in cache (no second pass over the whole body), and a bad one stops the
    stream there."""
    view = memoryview(body).cast("B")
    if len(view) != header.body_bytes:
        raise SlotStateError(f"slot state body of {len(view)} bytes, the header names {header.body_bytes}")
    checked = 0

    def progress(n: int) -> None:
        nonlocal checked
        while checked < len(crcs) and min((checked + 1) * CHUNK_BYTES, len(view)) <= n:
            if crc32(view[checked * CHUNK_BYTES : (checked + 1) * CHUNK_BYTES]) != crcs[checked]:
                raise SlotStateError(f"slot state chunk at byte {checked * CHUNK_BYTES} fails its checksum")
            checked += 1

    if fill is not None:
        fill(view, progress)
    progress(len(view))
