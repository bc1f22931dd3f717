"""contracts/footprint.py against what a built Stage really holds: its weights' storages
(`Stage.held_weight_bytes`) and its KV (`Stage.kv_bytes`), on tiny synthetic models of several
weight types and KV cache types, on CPU. The quantized (GPU) form is built on CPU too: its planes
are the same bytes on any device. (GPU against NVML: benchmarks/bench_memory.py.)"""

from __future__ import annotations

import pytest
import torch

from hydra_console.contracts.footprint import (
    CUBLAS_STREAMS,
    CUBLAS_WORKSPACE_BYTES,
    CUDA_RUNTIME_BYTES,
    GRAPH_POOL_FACTOR,
    KV_BLOCK,
    KV_VALUE_BYTES,
    QUANT_BLOCKS,
    ROLLBACK,
    model_tensors,
    rollback_depth,
    tensor_bytes,
)
from hydra_console.engine.gguf_file import GGUFFile
from hydra_console.engine.kernels.qweight import LAYOUTS, QuantWeight
from hydra_console.engine.model import build_stage
from hydra_console.engine.model.kv_cache import KVCache
from hydra_console.engine.pipeline import Pipeline
from hydra_console.engine.rpc.resident import StageHost
from hydra_console.engine.status import process_info

SHAPE = {"n_layers": 3, "n_embd": 256, "n_head": 4, "n_head_kv": 2, "n_ff": 512}
N_SLOTS, N_CTX = 2, 96


def served(stage, n: int = 24):
    """A prompt of more than 16 tokens through the stage, as any served one: a CPU int8 layer then
    keeps its bfloat16 prefill copy (the estimate counts it)."""
    h = stage.embed(torch.arange(n)) if stage.has_embed else torch.randn(n, stage.cfg.n_embd)
    h = stage.run_layers(h, torch.zeros(n, dtype=torch.long), torch.arange(n))
    if stage.has_head:
        stage.logits(h[-1:])
    return stage


CASES = [
    (arch, qtype, dtype, ("auto", "auto"))
    for arch, qtype in [
        ("llama", "F32"),
        ("llama", "F16"),
        ("llama", "Q8_0"),
        ("llama", "Q4_K_M"),
        ("gemma3", "Q4_0"),
        ("gemma3", "Q5_K"),
    ]
    for dtype in ("float32", "bfloat16")
]
CASES += [
    ("llama", "Q4_K_M", "bfloat16", ("q8_0", "q8_0")),
    ("gemma3", "Q5_K", "float32", ("f16", "q8_0")),
    ("llama", "F16", "bfloat16", ("f32", "bf16")),
    ("qwen35", "F32", "float32", ("auto", "auto")),
    ("qwen35", "Q8_0", "bfloat16", ("q8_0", "q8_0")),
]


@pytest.mark.parametrize("arch,qtype,dtype,kv_types", CASES)
def test_estimate_matches_a_built_cpu_stage(tiny_model, arch, qtype, dtype, kv_types):
    g = GGUFFile(tiny_model(arch, qtype=qtype, **SHAPE))
    tensors = model_tensors(g.metadata, g.tensors)
    # A head alone, a peer's range; split by `--output-stage last`: the head's embedding and layers,
    # the last peer's layers and output head.
    for layers, head, output in (
        ((0, 3), True, True),
        ((1, 3), False, False),
        ((0, 1), True, False),
        ((1, 3), False, True),
    ):
        stage = served(
            build_stage(
                g,
                layers,
                embed=head,
                head=output,
                device="cpu",
                dtype=dtype,
                n_slots=N_SLOTS,
                n_ctx=N_CTX,
                kv_types=kv_types,
            )
        )
        est = tensors.stage(
            *layers,
            head=head,
            output=output,
            device="cpu",
            dtype=dtype,
            n_slots=N_SLOTS,
            n_ctx=N_CTX,
            kv_types=kv_types,
        )
        assert est.weight_bytes == pytest.approx(stage.held_weight_bytes, rel=0.05)
        assert est.kv_bytes == pytest.approx(stage.kv_bytes, rel=0.05) and est.kv_bytes > 0


@pytest.mark.parametrize("arch", ["llama", "qwen35"])
def test_estimate_of_a_kv_pool_matches_a_built_stage(tiny_model, arch):
    """`--kv-unified`: the pool's blocks (block 0 included) instead of every slot's context."""
    g = GGUFFile(tiny_model(arch, **SHAPE))
    pool = 3 * KV_BLOCK - 5
    stage = build_stage(g, device="cpu", dtype="float32", n_slots=4, n_ctx=2 * KV_BLOCK, kv_pool=pool)
    est = model_tensors(g.metadata, g.tensors).stage(
        0, 3, head=True, device="cpu", dtype="float32", n_slots=4, n_ctx=2 * KV_BLOCK, kv_pool=pool
    )
    assert est.kv_bytes == stage.kv_bytes


