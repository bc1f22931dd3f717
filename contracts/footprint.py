"""What a worker holds in memory for a stage, from the GGUF tensor table alone (no torch, no tensor
data): declared once, so the engine's LOAD_STAGE size check and PROBE budget and the console's
split editor count the same bytes. tests/test_footprint.py holds it to a built Stage's tensors.

Weight forms (engine/model/weights.py):
- `quantized` (a GPU, `--gpu-weights quantized`): a block type with a GPU kernel keeps its bits,
  repacked into planes (engine/kernels/qweight.py): the file's bytes. Other types are dense.
- `int8` (CPU with 16-bit compute): every matrix is int8 rows with a bfloat16 scale per row, in
  two terms (a layer) or one (the output head); a layer's matrix also keeps the bfloat16 copy it
  builds on its first many-row product (prefill), which any served prompt triggers.
- `dense`: the compute dtype (a CPU at float32, a GPU with `--gpu-weights dense`).
Vectors (norms, biases) are float32. The first stage holds the token embedding: on a GPU when it is
dense or tied (quantized, one copy where that stage holds the tied output head too; a quantized
untied one stays in pinned host memory); on a CPU its rows are read from the file's mmap as needed.
The output stage (the head's, or the last peer's with `--output-stage last`) holds the output norm
and head, their logits rows and, with `--spec-type mtp`, the MTP block and its KV.
KV: K and V of every attention layer for every cache position (`cache_positions`: every slot at
full context, or the `--kv-unified` pool in blocks), in the cache types of `--cache-type-k/-v`
(a CUDA stage without a pool keeps ROLLBACK more positions per slot, where the decode graphs'
padding rows write). Recurrent (Gated DeltaNet) layers hold float32 conv + SSM state per slot
with `depth` checkpoints, and on a CUDA stage one row for the padding slot (engine/model/deltanet.py). RoPE: cos and
sin tables (float32, full context) for the global and the sliding-window base.

Work memory (a CUDA stage, `StageBytes.work_bytes`): the prefill's dequantization scratch (exact:
the largest block `block_rows` gives any quantized matrix, fused as the model fuses them), the
cuBLAS workspace of each stream that runs GEMMs, and the CUDA graphs' pool: a prompt chunk's live
activations in the FFN (the largest prefill graph, `--batch-size` rows) times the pool's measured
overhead, and the output head's logits for every decode row. A CUDA process also takes its context
and the kernels it loads, outside the allocator (`StageBytes.runtime_bytes`), so that weights + KV
+ work + runtime is what NVML reads for the process (`benchmarks/bench_memory.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
AUTO_DTYPE = "bfloat16"  # `--dtype auto` on every device (engine/device.py)
# Bytes per cached value of each `--cache-type-k/-v` (q8_0: an int8 code + a float16 scale per 32);
# "auto" is the compute dtype. engine/model/kv_cache.py `KVCache.bytes_per_value` stores these.
KV_VALUE_BYTES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 1 + 2 / 32}
CACHE_TYPES = ("auto", *KV_VALUE_BYTES)  # --cache-type-k/-v (engine/config.py KV_CACHE_TYPES)
# Device bytes of a block kept quantized: (weights per block, bytes per block).
QUANT_BLOCKS = {
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
    "Q8_0": (32, 34),
    "Q4_K": (256, 144),
    "Q5_K": (256, 176),
    "Q6_K": (256, 210),
}
# The prefill's dequantization scratch (engine/kernels/qlinear.py DequantScratch): a matrix up to this
# many elements is dequantized whole, a larger one in equal blocks of whole BLOCK_ROWS-row tiles.
SCRATCH_ELEMENTS = 64 << 20  # 128 MiB of bfloat16: a 7.2B's gate+up (235 MB dense) runs in two blocks
BLOCK_ROWS = 256
# cuBLAS's workspace per stream, for the process's life: the compute stream and the one capture
# stream of the graphs (engine/model/graphs.py). Workers set it (engine/config.py cuda_env) below
# torch's 32 MiB on Hopper: 68 MiB less per process on the 7.2B Q4_K_M, prefill and an F16 model's
# decode unchanged (docs/PERF.md, session 12).
CUBLAS_WORKSPACE_BYTES, CUBLAS_STREAMS = 8 << 20, 2
# The graphs' pool against a prompt chunk's live FFN bytes: 1.7x on the 7.2B Q4_K_M, 1.8x on the
# 26B-wide Q5_K (H200, `memory_phases.py --history`, session 11): the caching allocator rounds
# blocks of 1-10 MB up into 20 MB segments, and attention's buffers come and go beside them.
GRAPH_POOL_FACTOR = 2
# A CUDA process outside its tensors: the context (0.54 GB on the H200, driver 12.x) and the kernels
# a worker loads (cuBLAS, Triton, inductor: ~0.25 GB more, read as NVML minus torch's reservation on
# three shapes). Another GPU or driver differs by a few hundred MB.
CUDA_RUNTIME_BYTES = 800_000_000
DEFAULT_PROMPT_ROWS = 512  # `--batch-size` on a GPU (engine/config.py DEFAULT_BATCH_TOKENS_GPU)
KV_BLOCK = 128  # positions per block of a `--kv-unified` pool (engine/model/kv_blocks.py)
# Positions a recurrent layer's state can be taken back (a rejected draft): the longest draft a
# recurrent model verifies. Each costs a copy of the state per slot and layer.
ROLLBACK = 4
# A recurrent stage's packed graphs (engine/model/graphs.py `PackedGraphs`): steps of up to PACKED_RUNS
# runs and PACKED_TOKENS tokens in all, the recurrent kernels' buffers for every run padded to the
# bucket; a recurrent stage's largest graphs (it has no prefill graphs).
PACKED_TOKENS, PACKED_RUNS = 128, 4
# A slot state's header beyond its tensors: magic, version, fingerprint, dtype (STATE_HEADER_FIXED),
# each token id as text (STATE_ID_BYTES, with its separator), each tensor's entry (STATE_ENTRY_BYTES).
STATE_HEADER_FIXED, STATE_ID_BYTES, STATE_ENTRY_BYTES = 4096, 12, 256
_HEAD_TERMS, _LAYER_TERMS = 1, 2  # int8 terms of the output head and of a layer's matrices


def rollback_depth(max_run: int) -> int:
    """Positions a recurrent state must be able to go back for steps of at most `max_run` tokens per
    slot (a speculative verify keeps at least its first token); at least one checkpoint, so no
    kernel meets an empty one."""
    return min(max(max_run - 1, 1), ROLLBACK)


def compute_dtype(dtype: str) -> str:
    """A `--dtype` value as a name in DTYPE_BYTES (auto → bfloat16)."""
    return AUTO_DTYPE if dtype in ("", "auto") else dtype


def weight_form(device: str, dtype: str = "auto", gpu_weights: str = "quantized") -> str:
    """The form of a worker's weights on `device` ("cpu", "cuda", "cuda:1")."""
    if device.startswith("cuda"):
        return "quantized" if gpu_weights == "quantized" else "dense"
    return "dense" if compute_dtype(dtype) == "float32" else "int8"


