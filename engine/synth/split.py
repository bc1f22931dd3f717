"""Split a GGUF model into parts as `llama-gguf-split --split --split-max-tensors N` does, byte for
byte: every part a GGUF of version 3, the model's keys in the first (then `split.no`,
`split.tensors.count`, `split.count`), only those three in the others, each part's tensors in the
model's order, each padded to the alignment. The reader is contracts/gguf_header.py."""

from __future__ import annotations

import struct
from pathlib import Path

from ...contracts.gguf_header import DEFAULT_ALIGNMENT, GGUF_MAGIC, GGUFHeader, TensorInfo
from ...contracts.gguf_split import SPLIT_COUNT, SPLIT_KEYS, SPLIT_NO, SPLIT_TENSORS_COUNT, split_path

_U16, _I32 = 2, 5  # GGUF value types of the split keys


def split_gguf(src: str | Path, prefix: str | Path, max_tensors: int) -> list[Path]:
    """Write `src` as parts of at most `max_tensors` tensors each, `PREFIX-0000i-of-0000N.gguf`;
    returns their paths, the first one the model loads from."""
    if max_tensors < 1:
        raise ValueError(f"max_tensors must be at least 1, got {max_tensors}")
    g = GGUFHeader(src)
    if len(g.parts) > 1:
        raise ValueError(f"{src} is already split into {len(g.parts)} parts")
    tensors = list(g.tensors.values())
    groups = [tensors[i : i + max_tensors] for i in range(0, len(tensors), max_tensors)]
    first = g.parts[0]
    model_keys = [first.buffer[a:b] for key, (a, b) in first.kv_spans.items() if key not in SPLIT_KEYS]
    paths = []
    for no, group in enumerate(groups):
        split_keys = [
            _kv(SPLIT_NO, _U16, "<H", no),
            _kv(SPLIT_TENSORS_COUNT, _I32, "<i", len(tensors)),
            _kv(SPLIT_COUNT, _U16, "<H", len(groups)),
        ]
        keys = (model_keys if no == 0 else []) + split_keys
        # gguf-split pads every part to 32; the first keeps the model's own alignment key, so it follows it
        align = first.alignment if no == 0 else DEFAULT_ALIGNMENT
        path = split_path(prefix, no, len(groups))
        with open(path, "wb") as f:
            f.write(GGUF_MAGIC + struct.pack("<IQQ", 3, len(group), len(keys)))
            f.writelines(keys)
            offset = 0
            for t in group:
                f.write(_tensor_info(t, offset))
                offset += _padded(t.nbytes, align)
            f.write(bytes(_padded(f.tell(), align) - f.tell()))
            for t in group:
                data = first.buffer[t.offset : t.offset + t.nbytes]
                f.write(data)
                f.write(bytes(_padded(t.nbytes, align) - t.nbytes))
        paths.append(path)
    return paths


def _kv(key: str, vtype: int, fmt: str, value: int) -> bytes:
    name = key.encode()
    return struct.pack("<Q", len(name)) + name + struct.pack("<I", vtype) + struct.pack(fmt, value)


def _tensor_info(t: TensorInfo, offset: int) -> bytes:
    """As ggml writes it: trailing dimensions of 1 left out (`ggml_n_dims`)."""
    dims = list(reversed(t.shape)) or [1]
    while len(dims) > 1 and dims[-1] == 1:
        dims.pop()
    name = t.name.encode()
    return struct.pack(f"<Q{len(name)}sI{len(dims)}QIQ", len(name), name, len(dims), *dims, t.ggml_type, offset)


def _padded(n: int, align: int) -> int:
    return -(-n // align) * align
