"""engine.gguf_file against `gguf.GGUFReader` as the oracle, plus the default model and broken files."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFWriter
from gguf import GGUFValueType as V
from gguf import quants as reference_quants
from gguf.constants import GGMLQuantizationType as T
from hypothesis import given, settings
from hypothesis import strategies as st

from hydra_console.engine.errors import UserError
from hydra_console.engine.gguf_file import GGUFError, GGUFFile

# (key, GGUF value type, array element type, value) covering every value type.
METADATA = [
    ("test.u8", V.UINT8, None, 200),
    ("test.i8", V.INT8, None, -100),
    ("test.u16", V.UINT16, None, 60_000),
    ("test.i16", V.INT16, None, -30_000),
    ("test.u32", V.UINT32, None, 4_000_000_000),
    ("test.i32", V.INT32, None, -2_000_000_000),
    ("test.f32", V.FLOAT32, None, 0.25),
    ("test.bool", V.BOOL, None, True),
    ("test.str", V.STRING, None, "héllo ▁wörld 🙂\n"),
    ("test.str_empty", V.STRING, None, ""),
    ("test.u64", V.UINT64, None, 2**63 + 5),
    ("test.i64", V.INT64, None, -(2**62)),
    ("test.f64", V.FLOAT64, None, 1e-300),
    ("test.arr.u8", V.ARRAY, V.UINT8, [0, 7, 255]),
    ("test.arr.i16", V.ARRAY, V.INT16, [-5, 5]),
    ("test.arr.i32", V.ARRAY, V.INT32, [1, -2, 3]),
    ("test.arr.u64", V.ARRAY, V.UINT64, [2**64 - 1, 0]),
    ("test.arr.f32", V.ARRAY, V.FLOAT32, [0.5, -1.25, 3.0]),
    ("test.arr.f64", V.ARRAY, V.FLOAT64, [1e200, -0.0]),
    ("test.arr.bool", V.ARRAY, V.BOOL, [True, False, True]),
    ("test.arr.str", V.ARRAY, V.STRING, ["a", "", "▁b", "<0x0A>", "日本"]),
    ("test.arr.nested_ints", V.ARRAY, None, [[1, 2], [3, 4, 5]]),
    ("test.arr.nested_strs", V.ARRAY, None, [["x", "y"], ["z"]]),
]
PY_TYPE = {V.FLOAT32: float, V.FLOAT64: float, V.BOOL: bool, V.STRING: str}
NP_DTYPE = {
    V.UINT8: np.uint8,
    V.INT8: np.int8,
    V.UINT16: np.uint16,
    V.INT16: np.int16,
    V.UINT32: np.uint32,
    V.INT32: np.int32,
    V.UINT64: np.uint64,
    V.INT64: np.int64,
    V.FLOAT32: np.float32,
    V.FLOAT64: np.float64,
    V.BOOL: np.bool_,
}


def write_gguf(path: Path, *, alignment: int | None = None, tensors: dict | None = None, seed: int = 0) -> Path:
    """A small GGUF with METADATA and tensors of several types and ranks."""
    rng = np.random.default_rng(seed)
    w = GGUFWriter(path, "testarch")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for key, vtype, sub_type, value in METADATA:
        w.add_key_value(key, value, vtype, sub_type=sub_type)
    if tensors is None:
        q8 = reference_quants.quantize(rng.standard_normal((2, 64)).astype(np.float32), T.Q8_0)
        bf16 = (rng.standard_normal((2, 3, 4)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        tensors = {
            "f32.vec": (rng.standard_normal(7).astype(np.float32), None),
            "f32.mat": (rng.standard_normal((3, 5)).astype(np.float32), None),
            "f16.mat": (rng.standard_normal((4, 6)).astype(np.float16), None),
            "q8_0.mat": (q8, T.Q8_0),
            "q4_k.mat": (rng.integers(0, 256, (3, 144), dtype=np.uint8), T.Q4_K),
            "bf16.cube": (bf16.view(np.uint8), T.BF16),
        }
    for name, (data, raw_dtype) in tensors.items():
        w.add_tensor(name, data, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def small_gguf(tmp_path) -> Path:
    return write_gguf(tmp_path / "small.gguf")


def flatten(value):
    if isinstance(value, list) and value and isinstance(value[0], (list, np.ndarray)):
        return [x for part in value for x in flatten(part)]
    return value.tolist() if isinstance(value, np.ndarray) else value


@pytest.mark.parametrize("alignment", [None, 64])
def test_matches_gguf_reader(tmp_path, alignment):
    path = write_gguf(tmp_path / "m.gguf", alignment=alignment)
    ours, oracle = GGUFFile(path), GGUFReader(path)

    oracle_keys = [k for k in oracle.fields if not k.startswith("GGUF.")]
    assert list(ours.metadata) == oracle_keys
    for key in oracle_keys:
        field, value = oracle.fields[key], ours.metadata[key]
        assert flatten(value) == field.contents(), key
        main = field.types[0]
        if main == V.ARRAY and len(field.types) == 2 and field.types[1] != V.STRING:
            assert isinstance(value, np.ndarray) and value.dtype == NP_DTYPE[field.types[1]], key
        elif main == V.ARRAY:
            assert isinstance(value, list), key
        else:
            assert type(value) is PY_TYPE.get(main, int), key
    written = {key: value for key, _, _, value in METADATA}
    assert ours.metadata["test.arr.nested_ints"][1].tolist() == written["test.arr.nested_ints"][1]
    assert ours.metadata["test.arr.nested_strs"] == written["test.arr.nested_strs"]
    assert ours.architecture == "testarch"
    if alignment:
        assert ours.metadata["general.alignment"] == alignment

    assert list(ours.tensors) == [t.name for t in oracle.tensors]
    for t in oracle.tensors:
        info = ours.tensors[t.name]
        assert info.shape == tuple(reversed(t.shape.tolist())), t.name
        assert info.ggml_type == t.tensor_type, t.name
        assert info.n_elements == t.n_elements, t.name
        assert (info.offset, info.nbytes) == (t.data_offset, t.n_bytes), t.name
        assert info.offset % (alignment or 32) == 0, t.name
        raw = ours.raw(t.name)
        assert raw.dtype == np.uint8 and not raw.flags.writeable
        assert raw.tobytes() == t.data.tobytes(), t.name


def test_default_model(default_model):
    g = GGUFFile(default_model)
    assert g.architecture == "gemma3"
    assert g.metadata["gemma3.block_count"] == 18
    assert len(g.tensors) == 236
    assert g.tensors["token_embd.weight"].shape == (262144, 640)
    assert g.tensors["token_embd.weight"].ggml_type == T.Q8_0
    assert len(g.metadata["tokenizer.ggml.tokens"]) == 262144
    # Tensor data lie inside the file, aligned, without overlaps.
    spans = sorted((t.offset, t.offset + t.nbytes) for t in g.tensors.values())
    assert spans[0][0] >= g.data_offset and spans[-1][1] <= g.path.stat().st_size
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    assert all(start % 32 == 0 for start, _ in spans)


def expect_error(path: Path, *fragments: str) -> GGUFError:
    with pytest.raises(GGUFError) as e:
        GGUFFile(path)
    message = str(e.value)
    assert str(path) in message
    for fragment in fragments:
        assert fragment in message
    assert isinstance(e.value, UserError)
    return e.value


def test_truncated_in_header(small_gguf, tmp_path):
    data = small_gguf.read_bytes()
    header_bytes = GGUFFile(small_gguf).header_bytes
    for cut in (6, 20, 30, header_bytes // 2, header_bytes - 1):
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(data[:cut])
        expect_error(path, "truncated")


def test_truncated_in_tensor_data(small_gguf, tmp_path):
    data = small_gguf.read_bytes()
    g = GGUFFile(small_gguf)
    last = max(g.tensors.values(), key=lambda t: t.offset)
    for cut in (last.offset + last.nbytes - 1, g.data_offset + 1):
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(data[:cut])
        first_missing = next(t for t in g.tensors.values() if t.offset + t.nbytes > cut)
        expect_error(path, "truncated", repr(first_missing.name))


def test_empty_garbage_and_wrong_magic(small_gguf, tmp_path):
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    expect_error(empty, "empty")

    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    expect_error(garbage, "not a GGUF file")

    garbage_after_magic = tmp_path / "garbage2.gguf"
    garbage_after_magic.write_bytes(b"GGUF" + np.random.default_rng(2).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    expect_error(garbage_after_magic)

    wrong_magic = tmp_path / "ggml.gguf"
    wrong_magic.write_bytes(b"GGML" + small_gguf.read_bytes()[4:])
    expect_error(wrong_magic, "not a GGUF file", "GGML")

    expect_error(tmp_path / "missing.gguf", "cannot open")


@pytest.mark.parametrize("value, vtype", [(0, V.UINT32), (3, V.UINT32), ("32", V.STRING)])
def test_bad_alignment_is_an_error(tmp_path, value, vtype):
    path = tmp_path / "align.gguf"
    w = GGUFWriter(path, "testarch")
    w.add_key_value("general.alignment", value, vtype)
    w.add_tensor("v", np.zeros(8, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    expect_error(path, "alignment")


def test_duplicate_tensor_name_is_an_error(tmp_path):
    tensors = {name: (np.zeros(4, dtype=np.float32), None) for name in ("dup.x", "dup.y")}
    path = write_gguf(tmp_path / "dup.gguf", tensors=tensors)
    path.write_bytes(path.read_bytes().replace(b"dup.y", b"dup.x"))
    expect_error(path, "duplicate", "'dup.x'")


def test_fingerprint_stable_and_sensitive_to_the_tensor_table(small_gguf, tmp_path):
    copy = tmp_path / "copy.gguf"
    shutil.copyfile(small_gguf, copy)
    fp = GGUFFile(small_gguf).fingerprint
    assert GGUFFile(small_gguf).fingerprint == fp == GGUFFile(copy).fingerprint
    assert len(fp) == 32 and set(fp) <= set("0123456789abcdef")

    reshaped = {"f32.mat": (np.zeros((5, 3), dtype=np.float32), None)}
    original = {"f32.mat": (np.zeros((3, 5), dtype=np.float32), None)}
    renamed = {"f32.max": (np.zeros((3, 5), dtype=np.float32), None)}
    prints = {
        GGUFFile(write_gguf(tmp_path / f"{label}.gguf", tensors=tensors)).fingerprint
        for label, tensors in (("orig", original), ("reshaped", reshaped), ("renamed", renamed))
    }
    assert len(prints) == 3


@pytest.fixture(scope="module")
def fuzz_base(tmp_path_factory) -> tuple[Path, bytes, int]:
    folder = tmp_path_factory.mktemp("fuzz")
    path = write_gguf(folder / "base.gguf", alignment=64)
    return folder, path.read_bytes(), GGUFFile(path).header_bytes


@settings(max_examples=150, deadline=None)
@given(edits=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 255)), min_size=1, max_size=4))
def test_corrupted_header_is_a_gguf_error_or_opens(fuzz_base, edits):
    """Any bytes overwritten in the header either still parse or give a GGUFError, never another exception."""
    folder, base, header_bytes = fuzz_base
    buf = bytearray(base)
    for where, value in edits:
        buf[int(where * header_bytes)] = value
    path = folder / "fuzz.gguf"
    path.write_bytes(bytes(buf))
    try:
        GGUFFile(path)
    except GGUFError as e:
        assert str(path) in str(e)
