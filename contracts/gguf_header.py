"""Fast mmap GGUF header reader: metadata and tensor table without touching tensor data, declared
with the contracts (no torch) so the console's split editor reads a model's shape as the engine does.

The `gguf` package's GGUFReader builds a numpy view per field and takes ~12 s on a
262k-token vocabulary; a straight struct walk over the mmap takes a fraction of that.
`gguf` is still used for the type enums and block sizes. The engine's `GGUFFile`
(engine/gguf_file.py) adds the tensors' data.
"""

from __future__ import annotations

import hashlib
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from .errors import UserError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32


class GGUFError(UserError):
    """A GGUF file that cannot be read: the message names the problem and the file."""


# GGUF value type -> (struct format, numpy dtype) for scalar types.
_SCALARS = {
    0: ("<B", np.uint8),
    1: ("<b", np.int8),
    2: ("<H", np.uint16),
    3: ("<h", np.int16),
    4: ("<I", np.uint32),
    5: ("<i", np.int32),
    6: ("<f", np.float32),
    7: ("<?", np.bool_),
    10: ("<Q", np.uint64),
    11: ("<q", np.int64),
    12: ("<d", np.float64),
}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order (outermost first), i.e. GGUF dims reversed
    ggml_type: GGMLQuantizationType
    offset: int  # absolute offset in the file
    nbytes: int

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


class _Cursor:
    __slots__ = ("buf", "pos", "path")

    def __init__(self, buf, path):
        self.buf = buf
        self.pos = 0
        self.path = path

    def need(self, n: int) -> None:
        if n < 0 or self.pos + n > len(self.buf):
            raise GGUFError(
                f"{self.path}: truncated GGUF (need {n} bytes at offset {self.pos}, file has {len(self.buf)})"
            )

    def unpack(self, fmt: str, size: int):
        self.need(size)
        v = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += size
        return v

    def u32(self) -> int:
        return self.unpack("<I", 4)

    def u64(self) -> int:
        return self.unpack("<Q", 8)

    def string(self) -> str:
        n = self.u64()
        self.need(n)
        s = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, vtype: int):
        if vtype in _SCALARS:
            fmt, dt = _SCALARS[vtype]
            return self.unpack(fmt, np.dtype(dt).itemsize)
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            itype = self.u32()
            n = self.u64()
            if itype in _SCALARS:
                dt = np.dtype(_SCALARS[itype][1])
                self.need(n * dt.itemsize)
                arr = np.frombuffer(self.buf, dtype=dt, count=n, offset=self.pos).copy()
                self.pos += n * dt.itemsize
                return arr
            if itype == _STRING:
                return self._strings(n)
            if itype == _ARRAY:
                return [self.value(_ARRAY) for _ in range(n)]
            raise GGUFError(f"{self.path}: unknown array element type {itype} at offset {self.pos}")
        raise GGUFError(f"{self.path}: unknown metadata value type {vtype} at offset {self.pos}")

    def _strings(self, n: int) -> list[str]:
        buf, pos, end = self.buf, self.pos, len(self.buf)
        unpack = struct.unpack_from
        out = []
        append = out.append
        for _ in range(n):
            if pos + 8 > end:
                raise GGUFError(f"{self.path}: truncated GGUF string array at offset {pos}")
            (ln,) = unpack("<Q", buf, pos)
            pos += 8
            if pos + ln > end:
                raise GGUFError(f"{self.path}: truncated GGUF string at offset {pos}")
            append(str(buf[pos : pos + ln], "utf-8", "replace"))
            pos += ln
        self.pos = pos
        return out


class GGUFHeader:
    """An open GGUF file's header: `metadata` (key -> value), `tensors` (name -> TensorInfo), the
    `fingerprint`. The file is mapped, not read: only the header's pages are touched; `buffer` is
    the whole mapping (the engine's `GGUFFile.raw` views the tensors' data in it)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            f = open(self.path, "rb")
        except OSError as e:
            raise GGUFError(f"cannot open model file {self.path}: {e.strerror}") from None
        with f:  # the mmap holds its own descriptor
            try:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError:
                raise GGUFError(f"{self.path}: empty file, not a GGUF model") from None
        self.buffer = memoryview(self._mm)
        self._parse()

    def _parse(self) -> None:
        c = _Cursor(self.buffer, self.path)
        c.need(4)
        if bytes(self.buffer[:4]) != GGUF_MAGIC:
            raise GGUFError(f"{self.path}: not a GGUF file (magic {bytes(self.buffer[:4])!r})")
        c.pos = 4
        self.version = c.u32()
        if self.version not in (2, 3):
            raise GGUFError(f"{self.path}: unsupported GGUF version {self.version}")
        n_tensors, n_kv = c.u64(), c.u64()
        if n_tensors > 1_000_000 or n_kv > 1_000_000:
            raise GGUFError(f"{self.path}: corrupt GGUF header ({n_tensors} tensors, {n_kv} keys)")
        self.metadata: dict[str, object] = {}
        for _ in range(n_kv):
            key = c.string()
            self.metadata[key] = c.value(c.u32())
        raw = []
        for _ in range(n_tensors):
            name = c.string()
            n_dims = c.u32()
            if n_dims > 8:
                raise GGUFError(f"{self.path}: tensor {name!r} has {n_dims} dims")
            dims = [c.u64() for _ in range(n_dims)]
            ttype = c.u32()
            raw.append((name, dims, ttype, c.u64()))
        align = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if type(align) is not int or align <= 0 or align & (align - 1):
            raise GGUFError(f"{self.path}: general.alignment must be a power-of-two integer, got {align!r}")
        self.data_offset = (c.pos + align - 1) // align * align
        self.header_bytes = c.pos
        self.tensors: dict[str, TensorInfo] = {}
        for name, dims, ttype, off in raw:
            try:
                qtype = GGMLQuantizationType(ttype)
                block, type_size = GGML_QUANT_SIZES[qtype]
            except (ValueError, KeyError):
                raise GGUFError(f"{self.path}: tensor {name!r} has unknown ggml type {ttype}") from None
            n = 1
            for d in dims:
                n *= d
            if dims and dims[0] % block:
                raise GGUFError(f"{self.path}: tensor {name!r} row of {dims[0]} is not a multiple of block {block}")
            nbytes = n // block * type_size
            if name in self.tensors:
                raise GGUFError(f"{self.path}: duplicate tensor name {name!r}")
            start = self.data_offset + off
            if start + nbytes > len(self.buffer):
                raise GGUFError(
                    f"{self.path}: truncated GGUF: tensor {name!r} needs bytes up to {start + nbytes}, file has {len(self.buffer)}"
                )
            self.tensors[name] = TensorInfo(name, tuple(reversed(dims)), qtype, start, nbytes)

    @property
    def fingerprint(self) -> str:
        """Hash of the header: metadata and the tensor table (names, shapes, types, offsets)."""
        if not hasattr(self, "_fingerprint"):
            self._fingerprint = hashlib.sha256(self.buffer[: self.header_bytes]).hexdigest()[:32]
        return self._fingerprint

    def get(self, key: str, default=None):
        return self.metadata.get(key, default)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))
