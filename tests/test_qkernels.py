"""Quantized weights on the device: the planar layout against `quant.dequantize`, and the Triton kernels
against dequantize + matmul in float64."""

from __future__ import annotations

import importlib
import importlib.util

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as T
from kernel_device import KERNEL_DEVICE, needs_kernels

from hydra_console.engine.kernels import LAYOUTS, QuantWeight, qlinear, qweight
from hydra_console.engine.kernels.qlinear import DequantScratch, embed_rows
from hydra_console.engine.quant import QuantError, dequantize
from hydra_console.engine.synth.blocks import random_blocks

TYPES = list(LAYOUTS)
K_QUANTS = {T.Q4_K, T.Q5_K, T.Q6_K}
qlinear_module = importlib.import_module("hydra_console.engine.kernels.qlinear")  # the package exports the function

kernels = needs_kernels
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and the Triton backend of torch.compile")


def _weight(qt: T, n: int, k: int, seed: int = 0, device="cpu"):
    """(GGUF bytes, QuantWeight on device, float32 reference [n, k] on device) of a random weight."""
    raw = random_blocks((n, k), qt, 1 / 16, np.random.default_rng(seed))
    w = QuantWeight.from_gguf(raw, qt, (n, k), device=device)
    return raw, w, dequantize(raw, qt, (n, k)).to(device)


def _k(qt: T) -> int:
    return 768 if qt in K_QUANTS else 320  # three super-blocks; ten blocks, not a multiple of 256


@pytest.mark.parametrize("qt", TYPES, ids=lambda t: t.name)
def test_layout_is_bit_exact_and_rows_gather(qt):
    raw, w, ref = _weight(qt, 24, _k(qt))
    assert torch.equal(w.dequantize_reference(), ref)
    assert torch.equal(w.dequantize(), ref)
    ids = torch.tensor([[3, 0], [23, 3]])
    assert torch.equal(w.rows(ids), ref[ids])
    assert w.nbytes == raw.nbytes  # the true footprint: the file's bytes, rearranged


@pytest.mark.parametrize("qt", [T.Q5_K, T.Q8_0], ids=lambda t: t.name)
def test_repack_in_row_slices_equals_whole(qt, monkeypatch):
    """Big tensors are repacked a slice of rows at a time (device peak at load): same planes, last slice short."""
    raw, whole, _ = _weight(qt, 24, _k(qt))
    monkeypatch.setattr(qweight, "REPACK_BYTES", raw.shape[1] * 5)  # slices of 5 rows: 5+5+5+5+4
    sliced = QuantWeight.from_gguf(raw, qt, (24, _k(qt)))
    assert sliced.planes.keys() == whole.planes.keys()
    assert all(torch.equal(sliced.planes[name], t) for name, t in whole.planes.items())


def test_unsupported_type_and_bad_shape_are_clear_errors():
    raw = random_blocks((4, 256), T.Q2_K, 0.1, np.random.default_rng(0))
    with pytest.raises(QuantError, match="Q2_K"):
        QuantWeight.from_gguf(raw, T.Q2_K, (4, 256))
    raw = random_blocks((4, 256), T.Q4_K, 0.1, np.random.default_rng(0))
    with pytest.raises(QuantError, match=r"Q4_K tensor of shape \[4, 512\]"):
        QuantWeight.from_gguf(raw, T.Q4_K, (4, 512))


def test_parts_of_one_type_join_into_one_weight(tiny_model):
    """A layer's neighbouring weights of one type are one QuantWeight (one GEMV over their rows): Q4_K_M's
    q and k (its v is Q6_K), gate and up; their rows equal each part's, and the parts leave the cache."""
    from hydra_console.engine.gguf_file import GGUFFile
    from hydra_console.engine.model import build_stage

    g = GGUFFile(tiny_model("llama", qtype="Q4_K_M", n_layers=2, n_embd=256, n_head=4, n_head_kv=2, n_ff=512))
    stage = build_stage(g, embed=False, head=True, device="cpu", dtype="bfloat16", quantized=True, n_slots=1, n_ctx=8)
    layer = stage.layers[0]
    assert [(p.qtype, p.shape) for p in layer.wqkv.parts] == [(T.Q4_K, (384, 256)), (T.Q6_K, (128, 256))]
    assert [(p.qtype, p.shape) for p in layer.w_gate_up.parts] == [(T.Q4_K, (1024, 256))]
    joined = {f"blk.0.{n}.weight" for n in ("attn_q", "attn_k", "ffn_gate", "ffn_up")}
    assert not joined & stage.weights._quant.keys() and "blk.0.attn_v.weight" in stage.weights._quant
    rows = torch.cat([dequantize(g.raw(f"blk.0.ffn_{n}.weight"), T.Q4_K, (512, 256)) for n in ("gate", "up")])
    assert torch.equal(layer.w_gate_up.parts[0].dequantize_reference(), rows)
    with pytest.raises(QuantError, match="one type and width"):
        QuantWeight.cat(layer.wqkv.parts)


