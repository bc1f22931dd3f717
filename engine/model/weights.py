"""Weights from the GGUF, in the form the products run on.

`Linear` is y = x @ W^T (+ b) with W dense in the compute dtype, or int8 rows with a bfloat16
scale each (on CPU with 16-bit compute: torch's 16-bit single-row GEMM is slow there and decode
is memory-bound). `QuantLinear` keeps W in its GGUF quantization on a GPU (engine/kernels): a
27B Q5_K_M model then needs its 19 GB, not 54 GB of bfloat16. `Weights` loads a stage's tensors
from one file onto one device; converted int8 weights of big files are kept in an on-disk cache
(`cache_dir`, None disables it) and memory-mapped on later loads.
"""

from __future__ import annotations

import itertools
import logging
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from ..device import load_staging
from ..errors import UserError
from ..gguf_file import GGUFFile
from ..kernels.qlinear import DequantScratch, qlinear
from ..kernels.qweight import LAYOUTS, REPACK_BYTES, QuantWeight
from ..quant import DENSE_TYPES, dequantize

log = logging.getLogger("hydra.model")

# Above this many rows (prefill), int8 layers run as a bfloat16 GEMM instead of the int8 kernel.
_INT8_MAX_ROWS = 16
# Files at least this big keep their converted (int8) weights in the on-disk cache.
_CACHE_MIN_FILE_BYTES = 64 << 20
# Rows converted per step when building int8 weights: bounds the float32 temporaries.
_CONVERT_ROWS = 16384
_DENSE_BLOCK_BYTES = 16 << 20


class Linear:
    """y = x @ W^T (+ b). W is dense in the compute dtype, or int8 rows with a bfloat16 scale each
    (`scale`), stored as `terms` stacked row blocks whose products add up: a second term quantizes
    the first one's residual, so two int8 terms are about as exact as float32 weights.

    `row_invariant` (`--deterministic`): each output row is the same floats whatever other rows share
    the call. The int8 kernel already is (it never takes the bfloat16 copy then); a dense product
    runs one row at a time (MKL's float32 GEMM blocks by row count: a row's last bits depend on it)."""

    def __init__(
        self,
        weight: torch.Tensor,
        scale: torch.Tensor | None = None,
        bias=None,
        terms: int = 1,
        row_invariant: bool = False,
    ):
        self.weight, self.scale, self.bias, self.terms = weight, scale, bias, terms
        self.row_invariant = row_invariant
        self._dense = None

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + (0 if self.scale is None else self.scale.nbytes)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.scale is None and self.row_invariant and x.shape[0] > 1:
            y = torch.cat([_dense_linear(row, self.weight) for row in x.split(1)])
        elif self.scale is None:
            y = _dense_linear(x, self.weight)
        elif x.shape[0] > _INT8_MAX_ROWS and self.terms > 1 and not self.row_invariant:
            y = F.linear(x.to(torch.bfloat16), self._bf16())
        else:
            y = torch.ops.aten._weight_int8pack_mm(x.to(self.scale.dtype), self.weight, self.scale)
            if self.terms > 1:
                y = y.view(x.shape[0], self.terms, -1).float().sum(1)  # the residual term is below bf16 resolution
        return y if self.bias is None else y.float() + self.bias

    def _bf16(self) -> torch.Tensor:
        """The weight summed from its int8 terms and rounded to bfloat16, built on the first many-row
        product (prefill) and kept: a 16-bit GEMM beats the int8 kernel ~4x there."""
        if self._dense is None:
            n = self.weight.shape[0] // self.terms
            w = (self.weight.view(self.terms, n, -1).float() * self.scale.float().view(self.terms, n, 1)).sum(0)
            self._dense = w.to(torch.bfloat16)
        return self._dense


def _dense_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T: on CUDA, decode's one or two rows of a 16-bit weight by the Triton GEMV (1.13x
    cuBLAS over the 1.1B's matrices at one row, docs/PERF.md session 15), more rows by cuBLAS."""
    dense16 = w.dtype in (torch.bfloat16, torch.float16) and x.dtype == w.dtype and w.stride(1) == 1
    if x.device.type == "cuda" and dense16:
        from ..kernels.triton_dense import DENSE_GEMV_MAX_ROWS, dmm

        if x.shape[0] <= DENSE_GEMV_MAX_ROWS:
            return dmm(x, w)
    return F.linear(x, w)


