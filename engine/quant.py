"""Torch dequantizers for GGML block types, bit-exact against `gguf.quants.dequantize`.

Each block decoder works on all blocks at once: a uint8 tensor [n_blocks, type_size] in,
float32 [n_blocks, block_size] out. The float arithmetic repeats the numpy reference
operation for operation (same products, same order, no fused multiply-add), so results
match bit for bit. They run on whatever device the bytes are on.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as T

from .errors import UserError

# GGUFFile.raw() hands out read-only mmap views; we only ever read from them, so
# torch's one-time "not writable" warning on wrapping them is noise.
warnings.filterwarnings("ignore", message="The given (NumPy array|buffer) is not writable", category=UserWarning)

# IQ4_NL / IQ4_XS non-linear 4-bit code book (ggml's kvalues_iq4nl).
_IQ4NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)

# Elements decoded per step: bounds the temporaries of a huge tensor (a few MB each on CPU, where
# small steps also stay in cache); on a GPU each step costs a dozen kernel launches, so steps are large.
_CHUNK_ELEMENTS = 1 << 20
_CHUNK_ELEMENTS_GPU = 1 << 26


class QuantError(UserError):
    """A tensor that cannot be dequantized: unsupported type or bytes that do not fit the shape."""


def _bits(x: torch.Tensor, chunk: int, shifts: Sequence[int], mask: int) -> torch.Tensor:
    """Unpack bit fields: [n, m] -> [n, m // chunk, len(shifts), chunk], field k of each byte at index k.

    Matches the reference's `x.reshape((n, -1, 1, chunk)) >> shifts.reshape((1, 1, k, 1)) & mask`.
    """
    x = x.contiguous().view(x.shape[0], -1, chunk)
    # One full-width op per field then a stack: much faster than a broadcast shift over a size-k dim.
    return torch.stack([(x >> s if s else x) & mask for s in shifts], dim=2)


def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 field at byte `at` of every block, as float32 [n, 1]."""
    return blocks[:, at : at + 2].contiguous().view(torch.float16).float()


def _scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: 12 bytes of packed 6-bit (scale, min) pairs -> two [n, 8] uint8."""
    d, m, m_d = scales.reshape(-1, 3, 4).unbind(1)
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    x = b[:, 2:].contiguous().view(torch.int8).float()
    return x * _f16(b, 0)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    q = _bits(b[:, 2:], 16, (0, 4), 0x0F).reshape(b.shape[0], -1).to(torch.int8) - 8
    return _f16(b, 0) * q.float()


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    q = _bits(b[:, 4:], 16, (0, 4), 0x0F).reshape(b.shape[0], -1).float()
    return (_f16(b, 0) * q) + _f16(b, 2)


def _q5_low_high(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """Q5_0 / Q5_1: 4 nibble-packed low bits + a little-endian u32 of high bits -> [n, 32] in 0..31."""
    n = qs.shape[0]
    hi = _bits(qh, 1, list(range(8)), 0x01).reshape(n, 32)  # bit i of the u32 = bit i%8 of byte i//8
    lo = _bits(qs, 16, (0, 4), 0x0F).reshape(n, 32)
    return lo | (hi << 4)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    q = _q5_low_high(b[:, 2:6], b[:, 6:]).to(torch.int8) - 16
    return _f16(b, 0) * q.float()


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    q = _q5_low_high(b[:, 4:8], b[:, 8:]).float()
    return (_f16(b, 0) * q) + _f16(b, 2)


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scales = b[:, :16]
    dl = (_f16(b, 80) * (scales & 0x0F).float()).reshape(n, 16, 1)
    ml = (_f16(b, 82) * (scales >> 4).float()).reshape(n, 16, 1)
    q = _bits(b[:, 16:80], 32, (0, 2, 4, 6), 0x03).reshape(n, 16, 16).float()
    return (dl * q - ml).reshape(n, 256)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    hmask, qs, scales = b[:, :32], b[:, 32:96], b[:, 96:108]
    lsc = _bits(scales[:, :8], 8, (0, 4), 0x0F).reshape(n, 16)
    hsc = _bits(scales[:, 8:], 4, (0, 2, 4, 6), 0x03).reshape(n, 16)
    sc = ((lsc | (hsc << 4)).to(torch.int8) - 32).float()
    dl = (_f16(b, 108) * sc).reshape(n, 16, 1)
    ql = _bits(qs, 32, (0, 2, 4, 6), 0x03).reshape(n, 16, 16)
    qh = _bits(hmask, 32, list(range(8)), 0x01).reshape(n, 16, 16) ^ 1  # a set mask bit means no -4 offset
    q = (ql.to(torch.int8) - (qh << 2).to(torch.int8)).float()
    return (dl * q).reshape(n, 256)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sc, mn = _scale_min_k4(b[:, 4:16])
    d = (_f16(b, 0) * sc.float()).reshape(n, 8, 1)
    dm = (_f16(b, 2) * mn.float()).reshape(n, 8, 1)
    q = _bits(b[:, 16:], 32, (0, 4), 0x0F).reshape(n, 8, 32).float()
    return (d * q - dm).reshape(n, 256)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sc, mn = _scale_min_k4(b[:, 4:16])
    d = (_f16(b, 0) * sc.float()).reshape(n, 8, 1)
    dm = (_f16(b, 2) * mn.float()).reshape(n, 8, 1)
    ql = _bits(b[:, 48:], 32, (0, 4), 0x0F).reshape(n, 8, 32)
    qh = _bits(b[:, 16:48], 32, list(range(8)), 0x01).reshape(n, 8, 32)
    q = (ql | (qh << 4)).float()
    return (d * q - dm).reshape(n, 256)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    d = (_f16(b, 208) * scales).reshape(n, 16, 1)
    ql = _bits(b[:, :128], 64, (0, 4), 0x0F).reshape(n, 8, 32)
    qh = _bits(b[:, 128:192], 32, (0, 2, 4, 6), 0x03).reshape(n, 8, 32)
    q = ((ql | (qh << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()
    return (d * q).reshape(n, 256)


def _iq4_values(idx: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(_IQ4NL_VALUES, dtype=torch.float32, device=idx.device)
    return table.index_select(0, idx.reshape(-1).int()).view(idx.shape)


def _iq4_nl(b: torch.Tensor) -> torch.Tensor:
    q = _iq4_values(_bits(b[:, 2:], 16, (0, 4), 0x0F).reshape(b.shape[0], 32))
    return _f16(b, 0) * q


def _iq4_xs(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sh = b[:, 2].int() | (b[:, 3].int() << 8)  # little-endian u16 of 2-bit high scale parts
    shifts = torch.arange(0, 16, 2, dtype=torch.int32, device=b.device)
    hi = ((sh.reshape(n, 1) >> shifts) & 0x03).to(torch.uint8)
    lo = _bits(b[:, 4:8], 1, (0, 4), 0x0F).reshape(n, 8)
    sc = ((lo | (hi << 4)).to(torch.int8) - 32).float()
    dl = (_f16(b, 0) * sc).reshape(n, 8, 1)
    q = _iq4_values(_bits(b[:, 8:], 16, (0, 4), 0x0F).reshape(n, 8, 32))
    return (dl * q).reshape(n, 256)


_BLOCK_DECODERS: dict[T, Callable[[torch.Tensor], torch.Tensor]] = {
    T.Q8_0: _q8_0,
    T.Q4_0: _q4_0,
    T.Q4_1: _q4_1,
    T.Q5_0: _q5_0,
    T.Q5_1: _q5_1,
    T.Q2_K: _q2_k,
    T.Q3_K: _q3_k,
    T.Q4_K: _q4_k,
    T.Q5_K: _q5_k,
    T.Q6_K: _q6_k,
    T.IQ4_NL: _iq4_nl,
    T.IQ4_XS: _iq4_xs,
}
DENSE_TYPES: frozenset[T] = frozenset((T.F32, T.F16, T.BF16))  # not block-quantized
SUPPORTED_TYPES: frozenset[T] = DENSE_TYPES | frozenset(_BLOCK_DECODERS)


def _as_bytes(raw) -> torch.Tensor:
    """A flat uint8 tensor over `raw` without copying (numpy array, torch tensor or bytes-like)."""
    if isinstance(raw, torch.Tensor):
        if raw.dtype != torch.uint8:
            raise QuantError(f"expected uint8 tensor bytes, got {raw.dtype}")
        return raw.reshape(-1)
    arr = raw if isinstance(raw, np.ndarray) else np.frombuffer(raw, dtype=np.uint8)
    if arr.dtype != np.uint8:
        raise QuantError(f"expected uint8 array bytes, got {arr.dtype}")
    return torch.from_numpy(np.ascontiguousarray(arr).reshape(-1))


def _qtype(qtype) -> T:
    try:
        qt = T(qtype)
    except ValueError:
        raise QuantError(f"unknown ggml tensor type {qtype!r}") from None
    if qt not in SUPPORTED_TYPES:
        supported = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise QuantError(f"cannot dequantize tensor type {qt.name} (supported: {supported})")
    return qt


def _decode(data: torch.Tensor, qt: T, n_elements: int) -> torch.Tensor:
    """Flat uint8 bytes of whole blocks -> flat float32 of n_elements (a fresh, writable tensor)."""
    if qt == T.F32:
        return data.view(torch.float32).clone()  # never hand out the read-only mmap itself
    if qt == T.F16:
        return data.view(torch.float16).float()
    if qt == T.BF16:
        return (data.view(torch.int16).int() << 16).view(torch.float32)
    block, type_size = GGML_QUANT_SIZES[qt]
    if n_elements == 0:
        return torch.empty(0, dtype=torch.float32, device=data.device)
    blocks = data.view(-1, type_size)
    decoder = _BLOCK_DECODERS[qt]
    step = max(1, (_CHUNK_ELEMENTS if data.device.type == "cpu" else _CHUNK_ELEMENTS_GPU) // block)
    if blocks.shape[0] <= step:
        return decoder(blocks).reshape(-1)
    out = torch.empty(n_elements, dtype=torch.float32, device=data.device)
    for start in range(0, blocks.shape[0], step):
        part = blocks[start : start + step]
        out[start * block : (start + part.shape[0]) * block] = decoder(part).reshape(-1)
    return out


def _row_bytes(qt: T, row_len: int) -> int:
    block, type_size = GGML_QUANT_SIZES[qt]
    if row_len <= 0 or row_len % block:
        raise QuantError(f"{qt.name} row of {row_len} elements is not a positive multiple of its block size {block}")
    return row_len // block * type_size


def dequantize(raw, qtype, shape: Sequence[int]) -> torch.Tensor:
    """The tensor's bytes (`GGUFFile.raw(name)` or a uint8 torch tensor) as float32 of `shape` (torch order)."""
    qt = _qtype(qtype)
    shape = tuple(int(d) for d in shape)
    n_elements = int(np.prod(shape, dtype=np.int64))
    data = _as_bytes(raw)
    expected = _row_bytes(qt, shape[-1]) * (n_elements // shape[-1]) if shape else 0
    if not shape or data.numel() != expected:
        raise QuantError(f"{qt.name} tensor of shape {list(shape)} needs {expected} bytes, got {data.numel()}")
    return _decode(data, qt, n_elements).reshape(shape)


def dequantize_rows(raw, qtype, row_len: int, rows: torch.Tensor) -> torch.Tensor:
    """Only the selected rows of a [n_rows, row_len] tensor: float32 of shape [*rows.shape, row_len].

    Rows are whole blocks, so this gathers their byte ranges first: an embedding lookup
    touches only the looked-up rows of a huge token table.
    """
    qt = _qtype(qtype)
    row_bytes = _row_bytes(qt, row_len)
    data = _as_bytes(raw)
    if data.numel() % row_bytes:
        raise QuantError(f"{qt.name} data of {data.numel()} bytes is not whole rows of {row_bytes} bytes")
    table = data.view(-1, row_bytes)
    rows = torch.as_tensor(rows, dtype=torch.long)
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= table.shape[0]):
        raise QuantError(
            f"row index out of range: {int(rows.min())}..{int(rows.max())} for a table of {table.shape[0]} rows"
        )
    picked = table.index_select(0, rows.reshape(-1).to(table.device))
    return _decode(picked.reshape(-1), qt, rows.numel() * row_len).reshape(*rows.shape, row_len)