def test_qlinear_reference_on_cpu():
    _, w, ref = _weight(T.Q4_K, 40, 512)
    x = torch.randn(2, 3, 512)
    torch.testing.assert_close(qlinear(x, w), x @ ref.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "cap", [None, 40 * 512, 7 * 512, 100]
)  # whole; one block; blocks of 7 rows (5 × 7 + 5); too small
def test_prefill_matmul_through_the_stage_scratch(cap, monkeypatch):
    """The prefill's product dequantizes into the stage's one scratch, a block of rows at a time where
    the weight is larger: the same product (the block logic runs the same on CPU tensors)."""
    _, w, ref = _weight(T.Q4_K, 40, 512)
    if cap is not None:
        monkeypatch.setattr(qlinear_module, "SCRATCH_ELEMENTS", cap)
    scratch = DequantScratch()
    scratch.register(w)
    # Sized to the largest block it will hold, not the cap (equal blocks can be smaller).
    assert scratch.need == {None: 40 * 512, 40 * 512: 40 * 512, 7 * 512: 7 * 512, 100: 0}[cap]
    scratch.buf = torch.empty(min(scratch.need, cap or scratch.need))  # `fit` allocates on CUDA only
    x = torch.randn(33, 512)
    torch.testing.assert_close(qlinear_module._dequant_matmul(x, w, scratch), x @ ref.T, rtol=1e-5, atol=1e-5)
    if cap == 7 * 512:
        assert torch.equal(scratch.buf.view(7, 512)[:5], ref[35:])  # the last block written was rows 35..39


@cuda
def test_prefill_matmul_scratch_on_cuda(monkeypatch):
    """On the GPU: a stage-owned scratch in blocks, inside a CUDA graph too, equals the product."""
    _, w, ref = _weight(T.Q5_K, 300, 1024, device="cuda")
    monkeypatch.setattr(qlinear_module, "SCRATCH_ELEMENTS", 64 * 1024)  # room for 64 rows: five blocks of 60
    scratch = DequantScratch()
    scratch.register(w)
    scratch.fit(torch.bfloat16, torch.device("cuda"))
    assert scratch.buf.numel() == 60 * 1024
    x = torch.randn(100, 1024, device="cuda", dtype=torch.bfloat16)
    want = x.double() @ ref.double().T
    assert _rel_err(qlinear(x, w, scratch), want) < 1e-2
    y = qlinear(x, w, scratch)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = qlinear(x, w, scratch)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(y, qlinear(x, w, scratch), rtol=0, atol=0)


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).abs().max() / ref.abs().max())


@kernels
@pytest.mark.parametrize("qt", TYPES, ids=lambda t: t.name)
def test_kernel_dequantize_is_bit_exact(qt):
    from hydra_console.engine.kernels.triton_qdequant import kernel_dequantize

    # Under the interpreter (a cost per program of 16 rows x 256 columns) 40 rows: two whole blocks and
    # a partial one; and K of three whole super-blocks or 1.25 blocks of 256 (the column mask).
    n, k = (300, 2 * _k(qt)) if KERNEL_DEVICE == "cuda" else (40, _k(qt))
    raw, w, ref = _weight(qt, n, k, device=KERNEL_DEVICE)
    assert torch.equal(kernel_dequantize(w, torch.float32), ref)
    assert torch.equal(w.dequantize_reference(), ref)
    bf16 = kernel_dequantize(w, torch.bfloat16)
    if KERNEL_DEVICE == "cuda":
        assert torch.equal(bf16, ref.bfloat16())
        ids = torch.tensor([7, 299, 0, 7], device="cuda")
        assert torch.equal(embed_rows(w, ids), ref[ids])
    else:  # Triton's interpreter truncates to bfloat16 where CUDA rounds to nearest
        torch.testing.assert_close(bf16.float(), ref, rtol=2**-7, atol=0)