class QuantLinear:
    """y = x @ W^T (+ b) with W quantized on the device. Row blocks of different types (Q4_K_M's
    Q6_K attn_v beside Q4_K q and k) stay separate weights, each multiplied by its own kernel."""

    scale = None  # not an int8 head: its logits need no rescoring

    def __init__(self, parts: list[QuantWeight], bias=None, scratch: DequantScratch | None = None):
        self.parts, self.bias, self.scratch = parts, bias, scratch
        if scratch is not None:
            for p in parts:
                scratch.register(p)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        ys = [qlinear(x, p, self.scratch) for p in self.parts]
        y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)
        return y if self.bias is None else y.float() + self.bias


def _int8_rows(w: torch.Tensor, terms: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output row, `terms` times over the remaining residual: w ≈ Σ q_t * scale_t[:, None].
    Returns the terms stacked along rows: int8 [terms * N, K], bfloat16 scales [terms * N].
    Consumes `w` (the residual is formed in place: this runs over every weight on a cold start)."""
    qs, scales = [], []
    for t in range(terms):
        absmax = torch.maximum(w.amax(dim=1), w.amin(dim=1).neg())  # ~8x faster than abs().amax() or aminmax() here
        scale = (absmax.clamp_min(1e-30) / 127.0).to(torch.bfloat16).float()
        q = torch.div(w, scale[:, None]).round_().clamp_(-127, 127)
        if t + 1 < terms:
            w.sub_(q * scale[:, None])
        qs.append(q.to(torch.int8))
        scales.append(scale.to(torch.bfloat16))
    return torch.cat(qs), torch.cat(scales)


def _prepared_cache(g: GGUFFile, cache_dir: Path | None, key: str, build) -> dict[str, torch.Tensor]:
    """Converted weights of a big model, kept on disk by file fingerprint and memory-mapped on later
    loads: converting Gemma's 262k-row head to int8 costs seconds, mapping it costs milliseconds.
    Small files (tests, synthetic models) are converted every time, and every file when `cache_dir` is None."""
    if cache_dir is None or g.nbytes < _CACHE_MIN_FILE_BYTES:
        return build()
    path = Path(cache_dir) / g.fingerprint / f"{key}.pt"
    if path.exists():
        try:
            return torch.load(path, mmap=True, weights_only=True)
        except Exception:  # a damaged cache entry is rebuilt, never fatal
            path.unlink(missing_ok=True)
    tensors = build()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        torch.save(tensors, tmp)
        os.replace(tmp, path)
    except OSError:
        pass  # read-only home or full disk: run without the cache
    return tensors


class Weights:
    """The tensors of one GGUF file as a stage needs them on `device`: float32 vectors, and
    `Linear`s in the compute dtype or (`int8`) as int8 rows, converted once per big file thanks to
    the cache."""

    def __init__(
        self,
        g: GGUFFile,
        arch: str,
        device: torch.device,
        dtype: torch.dtype,
        int8: bool,
        cache_dir: Path | None,
        quantized: bool = False,
        row_invariant: bool = False,
    ):
        self.g, self.arch = g, arch
        self.row_invariant = row_invariant  # every Linear's rows independent of the batch (`Linear`)
        self.device, self.dtype, self.int8 = device, dtype, int8
        self.cache_dir = cache_dir
        self.quantized = quantized  # keep GGUF block quantization on the device (a GPU)
        self.expanded: list[str] = []  # quantized tensors without a kernel, expanded to the compute dtype
        self._quant: dict[str, QuantWeight] = {}
        self.scratch = DequantScratch()  # the prefill's dense copies of this stage's quantized weights

    def tensor(self, name: str):
        try:
            return self.g.tensors[name]
        except KeyError:
            raise UserError(f"{self.g.path}: tensor {name!r} is missing (architecture {self.arch})") from None

    def f32(self, name: str) -> torch.Tensor:
        """The tensor dequantized to float32; on a GPU the bytes move first and decode there."""
        t = self.tensor(name)
        raw = load_staging(self.device, REPACK_BYTES).to_device(torch.from_numpy(self.g.raw(name)))
        return dequantize(raw, t.ggml_type, t.shape)

    def dense(self, names: list[str]) -> torch.Tensor:
        """The row-wise concatenation of matrices `names` in the compute dtype on the device, decoded
        into the one tensor it ends as, `_DENSE_BLOCK_BYTES` of float32 at a time: whole-matrix
        float32 temporaries (and their concatenation) left holes in the caching allocator's segments
        that stayed reserved for the process's life (0.4 GB on a 1.1B F16 model on the GPU)."""
        infos = [self.tensor(n) for n in names]
        out = torch.empty(sum(t.shape[0] for t in infos), infos[0].shape[1], dtype=self.dtype, device=self.device)
        at = 0
        for name, t in zip(names, infos):
            raw = torch.from_numpy(self.g.raw(name)).view(t.shape[0], -1)
            step = max(1, _DENSE_BLOCK_BYTES // (4 * t.shape[1]))
            for r in range(0, t.shape[0], step):
                rows = raw[r : r + step].to(self.device)
                out[at + r : at + r + rows.shape[0]] = dequantize(rows, t.ggml_type, (rows.shape[0], t.shape[1]))
            at += t.shape[0]
        return out

    def vector(self, name: str) -> torch.Tensor:
        return self.f32(name).to(self.device)

    def quant(self, name: str, *, pinned: bool = False) -> QuantWeight | None:
        """The tensor kept quantized on the device, or None when it stays dense: quantization is
        off, the tensor is F32/F16/BF16, or its type has no kernel (then it is expanded, logged and
        listed in `expanded`). One copy per tensor: Gemma's tied embedding and output share it.
        `pinned`: kept in page-locked host memory, read row by row from the GPU (an untied embedding)."""
        t = self.tensor(name)
        if not self.quantized or t.ggml_type in DENSE_TYPES:
            return None
        if t.ggml_type not in LAYOUTS:
            if name not in self.expanded:
                log.warning(
                    "%s: %s has no GPU kernel for its type %s: expanded to %s",
                    self.g.path.name,
                    name,
                    t.ggml_type.name,
                    self.dtype,
                )
                self.expanded.append(name)
            return None
        if name not in self._quant:
            self._quant[name] = QuantWeight.from_gguf(
                self.g.raw(name), t.ggml_type, t.shape, self.device, pinned=pinned
            )
        return self._quant[name]

    def _joined(self, names: list[str], parts: list[QuantWeight]) -> list[QuantWeight]:
        """Neighbouring parts of one type as one weight (q and k of a Q4_K_M model, gate and up):
        one GEMV launch over their rows. A joined tensor leaves the one-copy cache: held once."""
        joined = []
        for _, run in itertools.groupby(zip(names, parts), key=lambda part: part[1].qtype):
            run = list(run)
            if len(run) > 1:
                for name, _ in run:
                    del self._quant[name]
            joined.append(run[0][1] if len(run) == 1 else QuantWeight.cat([w for _, w in run]))
        return joined

    def linear(self, names: list[str], bias_names: list[str] = (), terms: int = 2) -> Linear:
        """One Linear over the row-wise concatenation of tensors `names` (fused QKV, fused gate+up);
        int8 weights get `terms` terms (the output head one: its top logits are rescored exactly)."""
        bias = torch.cat([self.f32(n) for n in bias_names]).to(self.device) if bias_names else None
        quant = [self.quant(n) for n in names]
        if all(q is not None for q in quant):
            return QuantLinear(self._joined(names, quant), bias, self.scratch)
        if not self.int8:
            return Linear(self.dense(names), None, bias, row_invariant=self.row_invariant)

        def convert() -> dict[str, torch.Tensor]:
            per_term = [[] for _ in range(2 * terms)]  # q and scale of each term, over all row chunks
            for name in names:
                t = self.tensor(name)
                raw = torch.from_numpy(self.g.raw(name)).view(t.shape[0], -1)
                for r in range(0, t.shape[0], _CONVERT_ROWS):  # bounded float32 temporaries
                    rows = raw[r : r + _CONVERT_ROWS]
                    q, scale = _int8_rows(dequantize(rows, t.ggml_type, (rows.shape[0], t.shape[1])), terms)
                    for i in range(terms):
                        per_term[2 * i].append(q.chunk(terms)[i])
                        per_term[2 * i + 1].append(scale.chunk(terms)[i])
            return {
                "weight": torch.cat([torch.cat(per_term[2 * i]) for i in range(terms)]),
                "scale": torch.cat([torch.cat(per_term[2 * i + 1]) for i in range(terms)]),
            }

        key = "+".join(names) + f".int8x{terms}v2"
        for name in names:
            self.tensor(name)  # a missing tensor is an error even when a converted copy is cached
        prepared = _prepared_cache(self.g, self.cache_dir, key, convert)
        return Linear(prepared["weight"], prepared["scale"], bias, terms, self.row_invariant)
