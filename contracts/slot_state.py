"""A slot's state on the wire and on disk: what moves when a request moves (P/D, STATE_GET/PUT,
slot save/restore). Declared once for the worker that writes it and the one that reads it.

    MAGIC | header_len u32 | header JSON | chunk* | end chunk

A chunk is `len u32 | crc32 u32 | len bytes` of the tensors' raw bytes, back to back in header
order; the end chunk has len 0 and the crc32 of everything before it. The header names the model
(fingerprint), the layer range, the tokens whose state this is, and every tensor: per layer the
K and V of positions [0, n_tokens), and for recurrent layers their whole state (conv, ssm), so a
hybrid model's slot moves in the same format.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import asdict, dataclass, field
from typing import Iterable, Iterator

from .errors import UserError

MAGIC = b"HYSLOT\x00\x01"
VERSION = 1
HEADER_LEN = struct.Struct("<I")
CHUNK = struct.Struct("<II")  # length, crc32
CHUNK_BYTES = 1 << 20
MAX_HEADER = 1 << 24  # token ids and tensor names of a long slot fit well inside


class SlotStateError(UserError):
    """A slot state that cannot be placed here; the message says why. The target slot is untouched."""


@dataclass(frozen=True)
class TensorEntry:
    name: str  # "blk.3.k", "blk.3.v", "blk.4.ssm", ...
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

    def encode(self) -> bytes:
        raw = json.dumps(asdict(self), separators=(",", ":")).encode()
        return MAGIC + HEADER_LEN.pack(len(raw)) + raw

    @classmethod
    def decode(cls, read) -> SlotHeader:
        """From `read(n) -> bytes`; every length is checked before it is read."""
        if read(len(MAGIC)) != MAGIC:
            raise SlotStateError("not a Hydra slot state (bad magic)")
        (n,) = HEADER_LEN.unpack(read(HEADER_LEN.size))
        if n > MAX_HEADER:
            raise SlotStateError(f"slot state header of {n} bytes (at most {MAX_HEADER})")
        try:
            doc = json.loads(bytes(read(n)))
            header = cls(**{**doc, "tensors": [TensorEntry(**t) for t in doc["tensors"]]})
        except (ValueError, TypeError, KeyError) as e:
            raise SlotStateError(f"slot state header is malformed: {e}") from None
        if header.version != VERSION:
            raise SlotStateError(f"slot state version {header.version}, this worker reads {VERSION}")
        return header


def encode_body(parts: Iterable[bytes | memoryview]) -> Iterator[bytes | memoryview]:
    """The tensors' bytes as checksummed chunks (each chunk's header, then a view of its bytes:
    no copy), then the end chunk."""
    total = 0
    for part in parts:
        view = memoryview(part).cast("B")
        for i in range(0, len(view), CHUNK_BYTES):
            chunk = view[i : i + CHUNK_BYTES]
            total = zlib.crc32(chunk, total)
            yield CHUNK.pack(len(chunk), zlib.crc32(chunk))
            yield chunk
    yield CHUNK.pack(0, total)


def decode_body(read, header: SlotHeader) -> bytearray:
    """All the body's bytes, checked chunk by chunk; a short, oversized or corrupt stream raises."""
    want = header.body_bytes
    out = bytearray()
    total = 0
    while True:
        n, crc = CHUNK.unpack(read(CHUNK.size))
        if n == 0:
            if len(out) != want:
                raise SlotStateError(f"slot state ends after {len(out)} of {want} bytes")
            if crc != total:
                raise SlotStateError("slot state checksum mismatch over the whole body")
            return out
        if n > CHUNK_BYTES or len(out) + n > want:
            raise SlotStateError(f"slot state chunk of {n} bytes overruns the {want} bytes the header names")
        chunk = read(n)
        if zlib.crc32(chunk) != crc:
            raise SlotStateError(f"slot state chunk at byte {len(out)} fails its checksum")
        total = zlib.crc32(chunk, total)
        out += chunk