@kernels
@pytest.mark.parametrize("qt", [T.Q5_K, T.Q6_K, T.Q8_0], ids=lambda t: t.name)
def test_embedding_rows_are_gathered_by_the_kernel_from_pinned_host_planes(qt):
    """The token embedding on a GPU worker stays in pinned host memory (llama.cpp's placement): the
    lookup kernel reads only the rows asked for, bit-exact, ids in any order and repeated."""
    from hydra_console.engine.kernels.triton_qdequant import kernel_rows

    raw = random_blocks((300, 2 * _k(qt)), qt, 1 / 16, np.random.default_rng(3))
    ref = dequantize(raw, qt, (300, 2 * _k(qt)))
    ids = torch.tensor([7, 299, 0, 7, 150], device=KERNEL_DEVICE)
    if KERNEL_DEVICE == "cuda":
        w = QuantWeight.from_gguf(raw, qt, (300, 2 * _k(qt)), device="cuda", pinned=True)
        assert w.device.type == "cpu" and all(t.is_pinned() for t in w.planes.values())
        assert torch.equal(embed_rows(w, ids), ref.cuda()[ids])
    else:  # under the interpreter the planes are plain host tensors: the same kernel, the same gather
        w = QuantWeight.from_gguf(raw, qt, (300, 2 * _k(qt)))
    assert torch.equal(kernel_rows(w, ids, torch.float32).cpu(), ref[ids.cpu()])