@pytest.mark.parametrize("qtype", ["Q4_0", "Q5_1", "Q8_0", "Q4_K_M", "Q5_K", "Q6_K"])
def test_quantized_form_matches_a_stage_that_keeps_gguf_blocks(tiny_model, qtype):
    """The GPU's form (weights kept in their GGUF blocks), built on CPU: the layers and the output
    head (the embedding table is held only on a GPU; bench_memory.py covers it there)."""
    g = GGUFFile(tiny_model("llama", qtype=qtype, **SHAPE))
    tensors = model_tensors(g.metadata, g.tensors)
    stage = served(
        build_stage(
            g, embed=False, head=True, device="cpu", dtype="bfloat16", quantized=True, n_slots=N_SLOTS, n_ctx=N_CTX
        )
    )
    dense = served(
        build_stage(
            g,
            embed=False,
            head=True,
            device="cpu",
            dtype="bfloat16",
            quantized=False,
            int8=False,
            n_slots=N_SLOTS,
            n_ctx=N_CTX,
        )
    )
    rope = 16 * N_CTX * tensors.n_rot
    vectors = sum(tensor_bytes(t, "quantized") for t in tensors.head_vectors)
    for form, built in (("quantized", stage), ("dense", dense)):
        head = tensor_bytes(tensors.output or tensors.embedding, form, "bfloat16", output_head=True)
        est = sum(tensors.layer_weights(il, form, "bfloat16") for il in range(tensors.n_layers)) + head + vectors + rope
        assert est == pytest.approx(built.held_weight_bytes, rel=0.05), form
    assert stage.held_weight_bytes < dense.held_weight_bytes * 0.6  # Q8_0: 34 bytes per 32 weights, bf16 64


