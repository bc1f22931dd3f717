"""Fast mmap GGUF header reader: metadata and tensor table without touching tensor data, declared
with the contracts (no torch) so the console's split editor reads a model's shape as the engine does.
A split model (`NAME-00001-of-0000N.gguf`, contracts/gguf_split.py) is read whole from its first part.

The `gguf` package's GGUFReader builds a numpy view per field and takes ~12 s on a
262k-token vocabulary; a straight struct walk over the mmap takes a fraction of that.
`gguf` is still used for the type enums and block sizes. The engine's `GGUFFile`
(engine/gguf_file.py) adds the tensors' data.
"""

from __future__ import annotations

import hashlib
import itertools
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from .errors import UserError
from .gguf_split import SPLIT_COUNT, SPLIT_KEYS, SPLIT_NO, SPLIT_TENSORS_COUNT, split_path, split_prefix

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
    offset: int  # absolute offset in its file
    nbytes: int
    part: int = 0  # which file of a split model holds it (GGUFHeader.parts)

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


class _Part:
    """One mapped GGUF file: its header parsed (`kv_spans`: each key's bytes in the file), its
    tensors' data left in the mapping (`buffer`)."""

    def __init__(self, path: Path, part: int = 0, missing: str = ""):
        self.path = path
        try:
            f = open(path, "rb")
        except OSError as e:
            raise GGUFError(f"cannot open model file {path}{missing}: {e.strerror}") from None
        with f:  # the mmap holds its own descriptor
            try:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError:
                raise GGUFError(f"{path}: empty file, not a GGUF model") from None
        self.buffer = memoryview(self._mm)
        self._parse(part)

    def _parse(self, part: int) -> None:
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
        self.kv_spans: dict[str, tuple[int, int]] = {}
        for _ in range(n_kv):
            at = c.pos
            key = c.string()
            self.metadata[key] = c.value(c.u32())
            self.kv_spans[key] = (at, c.pos)
        raw = []
        for _ in range(n_tensors):
            name = c.string()
            n_dims = c.u32()
            if n_dims > 8:
                raise GGUFError(f"{self.path}: tensor {name!r} has {n_dims} dims")
            dims = [c.u64() for _ in range(n_dims)]
            ttype = c.u32()
            raw.append((name, dims, ttype, c.u64()))
        self.alignment = align = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
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
            self.tensors[name] = TensorInfo(name, tuple(reversed(dims)), qtype, start, nbytes, part)

    def split_key(self, key: str) -> int | None:
        value = self.metadata.get(key)
        if value is not None and type(value) is not int:
            raise GGUFError(f"{self.path}: metadata key {key} must be an integer, got {value!r}")
        return value


class GGUFHeader:
    """An open GGUF model: `metadata` (key -> value), `tensors` (name -> TensorInfo), the
    `fingerprint`. Its file is mapped, not read: only the header's pages are touched. A split
    model is opened from its first part and holds every part (`parts`, each mapping its `buffer`:
    the engine's `GGUFFile.raw` views a tensor's data in its part's); a part missing, of another
    split, or a first part that is not the first is a `GGUFError` naming the file."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        first = _Part(self.path)
        self.parts = [first]
        self.version, self.metadata, self.header_bytes = first.version, first.metadata, first.header_bytes
        self.buffer, self.data_offset = first.buffer, first.data_offset  # the first part's
        count = first.split_key(SPLIT_COUNT) or 0
        if count > 1:
            self.parts += self._other_parts(first, count)
        self.tensors: dict[str, TensorInfo] = {}
        for part in self.parts:
            for name, t in part.tensors.items():
                if name in self.tensors:
                    raise GGUFError(
                        f"{part.path}: tensor {name!r} is also in {self.parts[self.tensors[name].part].path}"
                    )
                self.tensors[name] = t
        declared = first.split_key(SPLIT_TENSORS_COUNT)
        if count > 1 and declared != len(self.tensors):
            raise GGUFError(
                f"{self.path}: split model declares {declared} tensors ({SPLIT_TENSORS_COUNT}), "
                f"its {count} parts hold {len(self.tensors)}"
            )

    def _other_parts(self, first: _Part, count: int) -> list[_Part]:
        no = first.split_key(SPLIT_NO)
        if no is None:
            raise GGUFError(f"{self.path}: split model ({SPLIT_COUNT} {count}) without {SPLIT_NO}")
        prefix = split_prefix(self.path, no, count)
        if no != 0:
            first_part = f": load its first part, {split_path(prefix, 0, count)}" if prefix else ""
            raise GGUFError(f"{self.path} is part {no + 1} of {count} of a split model{first_part}")
        if prefix is None:
            raise GGUFError(
                f"{self.path}: part 1 of a split model of {count} files, but its name does not end in "
                f"{split_path('', 0, count)}: its other parts cannot be found"
            )
        parts = []
        for i in range(1, count):
            path = split_path(prefix, i, count)
            part = _Part(path, i, missing=f" (part {i + 1} of {count} of {self.path})")
            if part.split_key(SPLIT_NO) != i or part.split_key(SPLIT_COUNT) != count:
                raise GGUFError(
                    f"{path}: not part {i + 1} of {count} of {self.path} "
                    f"(its {SPLIT_NO} is {part.metadata.get(SPLIT_NO)}, {SPLIT_COUNT} {part.metadata.get(SPLIT_COUNT)})"
                )
            parts.append(part)
        return parts

    @property
    def nbytes(self) -> int:
        """The model's size on disk, every part's."""
        return sum(len(part.buffer) for part in self.parts)

    @property
    def fingerprint(self) -> str:
        """Hash of the header: metadata and the tensor table (names, shapes, types, offsets). A split
        model's is its merged file's (`merged_header`): the same model whole or split."""
        if not hasattr(self, "_fingerprint"):
            header = self.merged_header() if len(self.parts) > 1 else self.buffer[: self.header_bytes]
            self._fingerprint = hashlib.sha256(header).hexdigest()[:32]
        return self._fingerprint

    def merged_header(self) -> bytes:
        """The header `llama-gguf-split --merge` writes for these parts: the first part's keys but
        the split ones, then every tensor in part order, laid out back to back."""
        first = self.parts[0]
        spans = [span for key, span in first.kv_spans.items() if key not in SPLIT_KEYS]
        table, offset = [], 0
        for t in itertools.chain.from_iterable(part.tensors.values() for part in self.parts):
            name, dims = t.name.encode(), tuple(reversed(t.shape))
            table.append(
                struct.pack(f"<Q{len(name)}sI{len(dims)}QIQ", len(name), name, len(dims), *dims, t.ggml_type, offset)
            )
            offset += -(-t.nbytes // first.alignment) * first.alignment
        counts = struct.pack("<IQQ", first.version, len(self.tensors), len(spans))
        return b"".join([GGUF_MAGIC, counts, *(first.buffer[a:b] for a, b in spans), *table])

    def get(self, key: str, default=None):
        return self.metadata.get(key, default)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))