def test_k_quant_scale_fields_round_trip():
    """`sm` and `dm` hold a K-quant block's d, dmin and every 6-bit scale and min, whatever its bytes."""
    from hydra_console.engine.quant import _scale_min_k4

    b = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (4096, 16), dtype=np.uint8))
    packed = qweight._pack_k_scales(b)
    assert packed["sm"].shape == (4096, 8) and packed["dm"].shape == (4096, 1)
    d, m, sc, mn = qweight._unpack_k_scales(packed["sm"].reshape(1, -1), packed["dm"].reshape(1, -1))
    want_d, want_dmin = (b[:, at : at + 2].contiguous().view(torch.float16).float().view(1, -1) for at in (0, 2))
    torch.testing.assert_close(d, want_d, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(m, -want_dmin, rtol=0, atol=0, equal_nan=True)
    want_sc, want_mn = _scale_min_k4(b[:, 4:16])
    assert torch.equal(sc.view(-1, 8), want_sc.long()) and torch.equal(mn.view(-1, 8), want_mn.long())


@kernels
@pytest.mark.parametrize("qt", [T.Q4_K, T.Q5_K], ids=lambda t: t.name)
def test_kernels_read_k_quant_scales_and_mins_apart(qt, monkeypatch):
    """`random_blocks` ties each min to its scale (zero-mean weights); here they are independent random
    6-bit values, so a kernel that swaps them or misplaces a high bit is caught."""
    from hydra_console.engine.kernels.triton_qdequant import kernel_dequantize
    from hydra_console.engine.kernels.triton_qmatmul import fused_matmul

    rng = np.random.default_rng(3)
    n, k = 16, 512
    raw = random_blocks((n, k), qt, 1 / 16, rng)
    blocks = raw.reshape(-1, raw.shape[-1] // (k // 256))
    blocks[:, 4:16] = rng.integers(0, 256, (blocks.shape[0], 12), dtype=np.uint8)
    ref = dequantize(raw, qt, (n, k)).to(KERNEL_DEVICE)
    w = QuantWeight.from_gguf(raw, qt, (n, k), device=KERNEL_DEVICE)
    assert torch.equal(w.dequantize_reference(), ref)
    assert torch.equal(kernel_dequantize(w, torch.float32), ref)
    # A fixed x: one int8 term of bfloat16 x sits near the 1e-2 bound for some draws, and the
    # global generator's state depends on which tests ran before in this process.
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(3)).to(KERNEL_DEVICE)
    for terms in (0, 1):
        _gemv_x_terms(monkeypatch, terms)
        x_in = x if terms == 0 else x.bfloat16()
        assert _rel_err(fused_matmul(x_in, w), x_in.double() @ ref.double().T) < (1e-5 if terms == 0 else 1e-2)


def _gemv_x_terms(monkeypatch, terms: int) -> None:
    """Select the GEMV's int8-x (dp4a) variant with `terms` terms, or (0) its float one, for every row count."""
    from hydra_console.engine.kernels import triton_qmatmul

    for mr, cfg in triton_qmatmul.GEMV_CONFIGS.items():
        monkeypatch.setitem(triton_qmatmul.GEMV_CONFIGS, mr, cfg[:4] + (terms,) + cfg[5:])


# Under the interpreter (~0.2 s a launch, ~20 ms a program) every type runs 8 output rows: whole tiles
# of both GEMV tilings (2 and 4 rows), two to four programs. One K-quant runs 3 rows: a partial tile in
# both tilings (the row mask), and the 8-row tiling, one program wide, splits K over two programs summed
# by `reduced`; the mask and the split are the same code for every type. (40 rows had no partial tile.)
MATMUL_CASES = (
    [(qt, n) for qt in TYPES for n in (8, 1000)]
    if KERNEL_DEVICE == "cuda"
    else ([(qt, 8) for qt in TYPES] + [(T.Q5_K, 3)])
)


@kernels
@pytest.mark.parametrize("qt,n", MATMUL_CASES, ids=lambda v: getattr(v, "name", str(v)))
def test_fused_matmul_matches_reference(qt, n, monkeypatch):
    from hydra_console.engine.kernels.qlinear import GEMV_CHUNKED_ROWS
    from hydra_console.engine.kernels.triton_qmatmul import fused_matmul

    _gemv_x_terms(monkeypatch, 0)
    torch.manual_seed(n)  # bf16 x under the interpreter sits near the bound: the same x every run
    k = 4 * _k(qt)
    _, w, ref = _weight(qt, n, k, seed=n, device=KERNEL_DEVICE)
    assert qlinear(torch.randn(0, k, device=KERNEL_DEVICE), w).shape == (0, n)  # a chunk without logit rows
    for rows in (1, 2, 4, 5, 8, 16, 64, 300):
        x = torch.randn(rows, k, device=KERNEL_DEVICE)
        want = x.double() @ ref.double().T
        # float32 x: float32 arithmetic throughout; bf16 x: the output's rounding dominates.
        errs = {"qlinear": _rel_err(qlinear(x, w), want), "qlinear bf16": _rel_err(qlinear(x.bfloat16(), w), want)}
        if rows <= GEMV_CHUNKED_ROWS:  # 16: two passes of the 8-row GEMV
            errs |= {
                "gemv": _rel_err(fused_matmul(x, w), want),
                "gemv bf16": _rel_err(fused_matmul(x.bfloat16(), w), want),
            }
        print(f"{qt.name} n={n} k={k} rows={rows}: max rel err " + ", ".join(f"{p} {e:.2e}" for p, e in errs.items()))
        assert all(e < (1e-2 if p.endswith("bf16") else 1e-5) for p, e in errs.items()), errs


@kernels
def test_a_rows_gemv_result_does_not_depend_on_its_place_in_a_chunked_product():
    """9-32 rows run the 8-row GEMV in passes: a row in a short last pass gets the same floats as in
    a full one (each pass its own tile would split K differently and round differently)."""
    from hydra_console.engine.kernels.triton_qmatmul import fused_matmul

    torch.manual_seed(0)
    k = 16 * _k(T.Q4_K)  # K long enough that the 4- and 8-row tiles split it differently
    _, w, _ = _weight(T.Q4_K, 8, k, device=KERNEL_DEVICE)
    x = torch.randn(11, k, device=KERNEL_DEVICE)  # float32 out: bf16 would round most differences away
    y11 = fused_matmul(x, w)  # rows 8..10 in the last pass
    y16 = fused_matmul(torch.cat([x[8:], x[:5], x[:5], x[8:]])[:16], w)  # rows 8..10 in the first
    assert torch.equal(y16[:3], y11[8:]) and torch.equal(y16[3:8], y11[:5])


def _x_terms(xq: torch.Tensor, k: int, terms: int) -> list[tuple[torch.Tensor, ...]]:
    """`quantize_x`'s bytes -> per term (int8 codes [M, K], float32 scales [M, K/32], int32 half sums
    [M, K/32, 2], padding [M, K/32])."""
    tiles = xq.cpu().view(xq.shape[0], k // 32, terms, 48)
    out = []
    for t in range(terms):
        codes = tiles[:, :, t, :32].contiguous().view(torch.int8).reshape(xq.shape[0], k)
        meta = tiles[:, :, t, 32:].contiguous().view(torch.int32)
        out.append((codes, meta[..., 0].view(torch.float32), meta[..., 1:3], meta[..., 3]))
    return out


def _x_seen(terms: list[tuple[torch.Tensor, ...]]) -> torch.Tensor:
    """x as the int8-x GEMV multiplies it: Σ codes * scale over the terms, float64."""
    rows, k = terms[0][0].shape
    return sum((c.view(rows, -1, 32).double() * s.double()[..., None]).view(rows, k) for c, s, _, _ in terms)


@kernels
def test_quantize_x_codes_scales_and_sums():
    """16-bit x's tiles of 32 as the int8-x GEMV reads them: codes round(x / scale), scale max|x| / 127;
    a second term the same of the residual, which leaves x to ~15 bits."""
    from hydra_console.engine.kernels.triton_qmatmul import quantize_x

    k = 256
    x = torch.randn(3, k) * torch.logspace(-3, 3, k)  # tiles of very different magnitudes
    x[1, 32:64] = 0  # an all-zero tile: codes 0, scale 0
    x[2, 70] = -x[2, 64:96].abs().max() * 2  # a tile whose extreme is negative
    x = x.bfloat16()
    xt = x.float().view(3, k // 32, 32)
    first = _x_terms(quantize_x(x.to(KERNEL_DEVICE)), k, 1)
    two = _x_terms(quantize_x(x.to(KERNEL_DEVICE), 2), k, 2)
    assert all(torch.equal(a, b) for a, b in zip(first[0], two[0]))  # the first of two terms is the one term
    residual = xt  # float32, as the kernel forms it (its product and difference may be one fused op)
    for codes, scale, sums, pad in two:
        torch.testing.assert_close(scale, residual.abs().amax(-1) / 127, rtol=1e-4, atol=0)
        tiles = codes.view(3, -1, 32)
        assert tiles.abs().max() <= 127 and (tiles.abs().amax(-1) == 127).sum() == 3 * k // 32 - 1
        assert ((tiles - residual / scale.clamp_min(1e-30)[..., None]).abs() <= 0.5 + 1e-3).all()
        assert torch.equal(sums, tiles.int().view(3, -1, 2, 16).sum(-1)) and (pad == 0).all()
        residual = residual - tiles * scale[..., None]
    amax = xt.abs().amax(-1, keepdim=True).double()
    assert ((_x_seen(first) - x.double()).view(3, -1, 32).abs() <= amax / 254 * (1 + 1e-5)).all()
    assert ((_x_seen(two) - x.double()).view(3, -1, 32).abs() <= amax / 254 / 254 * (1 + 1e-3)).all()


# The second term of x is the same code for every type: under the interpreter, once per K-quant.
INT8_X_CASES = [(qt, t) for qt in TYPES for t in (1, 2) if KERNEL_DEVICE == "cuda" or t == 1 or qt in K_QUANTS]


@kernels
@pytest.mark.parametrize("qt,terms", INT8_X_CASES, ids=lambda v: getattr(v, "name", str(v)))
def test_fused_matmul_int8_x(qt, terms, monkeypatch):
    """The dp4a variant against float64 dequantized weights times the int8-quantized x it multiplies
    (its own error: the output's rounding), and against the unquantized x (x's quantization)."""
    from hydra_console.engine.kernels.triton_qmatmul import fused_matmul, quantize_x

    _gemv_x_terms(monkeypatch, terms)
    # Under the interpreter 8 output rows: two to four programs of the GEMV, as with 24, at a third of the cost.
    n, k = (1000, 4 * _k(qt)) if KERNEL_DEVICE == "cuda" else (8, 2 * _k(qt))
    _, w, ref = _weight(qt, n, k, seed=3, device=KERNEL_DEVICE)
    for rows, dtype in ((1, torch.float16), (2, torch.bfloat16), (3, torch.float16), (8, torch.bfloat16)):
        x = torch.randn(rows, k, device=KERNEL_DEVICE).to(dtype)
        x_seen = _x_seen(_x_terms(quantize_x(x, terms), k, terms))
        y = fused_matmul(x, w)
        assert y.dtype == dtype
        err_kernel = _rel_err(y.cpu(), x_seen @ ref.double().cpu().T)
        err_total = _rel_err(y.cpu(), x.double().cpu() @ ref.double().cpu().T)
        print(
            f"{qt.name} {terms} int8 terms of x, rows={rows} {dtype}: max rel err {err_kernel:.2e} (against x "
            f"as quantized), {err_total:.2e} (x)"
        )
        # The output's last bit: CUDA rounds, Triton's interpreter truncates.
        bound = 2.0 ** -(11 if dtype == torch.float16 else 8) * (1 if KERNEL_DEVICE == "cuda" else 2)
        assert err_kernel < bound and err_total < (2e-2 if terms == 1 else bound * 1.1)


@cuda
@pytest.mark.parametrize("rows", [1, 8, 64])
def test_cuda_graph_capture_and_replay(rows):
    _, w, _ = _weight(T.Q4_K, 512, 1024, device="cuda")
    x = torch.randn(rows, 1024, device="cuda")
    y = qlinear(x, w)  # compile and warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = qlinear(x, w)
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.testing.assert_close(y, qlinear(x, w), rtol=0, atol=0)


@cuda
def test_cuda_torch_compile_fullgraph():
    _, w, _ = _weight(T.Q6_K, 256, 512, device="cuda")

    @torch.compile(fullgraph=True)
    def f(x):
        return torch.nn.functional.silu(qlinear(x, w)) + qlinear(x * 2, w)

    for rows in (1, 3, 12, 100):
        x = torch.randn(rows, 512, device="cuda")
        want = torch.nn.functional.silu(qlinear(x, w)) + qlinear(x * 2, w)
        torch.testing.assert_close(f(x), want, rtol=1e-5, atol=1e-5)


# The tensor-core GEMM (triton_qmma.py). Under the interpreter (~0.1 s a launch): every type at 5 and 17
# rows, K not a multiple of BLOCK_K where the type allows (11 blocks of 32; K-quants: 3 super-blocks,
# split over two programs), 72 outputs (a partial BLOCK_N tile); Q5_K and Q6_K at every row count.
QMMA_CASES = [(qt, rows) for qt in TYPES for rows in (5, 17)] + [
    (qt, rows) for qt in (T.Q5_K, T.Q6_K) for rows in (1, 16, 32)
]


def _qmma_bound(dtype: torch.dtype) -> float:
    """float32 x: float32 products and sums; 16-bit x: the weight rounded to it, and the output's rounding
    (CUDA rounds to nearest, Triton's interpreter truncates)."""
    return 1e-5 if dtype == torch.float32 else 1e-2 * (1 if KERNEL_DEVICE == "cuda" else 2)


@kernels
@pytest.mark.parametrize("qt,rows", QMMA_CASES, ids=lambda v: getattr(v, "name", str(v)))
def test_tensor_core_matmul_matches_reference(qt, rows):
    from hydra_console.engine.kernels.triton_qmma import tensor_core_matmul

    n, k = (1000, 4 * _k(qt)) if KERNEL_DEVICE == "cuda" else (72, _k(qt) + 32 * (qt not in K_QUANTS))
    _, w, ref = _weight(qt, n, k, seed=rows, device=KERNEL_DEVICE)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(KERNEL_DEVICE)
    want = x.double() @ ref.double().T
    dtypes = (torch.float32, torch.bfloat16) + ((torch.float16,) if rows == 5 and qt in K_QUANTS else ())
    for dtype in dtypes if KERNEL_DEVICE == "cuda" or rows in (5, 17) else (torch.bfloat16,):
        y = tensor_core_matmul(x.to(dtype), w)
        assert y.shape == (rows, n) and y.dtype == dtype
        err = _rel_err(y, x.to(dtype).double() @ ref.double().T)
        print(f"{qt.name} {n}x{k} rows={rows} {dtype}: max rel err {err:.2e} (x in its dtype), {_rel_err(y, want):.2e}")
        assert err < _qmma_bound(dtype), (dtype, err)


@kernels
@pytest.mark.parametrize("block_k", [128, 512])
def test_tensor_core_matmul_other_tiles(block_k):
    """A config as the sweep times them: BLOCK_M 32 for 16 rows, x @ w.T (no swap), a BLOCK_K that splits
    a super-block (128) or leaves the last step half past K (512, K of 3 super-blocks)."""
    from hydra_console.engine.kernels.triton_qmma import qmma_launch

    _, w, ref = _weight(T.Q6_K, 40, 768, seed=1, device=KERNEL_DEVICE)
    x = torch.randn(16, 768, generator=torch.Generator().manual_seed(1)).to(KERNEL_DEVICE)
    planes = qweight_planes(w)
    for swap in (False, True):
        y = qmma_launch(x.bfloat16(), planes, (32, 32, block_k, 4, 1, 4, swap))
        assert _rel_err(y, x.bfloat16().double() @ ref.double().T) < _qmma_bound(torch.bfloat16)
    with pytest.raises(ValueError, match="up to 16 rows"):
        qmma_launch(torch.randn(17, 768, device=KERNEL_DEVICE), planes, (16, 32, 256, 4, 1, 4, True))


def qweight_planes(w: QuantWeight) -> tuple:
    from hydra_console.engine.kernels.triton_qplanes import planes_args

    return planes_args(w)


@kernels
def test_kernel_matmul_takes_the_tensor_core_gemm_from_qmma_min_rows(monkeypatch):
    """The GPU's dispatch with QMMA_MIN_ROWS lowered: from that row count to GEMV_CHUNKED_ROWS the
    tensor-core GEMM's result (bit for bit: its path), below it the GEMV's; both the reference's."""
    from hydra_console.engine.kernels.qlinear import GEMV_CHUNKED_ROWS, kernel_matmul
    from hydra_console.engine.kernels.triton_qmatmul import fused_matmul
    from hydra_console.engine.kernels.triton_qmma import QMMA_MAX_ROWS, qmma, tensor_core_matmul

    assert QMMA_MAX_ROWS == GEMV_CHUNKED_ROWS  # the rows the switch may hand over
    _gemv_x_terms(monkeypatch, 0)
    monkeypatch.setattr(qlinear_module, "QMMA_MIN_ROWS", 5)
    _, w, ref = _weight(T.Q5_K, 40, 512, seed=2, device=KERNEL_DEVICE)
    for rows, path in ((4, fused_matmul), (5, tensor_core_matmul), (17, tensor_core_matmul)):
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)).to(KERNEL_DEVICE)
        y = kernel_matmul(x, w)
        assert torch.equal(y, path(x, w)) and _rel_err(y, x.double() @ ref.double().T) < 1e-5
    assert qmma(torch.randn(0, 512, device=KERNEL_DEVICE), *qweight_planes(w)).shape == (0, 40)
    with pytest.raises(ValueError, match="1..32 rows"):
        tensor_core_matmul(torch.randn(33, 512, device=KERNEL_DEVICE), w)


@kernels
def test_qmma_op_schema_and_fake_tensor():
    """hydra::qmma as torch.compile sees it: its schema, and a fake that gives the op's shape and dtype."""
    from hydra_console.engine.kernels.triton_qmma import qmma

    _, w, _ = _weight(T.Q6_K, 40, 256, device=KERNEL_DEVICE)
    x = torch.randn(5, 256, device=KERNEL_DEVICE).bfloat16()
    torch.library.opcheck(qmma.op, (x, *qweight_planes(w)), test_utils=("test_schema", "test_faketensor"))


@cuda
@pytest.mark.parametrize("rows", [4, 17])
def test_tensor_core_matmul_in_cuda_graphs_and_torch_compile(rows, monkeypatch):
    """With QMMA_MIN_ROWS lowered, qlinear's tensor-core GEMM replays in a CUDA graph and compiles whole."""
    monkeypatch.setattr(qlinear_module, "QMMA_MIN_ROWS", 1)
    _, w, ref = _weight(T.Q5_K, 512, 1024, device="cuda")
    x = torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16)
    y = qlinear(x, w)
    assert _rel_err(y, x.double() @ ref.double().T) < 1e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = qlinear(x, w)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(y, qlinear(x, w), rtol=0, atol=0)
    f = torch.compile(lambda x: torch.nn.functional.silu(qlinear(x, w)), fullgraph=True)
    torch.testing.assert_close(f(x), torch.nn.functional.silu(qlinear(x, w)), rtol=0, atol=0)