@pytest.mark.unit
@pytest.mark.parametrize("qtype", list(QUANT_BLOCKS))
def test_quant_blocks_are_the_repacked_planes(qtype):
    """QUANT_BLOCKS' bytes per block are what QuantWeight's planes take: the file's, for every type."""
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.constants import GGMLQuantizationType as T

    block, type_size = GGML_QUANT_SIZES[T[qtype]]
    n, k = 4, 2 * 256
    raw = torch.zeros(n * k // block * type_size, dtype=torch.uint8)
    assert (
        QuantWeight.from_gguf(raw, T[qtype], (n, k)).nbytes == n * k // QUANT_BLOCKS[qtype][0] * QUANT_BLOCKS[qtype][1]
    )


@pytest.mark.unit
def test_every_gpu_layout_has_its_block_bytes():
    assert {t.name for t in LAYOUTS} == set(QUANT_BLOCKS)


@pytest.mark.unit
def test_kv_value_bytes_are_the_caches():
    for kind, size in KV_VALUE_BYTES.items():
        assert KVCache.bytes_per_value(kind, torch.bfloat16) == size


def test_peer_footprint_and_status_report_held_bytes(tiny_model):
    """LOAD_STAGE's size check and PROBE's budget (StageHost.layer_footprint) count the contract's
    bytes; /status's stage entry carries the held weights and KV, its process entry the peaks."""
    g = GGUFFile(tiny_model("llama", qtype="Q8_0", **SHAPE))
    stage = served(
        build_stage(
            g,
            (1, 3),
            embed=False,
            head=False,
            device="cpu",
            dtype="bfloat16",
            n_slots=N_SLOTS,
            n_ctx=N_CTX,
            kv_types=("q8_0", "f16"),
        )
    )
    host = StageHost(g, stage.cfg, "cpu", kv_types=("q8_0", "f16"))
    rope = 16 * N_CTX * model_tensors(g.metadata, g.tensors).n_rot
    assert host.stage_bytes(1, 3, torch.bfloat16, N_SLOTS, N_CTX, None, ("auto", "auto")) + rope == pytest.approx(
        stage.held_weight_bytes + stage.kv_bytes, rel=0.05
    )
    head = served(build_stage(g, device="cpu", dtype="bfloat16", n_slots=N_SLOTS, n_ctx=N_CTX))
    (info,) = Pipeline(head).stages()
    assert (info.weight_bytes, info.kv_bytes) == (head.held_weight_bytes, head.kv_bytes)
    proc = process_info()
    assert proc.peak_rss >= proc.rss > 0


@pytest.mark.parametrize("arch,qtype", [("llama", "Q4_K_M"), ("llama", "Q8_0"), ("gemma3", "Q5_K"), ("qwen35", "Q8_0")])
def test_scratch_estimate_is_what_the_stage_registers(tiny_model, arch, qtype):
    """The prefill's dequantization scratch (GPU work memory) from the tensor table: the largest
    matrix as the model joins them (q+k of one type apart from a Q6_K v; gate+up; DeltaNet's input
    product) and the output head, equal to what the built quantized stage sizes its scratch to."""
    g = GGUFFile(tiny_model(arch, qtype=qtype, **SHAPE))
    tensors = model_tensors(g.metadata, g.tensors)
    for layers, head in (((0, 3), True), ((1, 3), False)):
        stage = build_stage(
            g,
            layers,
            embed=head,
            head=head,
            device="cpu",
            dtype="bfloat16",
            quantized=True,
            n_slots=N_SLOTS,
            n_ctx=N_CTX,
        )
        assert tensors.scratch_bytes(*layers, output=head, dtype="bfloat16") == 2 * stage.weights.scratch.need > 0


def test_a_gpu_estimate_adds_work_memory_and_the_runtime(tiny_model):
    """On CUDA the estimate is what NVML reads for the process: held bytes + work (scratch, cuBLAS
    workspaces, the graphs' pool) + the CUDA runtime; a CPU worker has none of those."""
    g = GGUFFile(tiny_model("llama", qtype="Q4_K_M", **SHAPE))
    tensors = model_tensors(g.metadata, g.tensors)
    kw = dict(head=True, dtype="bfloat16", n_slots=N_SLOTS, n_ctx=N_CTX)
    cpu, gpu = tensors.stage(0, 3, device="cpu", **kw), tensors.stage(0, 3, device="cuda", **kw)
    assert cpu.work_bytes == cpu.runtime_bytes == 0 and cpu.total == cpu.weight_bytes + cpu.kv_bytes
    graphs = tensors.graph_bytes(0, 3, output=True, n_slots=N_SLOTS, n_ctx=N_CTX, prompt_rows=512)
    assert (
        gpu.work_bytes
        == tensors.scratch_bytes(0, 3, output=True, dtype="bfloat16") + CUBLAS_WORKSPACE_BYTES * CUBLAS_STREAMS + graphs
    )
    assert gpu.runtime_bytes == CUDA_RUNTIME_BYTES
    assert gpu.total == gpu.weight_bytes + gpu.kv_bytes + gpu.work_bytes + gpu.runtime_bytes
    # The largest prefill graph: 512 rows, or the largest power of two in a shorter context (96 → 64).
    d, ff = SHAPE["n_embd"], SHAPE["n_ff"]
    logits = 4 * N_SLOTS * tensors.embedding.shape[0]
    assert graphs == GRAPH_POOL_FACTOR * 64 * (16 * d + 6 * ff) + logits
    dense = tensors.stage(0, 3, device="cuda", gpu_weights="dense", **kw)
    assert dense.work_bytes == gpu.work_bytes - tensors.scratch_bytes(0, 3, output=True, dtype="bfloat16")


def test_a_models_mtp_block_is_outside_the_split_and_counted_on_a_drafting_head(tiny_model):
    """qwen35's NextN block is in block_count after the trunk: splits cover the trunk only, and a
    head that drafts with it (`--spec-type mtp`) holds its weights and KV too."""
    g = GGUFFile(tiny_model("qwen35", n_layers=4, nextn=True))
    t = model_tensors(g.metadata, g.tensors)
    assert t.n_layers == 4 and t.mtp_layers == [4]
    kw = dict(head=True, device="cuda", dtype="bfloat16", n_slots=2, n_ctx=64, kv_types=("q8_0", "q8_0"))
    plain, drafting = t.stage(0, 2, **kw), t.stage(0, 2, mtp=True, **kw)
    assert drafting.weight_bytes - plain.weight_bytes == t.layer_weights(4, "quantized", "bfloat16") > 0
    assert drafting.kv_bytes - plain.kv_bytes == t.layer_cache(4, 2, 64, ("q8_0", "q8_0"), "bfloat16", gpu=True) > 0
    assert t.stage(2, 4, **{**kw, "head": False}, mtp=True) == t.stage(2, 4, **{**kw, "head": False})  # a peer: never


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_output_head_on_the_last_stage_moves_bytes_and_creates_none(tiny_model, device):
    """`--output-stage last`: the output norm and head, their logits rows and the MTP block with its KV
    leave the head for the last peer. Weights, KV, the graphs' pools (the logits rows among them), the
    cuBLAS workspaces and the runtime sum to the same bytes over head + peer either way; only the
    dequantization scratch differs, each stage's largest matrix rather than a sum (the output head's
    joins the other stage's candidates). An untied quantized embedding stays in pinned host memory."""
    g = GGUFFile(tiny_model("qwen35", **{**SHAPE, "n_layers": 4}, nextn=True, qtype="Q8_0"))
    t = model_tensors(g.metadata, g.tensors)
    assert t.output is not None  # untied
    kw = dict(device=device, dtype="bfloat16", n_slots=2, n_ctx=64, kv_types=("q8_0", "q8_0"), mtp=True)
    on_head = [t.stage(0, 2, head=True, **kw), t.stage(2, 4, head=False, **kw)]
    on_last = [t.stage(0, 2, head=True, output=False, **kw), t.stage(2, 4, head=False, output=True, **kw)]
    assert on_head == [t.stage(0, 2, head=True, output=True, **kw), t.stage(2, 4, head=False, output=False, **kw)]
    for part in ("weight_bytes", "kv_bytes", "runtime_bytes"):
        assert sum(getattr(s, part) for s in on_head) == sum(getattr(s, part) for s in on_last)
    scratch = (
        [t.scratch_bytes(0, 2, output=True), t.scratch_bytes(2, 4)],
        [t.scratch_bytes(0, 2), t.scratch_bytes(2, 4, output=True)],
    )
    if device == "cuda":
        assert sum(s.work_bytes for s in on_head) - sum(scratch[0]) == sum(s.work_bytes for s in on_last) - sum(
            scratch[1]
        )
        assert (
            on_last[1].work_bytes - on_head[1].work_bytes - scratch[1][1] + scratch[0][1] == 4 * 2 * t.output.shape[0]
        )
    else:
        assert all(s.work_bytes == 0 for s in on_head + on_last)
    # What moves: the output norm and head, the MTP block's weights and its KV.
    form = "quantized" if device == "cuda" else "int8"
    moved = t.output_weights(form, "bfloat16") + t.layer_weights(4, form, "bfloat16")
    assert (
        on_head[0].weight_bytes - on_last[0].weight_bytes == moved == on_last[1].weight_bytes - on_head[1].weight_bytes
    )
    mtp_kv = t.layer_cache(4, 2, 64, ("q8_0", "q8_0"), "bfloat16", gpu=device == "cuda")
    assert on_head[0].kv_bytes - on_last[0].kv_bytes == mtp_kv > 0
    # bench_fit's table: the same bytes by what holds them, each where the stage holds it.
    for stage in on_head + on_last:
        assert sum(stage.parts.values()) == stage.total
    assert on_last[1].parts["output head"] == on_head[0].parts["output head"] == t.output_weights(form, "bfloat16")
    assert on_last[0].parts["output head"] == on_last[0].parts["MTP block"] == on_last[0].parts["MTP block's KV"] == 0
    assert (
        on_last[1].parts["MTP block's KV"] == mtp_kv
        and on_last[1].parts["MTP block"] == moved - on_last[1].parts["output head"]
    )
    # A tied quantized table is the output head's matrix: the head keeps it for the lookup and the last
    # stage holds it as its output head, two copies (the one case where moving creates bytes).
    g = GGUFFile(tiny_model("gemma3", **{**SHAPE, "n_layers": 4}, qtype="Q4_K_M"))
    t = model_tensors(g.metadata, g.tensors)
    assert t.output is None
    head, last = t.stage(0, 2, head=True, output=False, **kw), t.stage(2, 4, head=False, output=True, **kw)
    both = t.stage(0, 2, head=True, **kw).weight_bytes + t.stage(2, 4, head=False, **kw).weight_bytes
    copy = tensor_bytes(t.embedding, form, "bfloat16") if device == "cuda" else 0
    assert head.weight_bytes + last.weight_bytes - both == copy


def test_recurrent_checkpoints_follow_the_longest_draft(tiny_model):
    """A recurrent stage keeps `depth` checkpoints of each state (the head's --draft-max; 1 without
    speculation), and the estimate counts exactly what it holds."""
    g = GGUFFile(tiny_model("qwen35", **SHAPE))
    tensors = model_tensors(g.metadata, g.tensors)
    assert rollback_depth(1) == 1 and rollback_depth(4) == 3 and rollback_depth(64) == ROLLBACK
    held = {}
    for depth in (1, 3, ROLLBACK):
        stage = build_stage(g, device="cpu", dtype="float32", n_slots=2, n_ctx=32, depth=depth)
        est = tensors.stage(0, 3, head=True, device="cpu", dtype="float32", n_slots=2, n_ctx=32, depth=depth)
        assert est.kv_bytes == stage.kv_bytes
        held[depth] = stage.kv_bytes
    per_copy = sum(tensors.layer_state(il, 2, 0) for il in range(3))
    assert per_copy > 0 and held[ROLLBACK] - held[3] == per_copy and held[3] - held[1] == 2 * per_copy
