"""engine.quant against the numpy reference `gguf.quants.dequantize`, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import quants as reference_quants
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as T

from hydra_console.engine import quant
from hydra_console.engine.errors import UserError
from hydra_console.engine.gguf_file import GGUFFile
from hydra_console.engine.quant import SUPPORTED_TYPES, QuantError, dequantize, dequantize_rows

# Byte offsets of the float16 scale fields in one block of each block type: random bytes
# there would be inf/NaN half the time, so the generator writes finite halves instead.
F16_FIELDS = {
    T.Q8_0: (0,),
    T.Q4_0: (0,),
    T.Q4_1: (0, 2),
    T.Q5_0: (0,),
    T.Q5_1: (0, 2),
    T.Q2_K: (80, 82),
    T.Q3_K: (108,),
    T.Q4_K: (0, 2),
    T.Q5_K: (0, 2),
    T.Q6_K: (208,),
    T.IQ4_NL: (0,),
    T.IQ4_XS: (0,),
}
PLAIN = {T.F32: np.uint32, T.F16: np.uint16, T.BF16: np.uint16}
EXPONENT_MASK = {np.uint32: 0x7F800000, np.uint16: 0x7C00}
ALL_TYPES = sorted(SUPPORTED_TYPES, key=lambda t: t.value)


def finite_bits(rng: np.random.Generator, n: int, dtype) -> np.ndarray:
    """Random IEEE bit patterns of every class but inf/NaN (all-ones exponents are cleared to subnormals)."""
    bits = rng.integers(0, np.iinfo(dtype).max, n, dtype=dtype, endpoint=True)
    mask = dtype(EXPONENT_MASK[dtype])
    return np.where((bits & mask) == mask, bits & ~mask, bits)


def random_tensor(qt: T, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Random bytes of a tensor of `shape` (torch order) with finite scales / values, as flat uint8."""
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    if qt in PLAIN:
        dtype = PLAIN[qt]
        if qt == T.BF16:  # bf16 = top half of an f32
            return (finite_bits(rng, n, np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        return finite_bits(rng, n, dtype).view(np.uint8)
    block, type_size = GGML_QUANT_SIZES[qt]
    blocks = rng.integers(0, 256, (n // block, type_size), dtype=np.uint8)
    for at in F16_FIELDS[qt]:
        blocks[:, at : at + 2] = finite_bits(rng, n // block, np.uint16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(-1)


def reference(raw: np.ndarray, qt: T, shape: tuple[int, ...]) -> torch.Tensor:
    block, type_size = GGML_QUANT_SIZES[qt]
    rows = np.asarray(raw, dtype=np.uint8).reshape(-1, shape[-1] // block * type_size)
    out = np.ascontiguousarray(reference_quants.dequantize(rows, qt), dtype=np.float32).reshape(shape)
    assert not np.isnan(out).any(), "generator produced NaN: the comparison would be vacuous"
    return torch.from_numpy(out)


def shape_for(qt: T, rows: int, blocks_per_row: int) -> tuple[int, int]:
    return (rows, GGML_QUANT_SIZES[qt][0] * blocks_per_row)


def read_only(a: np.ndarray) -> np.ndarray:
    a = a.copy()
    a.setflags(write=False)
    return a


@pytest.mark.parametrize("qt", ALL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("shape_kind", ["matrix", "vector", "3d"])
def test_random_blocks_match_reference(qt, shape_kind):
    block = GGML_QUANT_SIZES[qt][0]
    shape = {"matrix": shape_for(qt, 5, 7), "vector": (block * 3,), "3d": (2, 3, block * 2)}[shape_kind]
    raw = read_only(random_tensor(qt, shape, seed=qt.value))
    before = raw.copy()
    ours = dequantize(raw, qt, shape)
    assert ours.dtype == torch.float32 and ours.shape == shape
    assert torch.equal(ours, reference(raw, qt, shape))
    assert np.array_equal(raw, before)


@pytest.mark.parametrize("qt", ALL_TYPES, ids=lambda t: t.name)
def test_torch_bytes_and_chunked_decode_match_reference(qt, monkeypatch):
    # A chunk of a couple of blocks forces the chunked path (used for large tensors) on small data.
    shape = shape_for(qt, 9, 5)
    raw = random_tensor(qt, shape, seed=100 + qt.value)
    expected = reference(raw, qt, shape)
    whole = dequantize(torch.from_numpy(raw), qt, shape)
    monkeypatch.setattr(quant, "_CHUNK_ELEMENTS", 2 * GGML_QUANT_SIZES[qt][0] + 1)
    chunked = dequantize(torch.from_numpy(raw), qt, shape)
    assert torch.equal(whole, expected)
    assert torch.equal(chunked, expected)


@pytest.mark.parametrize("qt", ALL_TYPES, ids=lambda t: t.name)
def test_dequantize_rows_equals_slice_of_full(qt):
    shape = shape_for(qt, 11, 3)
    raw = read_only(random_tensor(qt, shape, seed=200 + qt.value))
    full = dequantize(raw, qt, shape)
    rows = torch.tensor([[10, 0, 3], [3, 7, 10]])  # repeats, any order, any index shape
    got = dequantize_rows(raw, qt, shape[1], rows)
    assert got.shape == (2, 3, shape[1])
    assert torch.equal(got, full[rows])
    assert dequantize_rows(raw, qt, shape[1], torch.tensor([], dtype=torch.long)).shape == (0, shape[1])


def test_result_is_writable_and_does_not_alias_the_input():
    raw = read_only(random_tensor(T.F32, (4, 8), seed=1))
    before = raw.copy()
    out = dequantize(raw, T.F32, (4, 8))
    out.add_(1.0)  # would fault on a view of a read-only mmap
    assert np.array_equal(raw, before)
    assert torch.equal(out, reference(raw, T.F32, (4, 8)) + 1.0)


@pytest.mark.parametrize("qt", [T.I32, T.IQ2_XXS, T.TQ1_0, T.F64])
def test_unsupported_type_is_a_user_error_naming_it(qt):
    raw = np.zeros(GGML_QUANT_SIZES[qt][1] * 4, dtype=np.uint8)
    shape = (GGML_QUANT_SIZES[qt][0] * 4,)
    with pytest.raises(QuantError, match=qt.name) as e:
        dequantize(raw, qt, shape)
    assert isinstance(e.value, UserError)
    with pytest.raises(QuantError, match=qt.name):
        dequantize_rows(raw, qt, shape[0], torch.tensor([0]))


def test_bad_sizes_and_rows_are_clear_errors():
    raw = random_tensor(T.Q8_0, (4, 64), seed=2)
    with pytest.raises(QuantError, match=r"needs 272 bytes, got 271"):
        dequantize(raw[:-1], T.Q8_0, (4, 64))
    with pytest.raises(QuantError, match="block size 32"):
        dequantize(raw, T.Q8_0, (8, 34))
    with pytest.raises(QuantError, match="out of range"):
        dequantize_rows(raw, T.Q8_0, 64, torch.tensor([0, 4]))
    with pytest.raises(QuantError, match="out of range"):
        dequantize_rows(raw, T.Q8_0, 64, torch.tensor([-1]))
    with pytest.raises(QuantError, match="uint8"):
        dequantize(torch.zeros(68, dtype=torch.int16), T.Q8_0, (64,))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("qt", ALL_TYPES, ids=lambda t: t.name)
def test_cuda_matches_reference(qt):
    shape = shape_for(qt, 6, 4)
    raw = random_tensor(qt, shape, seed=300 + qt.value)
    ours = dequantize(torch.from_numpy(raw).cuda(), qt, shape)
    assert ours.is_cuda
    assert torch.equal(ours.cpu(), reference(raw, qt, shape))
    rows = torch.tensor([5, 1, 1], device="cuda")
    assert torch.equal(
        dequantize_rows(torch.from_numpy(raw).cuda(), qt, shape[1], rows).cpu(), reference(raw, qt, shape)[[5, 1, 1]]
    )


@pytest.fixture(scope="module")
def model(default_model):
    return GGUFFile(default_model)


def test_default_model_tensors_match_reference(model):
    by_type: dict[T, list] = {}
    for t in model.tensors.values():
        if t.name != "token_embd.weight":  # 168M elements: covered row-wise below
            by_type.setdefault(t.ggml_type, []).append(t)
    assert {T.F32, T.Q8_0, T.Q5_0, T.Q4_K, T.Q6_K} <= set(by_type)
    for qt, tensors in by_type.items():
        for t in tensors[:2] + tensors[-1:]:
            raw = model.raw(t.name)
            assert torch.equal(dequantize(raw, qt, t.shape), reference(raw, qt, t.shape)), t.name


def test_default_model_embedding_rows_match_reference(model):
    t = model.tensors["token_embd.weight"]
    n_rows, row_len = t.shape
    rows = torch.tensor([0, 2, 1, 106, 107, n_rows // 2, n_rows - 1, 2])
    row_bytes = t.nbytes // n_rows
    table = model.raw(t.name).reshape(n_rows, row_bytes)
    expected = reference(table[rows.numpy()], t.ggml_type, (len(rows), row_len))
    assert torch.equal(dequantize_rows(model.raw(t.name), t.ggml_type, row_len, rows), expected)
