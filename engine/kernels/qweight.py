"""GGUF block-quantized weights repacked once into planes that a GPU reads coalesced.

Every supported type dequantizes as

    w[k] = (d[k // sb] * sc[k // g]) * (u[k] - offset) + m[k // sb] * mn[k // g]

with u the unsigned code of `bits` bits, d and m float16 per block of `sb`, and the optional
sub-block scale sc / min mn per group of `g` (K-quants). The K-quants' `- dmin * min` is stored as
m = -dmin, which is exact, so the formula repeats `quant.dequantize` operation for operation.

Planes of a [n, k] weight, each row-major with one row per output:
- `q`  uint8 [n, k/2]: low 4 bits of the codes. In each 32-element tile, byte i holds element i in
  its low nibble and element i+16 in its high nibble: a tile is 16 contiguous bytes.
- `h`  uint8 [n, k/2/per]: the codes' high `bits-4` bits (Q5*, Q6_K, Q8_0), per = 8 // (2*(bits-4)):
  a tile's are 4 // per little-endian 32-bit words; those of nibble byte 4j + b sit in byte b of
  word j // per at bits 2*(bits-4)*(j % per) (low element first). So byte b of a word serves byte b
  of each `q` word it covers: the kernels merge them into 4 codes of an int32 by shifts and masks
  (`triton_qplanes.code_words`).
- `d`  float16 [n, k/sb]; `m` float16 [n, k/sb]; `sc` int8 [n, k/16] (Q6_K).
- Q4_K / Q5_K (scales and mins per group of 32, 6 bits each) instead of `d`, `m`, `sc`, `mn`:
  `sm` uint8 [n, k/32]: a group's low nibbles (scale | min << 4);
  `dm` int64 [n, k/256]: a block's float16 d and m (bits 0-15, 16-31) and the high bits of its
  groups' scales and mins (group j's at bits 32 + 4j: scale's 2, then min's 2).
  A 32-element tile then reads two loads, its byte and its block's word (one address for the
  block's eight tiles), where plain fields took four; the bytes are the file's 12 + 4 per block.
  (The file's own packing, three byte loads a group, cost the GEMV 7.5 %: docs/PERF.md, session 13.)

Every plane together holds the GGUF file's bytes, rearranged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as T

from ..device import load_staging
from ..quant import QuantError, _as_bytes, _bits, _f16, _q5_low_high, _scale_min_k4

# GGUF bytes repacked per slice (see `QuantWeight.from_gguf`): its integer intermediates are several
# times the bytes, and at 64 MiB they set a 7.2B's device peak at load (0.3 GB more allocated, 0.8 GB
# more reserved than the weights held).
REPACK_BYTES = 16 << 20


@dataclass(frozen=True)
class Layout:
    bits: int
    offset: int  # subtracted from the unsigned code
    sb: int  # weights per d (and m)
    g: int = 0  # weights per sc (and mn); 0: no sub-block scales
    has_m: bool = False
    has_mn: bool = False


LAYOUTS: dict[T, Layout] = {
    T.Q4_0: Layout(4, 8, 32),
    T.Q4_1: Layout(4, 0, 32, has_m=True),
    T.Q5_0: Layout(5, 16, 32),
    T.Q5_1: Layout(5, 0, 32, has_m=True),
    T.Q8_0: Layout(8, 128, 32),
    T.Q4_K: Layout(4, 0, 256, 32, has_m=True, has_mn=True),
    T.Q5_K: Layout(5, 0, 256, 32, has_m=True, has_mn=True),
    T.Q6_K: Layout(6, 32, 256, 16),
}


def _split(b: torch.Tensor, qt: T) -> dict[str, torch.Tensor]:
    """GGUF blocks [nb, type_size] -> codes [nb, block] and per-block fields, in the reference's order."""
    n = b.shape[0]
    if qt == T.Q8_0:
        return {"u": b[:, 2:] ^ 0x80, "d": _f16(b, 0)}  # int8 two's complement -> code + 128
    if qt in (T.Q4_0, T.Q4_1):
        at = 2 if qt == T.Q4_0 else 4
        u = _bits(b[:, at:], 16, (0, 4), 0x0F).reshape(n, 32)
        return {"u": u, "d": _f16(b, 0)} | ({"m": _f16(b, 2)} if qt == T.Q4_1 else {})
    if qt in (T.Q5_0, T.Q5_1):
        at = 2 if qt == T.Q5_0 else 4
        u = _q5_low_high(b[:, at : at + 4], b[:, at + 4 :])
        return {"u": u, "d": _f16(b, 0)} | ({"m": _f16(b, 2)} if qt == T.Q5_1 else {})
    if qt in (T.Q4_K, T.Q5_K):
        if qt == T.Q4_K:
            u = _bits(b[:, 16:], 32, (0, 4), 0x0F).reshape(n, 256)
        else:
            ql = _bits(b[:, 48:], 32, (0, 4), 0x0F).reshape(n, 256)
            u = ql | (_bits(b[:, 16:48], 32, list(range(8)), 0x01).reshape(n, 256) << 4)
        return {"u": u} | _pack_k_scales(b)
    # Q6_K
    ql = _bits(b[:, :128], 64, (0, 4), 0x0F).reshape(n, 256)
    qh = _bits(b[:, 128:192], 32, (0, 2, 4, 6), 0x03).reshape(n, 256)
    return {"u": ql | (qh << 4), "d": _f16(b, 208), "sc": b[:, 192:208].contiguous().view(torch.int8)}