def kv_value_bytes(kind: str, dtype: str = "auto") -> float:
    return KV_VALUE_BYTES[kind] if kind in KV_VALUE_BYTES else float(DTYPE_BYTES[compute_dtype(dtype)])


@dataclass(frozen=True)
class Tensor:
    """One GGUF tensor as the footprint needs it: its type name and torch-order shape."""

    name: str
    type_name: str
    shape: tuple[int, ...]

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)


def cache_positions(n_slots: int, n_ctx: int, kv_pool: int | None = None, *, padding: bool = False) -> int:
    """Positions one attention layer's cache holds: every slot's context (+ ROLLBACK past each, where
    the CUDA graphs' padding rows write: model/kv_blocks.py), or the pool in whole blocks plus block 0."""
    if kv_pool is None:
        return n_slots * (n_ctx + ROLLBACK * padding)
    return (-(-kv_pool // KV_BLOCK) + 1) * KV_BLOCK


def tensor_bytes(t: Tensor, form: str, dtype: str = "auto", *, output_head: bool = False) -> int:
    """Bytes tensor `t` takes on its worker in `form`: a 1-D tensor is a float32 vector, a 2-D one a matrix."""
    size = DTYPE_BYTES[compute_dtype(dtype)]
    if len(t.shape) < 2:
        return 4 * t.n_elements
    if form == "quantized" and t.type_name in QUANT_BLOCKS:
        block, nbytes = QUANT_BLOCKS[t.type_name]
        return t.n_elements // block * nbytes
    if form == "int8":
        rows = t.shape[0]
        terms = _HEAD_TERMS if output_head else _LAYER_TERMS
        prefill_copy = 2 * t.n_elements if terms > 1 else 0
        return terms * (t.n_elements + 2 * rows) + prefill_copy
    return t.n_elements * size


def block_rows(n: int, k: int, capacity: int) -> int:
    """Rows of an [n, k] weight dequantized at a time into a scratch of `capacity` elements: all of
    them if they fit, else as few blocks as fit, of equal rows, whole tiles where the scratch allows
    (ragged blocks ran the GEMM slower); 0 where not one row fits."""
    if n * k <= capacity:
        return n
    fit = capacity // k  # rows the scratch holds
    if not fit:
        return 0
    step = -(-n // -(-n // fit))
    return min(fit, -(-step // BLOCK_ROWS) * BLOCK_ROWS) if fit >= BLOCK_ROWS else step


@dataclass(frozen=True)
class StageBytes:
    layers: tuple[int, int]
    weight_bytes: int  # every weight the stage holds (RoPE tables included)
    kv_bytes: int  # K and V for all cache rows at full context
    work_bytes: int = 0  # a CUDA stage's scratch, cuBLAS workspaces and graphs' pool
    runtime_bytes: int = 0  # a CUDA process's context and loaded kernels
    # the same bytes by what holds them (layers, token embedding, output head, MTP block, KV, recurrent
    # state and checkpoints, the MTP block's KV, scratch, graphs' pool, ...): bench_fit's table
    parts: dict[str, int] = field(default_factory=dict, compare=False)

    @property
    def total(self) -> int:
        """What the worker's process takes for the stage (NVML's reading, on a GPU)."""
        return self.weight_bytes + self.kv_bytes + self.work_bytes + self.runtime_bytes


@dataclass(frozen=True)
class ModelTensors:
    """The tensor table and shape numbers a footprint needs (`from_gguf_table` builds it)."""

    n_layers: int  # the trunk's: what a split divides
    layers: tuple[tuple[Tensor, ...], ...]  # each layer's tensors, the MTP blocks after the trunk's
    embedding: Tensor | None
    output: Tensor | None  # None: tied to the embedding
    head_vectors: tuple[Tensor, ...]  # the output norm
    kv_values_per_token_layer: tuple[int, int]  # K and V values of one token in one attention layer
    n_rot: int
    attention_layers: tuple[bool, ...]  # False: a recurrent layer (no KV)
    state_values: int = 0  # float32 values of a recurrent layer's state per slot: conv + SSM
    deltanet: tuple[int, int, int] = (0, 0, 0)  # a recurrent layer's conv channels, state size, inner size

    @property
    def mtp_layers(self) -> list[int]:
        """The MTP (NextN) blocks' layer indices, after the trunk's (qwen35: one)."""
        return list(range(self.n_layers, len(self.layers)))

    def layer_weights(self, il: int, form: str, dtype: str = "auto") -> int:
        return sum(tensor_bytes(t, form, dtype) for t in self.layers[il])

    def layer_kv(self, il: int, positions: int, kv_types: tuple[str, str], dtype: str = "auto") -> int:
        """K and V of `positions` cache positions (`cache_positions`) of an attention layer."""
        if not self.attention_layers[il]:
            return 0
        k, v = self.kv_values_per_token_layer
        per_token = k * kv_value_bytes(kv_types[0], dtype) + v * kv_value_bytes(kv_types[1], dtype)
        return int(positions * per_token)

    def layer_state(self, il: int, n_slots: int, depth: int = ROLLBACK, *, padding: bool = False) -> int:
        """A recurrent layer's state for `n_slots` slots: the state and its `depth` checkpoints (the
        longest draft verified, at most ROLLBACK: `rollback_depth`), and with `padding` (a CUDA
        stage) one row for the graphs' padding slot (engine/model/deltanet.py)."""
        return 0 if self.attention_layers[il] else (n_slots * (depth + 1) + padding) * self.state_values * 4

    def slot_state_bound(self, ranges, n_tokens: int) -> int:
        """The most bytes the slot states of `ranges` (one per stage, contracts/slot_state.py) over
        n_tokens may take: K and V as float32 (every cache type stores less), each recurrent
        layer's state, an MTP block after the last layer (its K, V and hidden rows), each header's
        token ids, names and chunk table. A head refuses a worker's reply announcing more."""
        k, v = self.kv_values_per_token_layer
        n_embd = self.embedding.shape[-1] if self.embedding is not None else 0
        total = 0
        for a, b in ranges:
            body = sum(
                n_tokens * (k + v) * 4 if self.attention_layers[il] else self.state_values * 4 for il in range(a, b)
            )
            if b == self.n_layers:
                body += n_tokens * (k + v + n_embd) * 4
            header = STATE_HEADER_FIXED + STATE_ID_BYTES * n_tokens + STATE_ENTRY_BYTES * (b - a + 3)
            total += header + body + 4 * (body // (1 << 20) + 1) + 64 * (b - a + 3)
        return total

    def layer_cache(
        self,
        il: int,
        n_slots: int,
        n_ctx: int,
        kv_types: tuple[str, str],
        dtype: str = "auto",
        *,
        gpu: bool,
        kv_pool: int | None = None,
        depth: int = ROLLBACK,
    ) -> int:
        """What a layer caches per stage: its KV (or pool share) or its recurrent state, all slots."""
        positions = cache_positions(n_slots, n_ctx, kv_pool, padding=gpu)
        return self.layer_kv(il, positions, kv_types, dtype) + self.layer_state(il, n_slots, depth, padding=gpu)

    def embedding_weights(self, form: str, dtype: str = "auto", *, gpu: bool, with_output: bool) -> int:
        """The token embedding on the first stage: held on a GPU only when it is dense or tied (a
        quantized tied one is the output head's matrix: one copy where `with_output` holds that
        too); a quantized untied one stays in pinned host memory; a CPU reads its rows from the mmap."""
        e = self.embedding
        if not gpu or e is None:
            return 0
        if form == "quantized" and e.type_name in QUANT_BLOCKS and (self.output is not None or with_output):
            return 0
        return tensor_bytes(e, form, dtype)

    def output_weights(self, form: str, dtype: str = "auto") -> int:
        """The output stage's own tensors: the output norm and the output head (the embedding when tied)."""
        head = self.output or self.embedding
        norm = sum(tensor_bytes(t, form, dtype) for t in self.head_vectors)
        return norm + tensor_bytes(head, form, dtype, output_head=True)

    def stage(
        self,
        a: int,
        b: int,
        *,
        head: bool,
        output: bool | None = None,
        device: str,
        dtype: str,
        n_slots: int,
        n_ctx: int,
        kv_types: tuple[str, str] = ("auto", "auto"),
        gpu_weights: str = "quantized",
        kv_pool: int | None = None,
        prompt_rows: int = DEFAULT_PROMPT_ROWS,
        mtp: bool = False,
        depth: int = ROLLBACK,
    ) -> StageBytes:
        """Layers [a, b) (+ the token embedding when `head`: the first stage; + the output norm and
        head when `output`, None: as `head` (the head's `--output-stage head`); and with them the MTP
        block with its KV when `mtp`: `--spec-type mtp`) as a worker on `device` ("cpu", "cuda")
        with `--dtype`, `--gpu-weights`, `--cache-type-k/-v` holds them for `n_slots` slots of `n_ctx`
        (or a `--kv-unified` pool of `kv_pool` positions); `prompt_rows`: `--batch-size`."""
        output = head if output is None else output
        gpu = device.startswith("cuda")
        form = weight_form(device, dtype, gpu_weights)
        mtp_layers = self.mtp_layers if output and mtp else []  # the MTP block needs the output head

        def cache(layers, attention: bool) -> int:
            return sum(
                self.layer_cache(il, n_slots, n_ctx, kv_types, dtype, gpu=gpu, kv_pool=kv_pool, depth=depth)
                for il in layers
                if self.attention_layers[il] == attention
            )

        weights = {
            "layers": sum(self.layer_weights(il, form, dtype) for il in range(a, b)),
            "token embedding": self.embedding_weights(form, dtype, gpu=gpu, with_output=output) if head else 0,
            "output head": self.output_weights(form, dtype) if output else 0,
            "MTP block": sum(self.layer_weights(il, form, dtype) for il in mtp_layers),
            "RoPE tables": 4 * 4 * n_ctx * self.n_rot,  # cos and sin for two bases, float32
        }
        kv = {
            "KV": cache(range(a, b), True),
            "recurrent state and checkpoints": cache(range(a, b), False),
            "MTP block's KV": cache(mtp_layers, True),
        }
        if not gpu:
            return StageBytes((a, b), sum(weights.values()), sum(kv.values()), parts=weights | kv)
        work = {
            "scratch": self.scratch_bytes(a, b, output=output, dtype=dtype) if form == "quantized" else 0,
            "cuBLAS workspaces": CUBLAS_WORKSPACE_BYTES * CUBLAS_STREAMS,
            "graphs' pool": self.graph_bytes(
                a, b, output=output, n_slots=n_slots, n_ctx=n_ctx, prompt_rows=prompt_rows, depth=depth
            ),
        }
        parts = weights | kv | work | {"CUDA context and kernels": CUDA_RUNTIME_BYTES}
        return StageBytes(
            (a, b), sum(weights.values()), sum(kv.values()), sum(work.values()), CUDA_RUNTIME_BYTES, parts
        )

    def scratch_bytes(self, a: int, b: int, *, output: bool = False, dtype: str = "auto") -> int:
        """The prefill's dequantization scratch: the largest block of any quantized matrix of the
        stage (the output head's where `output`), with neighbouring parts of one type joined as the
        model joins them (q+k+v, gate+up)."""
        matrices = [m for il in range(a, b) for m in _joined(self.layers[il])]
        out = self.output or self.embedding
        if output and out is not None:
            matrices.append(out)
        blocks = [
            block_rows(t.shape[0], t.shape[1], SCRATCH_ELEMENTS) * t.shape[1]
            for t in matrices
            if t.type_name in QUANT_BLOCKS and len(t.shape) == 2
        ]
        return max(blocks, default=0) * DTYPE_BYTES[compute_dtype(dtype)]

    def graph_bytes(
        self,
        a: int,
        b: int,
        *,
        output: bool = False,
        n_slots: int,
        n_ctx: int,
        prompt_rows: int,
        depth: int = ROLLBACK,
    ) -> int:
        """The CUDA graphs' pool: the largest graph's live bytes times the pool's measured overhead;
        and, where `output`, the float32 logits for every decode row. The largest graph: a prompt
        chunk's FFN (the float32 residual, its sum and the norm; the 16-bit input and output; gate+up
        and the activation: the largest prefill graph, and on a recurrent stage, which has none, what
        the term held where NVML was measured, docs/PERF.md session 22), or a recurrent stage's largest
        packed step, whose recurrent kernels hold per padded token the conv outputs and three float32
        rows a V head (w, u, U) and per run the states of its chunks, checkpoints and the final one."""
        ff = max(
            (t.shape[0] for il in range(a, b) for t in self.layers[il] if t.name.endswith("ffn_up.weight")), default=0
        )
        d = self.embedding.shape[1] if self.embedding is not None else 0
        # The largest prefill graph's rows: powers of two from 8 up to the context (engine/model/graphs.py).
        rows = max(8, 1 << (prompt_rows - 1).bit_length())
        rows = rows if rows <= n_ctx else 1 << (n_ctx.bit_length() - 1)
        live = rows * (3 * 4 * d + 2 * 2 * d + 3 * 2 * ff)
        if not all(self.attention_layers[a:b]):
            channels, d_state, inner = self.deltanet
            runs, tokens = min(n_slots, PACKED_RUNS), min(PACKED_TOKENS, rows)
            states = runs * (-(-tokens // 64) + depth + 2) * d_state * inner
            live = max(live, 4 * (runs * tokens * (channels + 3 * inner) + states))
        out = self.output or self.embedding
        logits = 4 * n_slots * out.shape[0] if output and out is not None else 0
        return GRAPH_POOL_FACTOR * live + logits


_JOINED = (("attn_q", "attn_k", "attn_v"), ("ffn_gate", "ffn_up"), ("attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha"))


def _joined(layer: tuple[Tensor, ...]) -> list[Tensor]:
    """A layer's matrices as the model multiplies them: each of `_JOINED`'s groups in runs of one type
    joined into one matrix (engine/model/weights.py `Weights._joined`), the others alone."""
    by_part = {t.name.split(".")[-2]: t for t in layer if len(t.shape) == 2}
    out = [t for part, t in by_part.items() if not any(part in group for group in _JOINED)]
    for group in _JOINED:
        run: list[Tensor] = []
        for t in [by_part[p] for p in group if p in by_part] + [None]:
            if run and (t is None or t.type_name != run[0].type_name):
                rows = sum(r.shape[0] for r in run)
                out.append(Tensor(run[0].name, run[0].type_name, (rows, run[0].shape[1])))
                run = []
            if t is not None:
                run.append(t)
    return out


_VECTOR_MATRICES = (".ssm_conv1d.weight",)  # 2-D in the file, held as a float32 vector
_HEAD_TENSORS = ("token_embd.weight", "output.weight", "output_norm.weight")


def model_tensors(metadata, tensors) -> ModelTensors:
    """From a GGUF's metadata {key: value} and tensor table {name: info with `.ggml_type.name` and
    torch-order `.shape`} (engine/gguf_file.GGUFFile's `.metadata` and `.tensors`)."""
    arch = metadata["general.architecture"]
    blocks = int(metadata.get(f"{arch}.block_count", 0))
    # An MTP (NextN) block is counted in block_count after the trunk: split over the trunk only.
    n_layers = blocks - int(metadata.get(f"{arch}.nextn_predict_layers", 0))
    n_head = int(metadata.get(f"{arch}.attention.head_count", 1))
    n_embd = int(metadata.get(f"{arch}.embedding_length", 0))
    n_kv = metadata.get(f"{arch}.attention.head_count_kv", n_head)
    n_kv = int(max(n_kv) if isinstance(n_kv, (list, tuple)) else n_kv)
    k_len = int(metadata.get(f"{arch}.attention.key_length", n_embd // max(n_head, 1)))
    v_len = int(metadata.get(f"{arch}.attention.value_length", k_len))
    layers: list[list[Tensor]] = [[] for _ in range(blocks)]
    head: dict[str, Tensor] = {}
    for name, info in tensors.items():
        shape = tuple(int(s) for s in info.shape)
        if name.endswith(_VECTOR_MATRICES):
            shape = (math.prod(shape),)
        elif name.endswith(".attn_q_norm.weight"):  # held expanded to one row per head
            shape = (n_head * math.prod(shape),)
        elif name.endswith(".attn_k_norm.weight"):
            shape = (n_kv * math.prod(shape),)
        t = Tensor(name, info.ggml_type.name, shape)
        parts = name.split(".")
        if parts[0] == "blk" and parts[1].isdigit() and int(parts[1]) < blocks:
            layers[int(parts[1])].append(t)
        elif name in _HEAD_TENSORS:
            head[name] = t
    attention = tuple(f"blk.{il}.attn_k.weight" in tensors for il in range(blocks))
    # Gated DeltaNet state per slot: the conv's last kernel-1 inputs of every channel, and a
    # [state_size, inner_size / V heads] matrix per V head (engine/model/config.py DeltaNetShape).
    d_state, inner = (int(metadata.get(f"{arch}.ssm.{key}", 0)) for key in ("state_size", "inner_size"))
    channels = 2 * int(metadata.get(f"{arch}.ssm.group_count", 0)) * d_state + inner
    state = channels * (int(metadata.get(f"{arch}.ssm.conv_kernel", 1)) - 1) + d_state * inner
    return ModelTensors(
        n_layers,
        tuple(tuple(ts) for ts in layers),
        head.get("token_embd.weight"),
        head.get("output.weight"),
        tuple(t for n, t in head.items() if n == "output_norm.weight"),
        (n_kv * k_len, n_kv * v_len),
        int(metadata.get(f"{arch}.rope.dimension_count", k_len)),
        attention,
        state,
        (channels, d_state, inner),
    )
