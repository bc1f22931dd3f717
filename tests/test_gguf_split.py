"""Split GGUF models (`NAME-00001-of-0000N.gguf`, llama-gguf-split's layout): engine/synth/split.py
writes them, contracts/gguf_header.py reads them whole from the first part; the gguf package's
reader and its own split writer are the oracles. Then through real servers: split equals whole,
solo and across a head and a peer."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from gguf import GGUFReader, GGUFWriter
from gguf import GGUFValueType as V
from rpc_workers import greedy, head, peer, running

from hydra_console.app.split_plan import ModelShape, WorkerMemory
from hydra_console.contracts.gguf_split import SPLIT_COUNT, SPLIT_NO, SPLIT_TENSORS_COUNT, split_path
from hydra_console.engine.errors import UserError
from hydra_console.engine.gguf_file import GGUFError, GGUFFile
from hydra_console.engine.model import build_stage
from hydra_console.engine.synth.split import split_gguf

SHAPE = dict(n_layers=3, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, qtype="Q4_K_M")
PROMPTS = ["hello world", "the cat sat on"]


@pytest.fixture(scope="module")
def whole(tiny_model):
    return tiny_model("llama", **SHAPE)


@pytest.fixture(scope="module")
def parts(whole, tmp_path_factory):
    """The model in 3 parts (its 30 tensors, 10 a part)."""
    n = len(GGUFFile(whole).tensors)
    return split_gguf(whole, tmp_path_factory.mktemp("split") / "model", max_tensors=-(-n // 3))


def test_parts_are_gguf_split_files(whole, parts):
    """Each part a GGUF the gguf package reads, the model's keys in the first only, then split.no,
    split.tensors.count, split.count (u16, i32, u16: gguf-split's order and types), each part's
    tensors in the model's order; merged back, the header is the original's byte for byte."""
    original = GGUFReader(whole)
    model_keys = [k for k in original.fields if not k.startswith("GGUF.")]
    names = [t.name for t in original.tensors]
    assert [p.name for p in parts] == [f"model-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    seen = []
    for no, path in enumerate(parts):
        r = GGUFReader(path)
        keys = [k for k in r.fields if not k.startswith("GGUF.")]
        split_keys = [SPLIT_NO, SPLIT_TENSORS_COUNT, SPLIT_COUNT]
        assert keys == (model_keys if no == 0 else []) + split_keys
        assert [r.fields[k].types[0] for k in split_keys] == [V.UINT16, V.INT32, V.UINT16]
        assert [r.fields[k].contents() for k in split_keys] == [no, len(names), 3]
        assert len(r.tensors) == 10
        seen += [t.name for t in r.tensors]
        for t in r.tensors:
            assert t.data.tobytes() == original.get_tensor(names.index(t.name)).data.tobytes(), t.name
    assert seen == names

    ours, g = GGUFFile(parts[0]), GGUFFile(whole)
    assert ours.merged_header() == bytes(g.buffer[: g.header_bytes])
    assert ours.fingerprint == g.fingerprint  # a head and a peer may hold one whole and one split
    assert list(ours.tensors) == names and len(ours.parts) == 3
    assert all(np.array_equal(ours.raw(n), g.raw(n)) for n in names)
    assert ours.nbytes == sum(p.stat().st_size for p in parts)


def test_reads_the_gguf_package_split_writer(tmp_path):
    """Another producer of split files: gguf-py's GGUFWriter(split_max_tensors=...)."""
    w = GGUFWriter(tmp_path / "py.gguf", "testarch", split_max_tensors=2)
    w.add_uint32("test.value", 7)
    arrays = {f"t{i}": np.arange(8 * (i + 1), dtype=np.float32) for i in range(5)}
    for name, a in arrays.items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    g = GGUFFile(tmp_path / "py-00001-of-00003.gguf")
    assert g.metadata["test.value"] == 7 and len(g.parts) == 3
    for name, a in arrays.items():
        assert g.raw(name).tobytes() == a.tobytes()


def test_a_stage_of_the_split_model_computes_what_the_whole_one_does(whole, parts):
    """The quantized-weight path (the GPU's, through the kernels' CPU reference) and a peer's layer
    range whose tensors lie in the second and third parts."""
    tokens, slots, pos = torch.tensor([1, 4, 2, 7, 3]), torch.zeros(5, dtype=torch.long), torch.arange(5)
    opts = dict(device="cpu", dtype="float32", int8=False, quantized=True, n_slots=1, n_ctx=16)
    a, b = build_stage(GGUFFile(whole), **opts), build_stage(GGUFFile(parts[0]), **opts)
    assert torch.equal(
        a.logits(a.run_layers(a.embed(tokens), slots, pos)), b.logits(b.run_layers(b.embed(tokens), slots, pos))
    )
    tail = dict(opts, embed=False, head=False)
    a, b = build_stage(GGUFFile(whole), (2, 3), **tail), build_stage(GGUFFile(parts[0]), (2, 3), **tail)
    h = torch.randn(5, SHAPE["n_embd"])
    assert torch.equal(a.run_layers(h, slots, pos), b.run_layers(h, slots, pos))


def test_console_estimate_reads_the_whole_split_model(whole, parts):
    workers = [WorkerMemory(device="cpu", dtype="float32")]
    assert ModelShape.from_gguf(parts[0]).estimate([3], 64, 1, workers) == ModelShape.from_gguf(whole).estimate(
        [3], 64, 1, workers
    )


def _copy(parts, tmp_path, count: int = 3):
    paths = [split_path(tmp_path / "m", i, count) for i in range(len(parts))]
    for src, dst in zip(parts, paths):
        dst.write_bytes(src.read_bytes())
    return paths


def _expect(path, *fragments: str) -> None:
    with pytest.raises(GGUFError) as e:
        GGUFFile(path)
    assert isinstance(e.value, UserError)
    for fragment in (str(path), *fragments):
        assert fragment in str(e.value)


def test_bad_splits_name_the_file(parts, tmp_path):
    paths = _copy(parts, tmp_path)
    _expect(paths[1], "is part 2 of 3", f"load its first part, {paths[0]}")
    renamed = tmp_path / "model.gguf"
    renamed.write_bytes(parts[0].read_bytes())
    _expect(renamed, "-00001-of-00003.gguf", "other parts cannot be found")

    paths[2].unlink()
    _expect(paths[0], str(paths[2]), "part 3 of 3", "No such file")

    paths[2].write_bytes(parts[1].read_bytes())  # part 2 where part 3 belongs
    _expect(paths[0], str(paths[2]), "not part 3 of 3", f"{SPLIT_NO} is 1")

    paths[2].write_bytes(parts[2].read_bytes())
    data = bytearray(parts[0].read_bytes())
    key = SPLIT_TENSORS_COUNT.encode()
    at = data.index(struct.pack("<Q", len(key)) + key) + 8 + len(key) + 4
    data[at : at + 4] = struct.pack("<i", 31)
    paths[0].write_bytes(bytes(data))
    _expect(paths[0], "declares 31 tensors", "its 3 parts hold 30")


def test_split_model_serves_what_the_whole_one_does(whole, parts, tmp_path):
    """Through real servers: the whole file, its 3 parts, and the parts across a head and a peer
    (each loading its layers from whichever part holds them) give the same greedy text and logprobs."""
    logs = tmp_path / "logs"
    logs.mkdir()
    f32 = ("--dtype", "float32")
    with running(head(whole, logs, (), *f32)) as w:
        want = [greedy(w, p) for p in PROMPTS]
    with running(head(parts[0], logs, (), *f32)) as w:
        assert [greedy(w, p) for p in PROMPTS] == want
        assert w.status()["model"]["fingerprint"] == GGUFFile(whole).fingerprint
    with running(peer(parts[0], logs, *f32)) as p, running(head(parts[0], logs, [p], "--split", "1/2", *f32)) as w:
        assert [greedy(w, prompt) for prompt in PROMPTS] == want
        assert [s["layers"] for s in w.status()["stages"]] == [[0, 1], [1, 3]]