def _pack_k_scales(b: torch.Tensor) -> dict[str, torch.Tensor]:
    """Q4_K / Q5_K blocks [nb, type_size] -> their `sm` [nb, 8] and `dm` [nb, 1] (module doc)."""
    sc, mn = _scale_min_k4(b[:, 4:16])
    # Shifts made on the device: a tensor from a host list would be a pageable copy that waits for the queue.
    bits = (b[:, :4].long() << 8 * torch.arange(4, device=b.device)).sum(dim=1, keepdim=True)
    high = ((sc >> 4) | ((mn >> 4) << 2)).long() << (32 + 4 * torch.arange(8, device=b.device))
    # m = -dmin: its sign bit flipped, exact, so the formula adds m * mn as the reference subtracts dmin * min.
    return {"sm": (sc & 15) | ((mn & 15) << 4), "dm": (bits ^ (0x8000 << 16)) | high.sum(dim=1, keepdim=True)}


def _unpack_k_scales(sm: torch.Tensor, dm: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`sm` [n, nb*8] and `dm` [n, nb] -> d, m float32 [n, nb] and the 6-bit scales, mins int64 [n, nb*8]."""
    n, nb = dm.shape
    d, m = (((dm >> at) & 0xFFFF).to(torch.int16).view(torch.float16).float() for at in (0, 16))
    high = (dm.view(n, nb, 1) >> (32 + 4 * torch.arange(8, device=dm.device))) & 15
    low = sm.long().view(n, nb, 8)
    sc, mn = (low & 15) | ((high & 3) << 4), (low >> 4) | ((high >> 2) << 4)
    return d, m, sc.view(n, -1), mn.view(n, -1)


def _per(bits: int) -> int:
    """Nibble bytes whose high bits share one byte of the `h` plane."""
    return 8 // (2 * (bits - 4))


def _pack(u: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Codes [n, k] -> the `q` and `h` planes."""
    n, k = u.shape
    lo, hi = u.view(n, k // 32, 2, 16).unbind(2)  # element i and i + 16 of each tile
    q = ((lo & 0x0F) | ((hi & 0x0F) << 4)).reshape(n, k // 2)
    if bits == 4:
        return q, None
    hb, per = bits - 4, _per(bits)
    # Nibble byte 4j + b of a tile: word j // per of its h words, byte b, bits 2 * hb * (j % per).
    pair = ((lo >> 4) | ((hi >> 4) << hb)).reshape(n, k // 32, 4 // per, per, 4)
    h = torch.zeros_like(pair[:, :, :, 0])
    for j in range(per):
        h |= pair[:, :, :, j] << (2 * hb * j)
    return q, h.reshape(n, k // 2 // per)


def _unpack(q: torch.Tensor, h: torch.Tensor | None, bits: int) -> torch.Tensor:
    """The `q` and `h` planes -> codes [n, k] as int32."""
    n, half = q.shape
    q = q.int().view(n, half // 16, 16)
    lo, hi = q & 0x0F, q >> 4
    if h is not None:
        hb, per = bits - 4, _per(bits)
        h = h.int().view(n, half // 16, 4 // per, 4)
        pair = torch.stack([(h >> (2 * hb * j)) & ((1 << 2 * hb) - 1) for j in range(per)], dim=3)
        pair = pair.view(n, half // 16, 16)
        lo = lo | ((pair & ((1 << hb) - 1)) << 4)
        hi = hi | ((pair >> hb) << 4)
    return torch.stack([lo, hi], dim=2).reshape(n, half * 2)


def _repack(data: torch.Tensor, qt: T, k: int) -> dict[str, torch.Tensor]:
    """GGUF bytes of whole rows of width k -> the planes of those rows."""
    type_size = GGML_QUANT_SIZES[qt][1]
    fields = _split(data.view(-1, type_size), qt)
    u = fields.pop("u")
    q, h = _pack(u.reshape(-1, k), LAYOUTS[qt].bits)
    n = q.shape[0]
    planes = {"q": q} | ({"h": h} if h is not None else {})
    return planes | {
        name: t.reshape(n, -1).to(torch.float16 if name in ("d", "m") else t.dtype).contiguous()
        for name, t in fields.items()
    }


class QuantWeight:
    """A [n, k] weight kept quantized (see the module doc for the planes); `.planes` are on one device."""

    def __init__(self, qtype: T, shape: tuple[int, int], planes: dict[str, torch.Tensor]):
        self.qtype, self.layout = qtype, LAYOUTS[qtype]
        self.shape = shape
        self.planes = planes

    @classmethod
    def from_gguf(cls, raw, qtype, shape, device: str | torch.device = "cpu", *, pinned: bool = False) -> QuantWeight:
        """From a tensor's GGUF bytes (numpy or uint8 torch, e.g. `GGUFFile.raw`) of torch `shape` [n, k].

        The repack runs on `device`, so a GPU does the bit shuffling of a big tensor. `pinned`: the
        planes are kept in page-locked host memory instead (read by `rows` from a GPU), a slice at a time.
        """
        qt = T(qtype)
        if qt not in LAYOUTS:
            supported = ", ".join(t.name for t in LAYOUTS)
            raise QuantError(f"no quantized GPU layout for tensor type {qt.name} (supported: {supported})")
        if len(shape) != 2:
            raise QuantError(f"a quantized weight must be 2-D, got shape {list(shape)}")
        n, k = (int(s) for s in shape)
        block, type_size = GGML_QUANT_SIZES[qt]
        data = _as_bytes(raw)
        if k % block or data.numel() != n * k // block * type_size:
            raise QuantError(f"{qt.name} tensor of shape {[n, k]} does not match its {data.numel()} bytes")
        # A slice of rows at a time: the repack's integer intermediates are several times the bytes, and
        # a 248k-row embedding repacked whole would set the device's peak (a 27B's load).
        row_bytes = k // block * type_size
        step = max(1, REPACK_BYTES // row_bytes)
        planes: dict[str, torch.Tensor] = {}
        staging = load_staging(torch.device(device), REPACK_BYTES)
        for r0 in range(0, n, step):
            part = _repack(staging.to_device(data[r0 * row_bytes : (r0 + step) * row_bytes]), qt, k)
            for name, t in part.items():
                where = {"device": "cpu", "pin_memory": True} if pinned else {"device": t.device}
                planes.setdefault(name, torch.empty(n, t.shape[1], dtype=t.dtype, **where))[r0 : r0 + step] = t
        return cls(qt, (n, k), planes)

    @classmethod
    def cat(cls, parts: list[QuantWeight]) -> QuantWeight:
        """Row blocks of one type and width as one weight: one GEMV launch over all their rows."""
        qt, k = parts[0].qtype, parts[0].shape[1]
        if any(p.qtype != qt or p.shape[1] != k for p in parts):
            raise QuantError(f"cannot join {[(p.qtype.name, p.shape) for p in parts]}: one type and width only")
        planes = {name: torch.cat([p.planes[name] for p in parts]) for name in parts[0].planes}
        return cls(qt, (sum(p.shape[0] for p in parts), k), planes)

    @property
    def device(self) -> torch.device:
        return self.planes["q"].device

    @property
    def nbytes(self) -> int:
        """Device bytes of all planes."""
        return sum(t.numel() * t.element_size() for t in self.planes.values())

    def to(self, device) -> QuantWeight:
        return QuantWeight(self.qtype, self.shape, {k: t.to(device) for k, t in self.planes.items()})

    def row_block(self, a: int, b: int) -> QuantWeight:
        """Rows [a, b) as views of the planes (rows are whole blocks: nothing is copied)."""
        return QuantWeight(self.qtype, (b - a, self.shape[1]), {k: t[a:b] for k, t in self.planes.items()})

    def take(self, ids: torch.Tensor) -> QuantWeight:
        """The selected rows, still quantized."""
        ids = ids.reshape(-1).to(self.device)
        return QuantWeight(
            self.qtype, (ids.numel(), self.shape[1]), {k: t.index_select(0, ids) for k, t in self.planes.items()}
        )

    def rows(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dequantized rows [*ids.shape, k] by torch ops (`qlinear.embed_rows` picks the kernel on a GPU)."""
        return self.take(ids).dequantize(dtype).view(*ids.shape, self.shape[1])

    def dequantize(self, dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
        """Dense [n, k] by torch ops, bit-exact with `quant.dequantize` in float32, written into `out`
        when given (`qlinear.dense` picks the kernel on a GPU)."""
        w = self.dequantize_reference().to(dtype)
        return w if out is None else out.copy_(w)

    def dequantize_reference(self) -> torch.Tensor:
        """Dense float32 [n, k] by torch ops on any device: what the kernels are checked against."""
        lay, p = self.layout, self.planes
        n, k = self.shape
        u = _unpack(p["q"], p.get("h"), lay.bits)
        g = lay.g or lay.sb  # one scale per group of g weights
        if lay.has_mn:
            d, m, sc, mn = _unpack_k_scales(p["sm"], p["dm"])
        else:
            d, m, sc = p["d"].float(), p["m"].float() if lay.has_m else None, p.get("sc")
        d = d.repeat_interleave(lay.sb // g, dim=1)
        if lay.g:
            d = d * sc.float()
        w = d.view(n, k // g, 1) * (u - lay.offset).float().view(n, k // g, g)
        if lay.has_m:
            m = m.repeat_interleave(lay.sb // g, dim=1)
            if lay.has_mn:
                m = m * mn.float()
            w = w + m.view(n, k // g, 1)
        return w.view(n, k)
