"""A `Stage`: one transformer implementation for every architecture in `config.ARCHITECTURES`.

A `Stage` materialises the embedding (optional), a layer range [a, b) and the output head
(optional) of one GGUF file on one device, with a KV cache per attention layer in blocks of
positions (`kv_blocks`: one block of n_ctx per slot, or a pool shared by the slots that hands out
blocks as they grow), and a recurrent state per slot
(conv + SSM, `deltanet`) per Gated DeltaNet layer (qwen35's hybrid stack: per-layer type as data).

A batch is a flat list of tokens with a slot and a position each; the tokens of one slot are
contiguous with increasing positions (nano-vllm style). The same call therefore serves a
prefill (one slot, many tokens), a speculative verify and a batched decode (many slots, one
token each). KV rollback is implicit: positions at or after a slot's length get overwritten.
Recurrent state is not overwritten that way: a slot's run continues it, starts afresh or re-runs a
rejected draft's last tokens (`recurrent_progress`, which checks each batch against it).

Numerics: the residual stream and the norms are float32; the matrix products run in the
compute dtype. On CPU with a 16-bit compute dtype the weights are int8 with a bfloat16 scale
per row (`torch.ops.aten._weight_int8pack_mm`; torch's 16-bit single-row GEMM is slow there and
decode is memory-bound): layers as two terms (the second quantizes the first one's residual,
so they are as exact as float32 weights), the output head (Gemma 3's tied 262k rows, 63% of
the weights) as one term whose top `RESCORE_TOP` logits per row are recomputed from the exact
rows. Many-row products (prefill) use a kept bfloat16 copy of the layers instead (see
`weights`), and SDPA blocks a many-row run its own way: a token's last bits depend on how many
rows shared its forward, unless `deterministic` (`build_stage`). A float32 Stage keeps exact
dequantized weights everywhere (the reference path for tests). On CUDA, `DecodeGraphs` replays a
captured decode step per batch size, `PrefillGraphs` a prompt's run from position 0 per
length bucket, and `PackedGraphs` a recurrent stage's short mixed steps.

`build_stage` is the one way to make a Stage: it resolves the device and dtype flags, reads the
config and picks the weight format.
"""

from __future__ import annotations

import collections
from pathlib import Path

import torch

from ..device import resolve_device, resolve_dtype, to_device
from ..errors import UserError
from ..gguf_file import GGUFFile
from ..kernels.qlinear import embed_rows
from ..kernels.qweight import QuantWeight
from ..quant import dequantize_rows
from .attention import decode_bias
from .config import ModelConfig
from .deltanet import ROLLBACK, DeltaNet
from .forward_batch import ForwardBatch, Mode, slot_runs
from .graphs import DecodeGraphs, HeadGraphs, PackedGraphs, PrefillGraphs
from .kv_blocks import KVBlocks
from .kv_cache import check_cache_type
from .layer import Layer, block, collect_storages, rms_norm
from .recurrent_progress import RecurrentProgress
from .rope import rope_table, rotate, rotation
from .weights import Weights

# Logits recomputed exactly after the int8 head: far more than any near-tie of the top token.
RESCORE_TOP = 32


class Stage:
    """Embedding (optional) + layers [a, b) + final norm and output head (optional) on one device."""

    def __init__(
        self,
        cfg: ModelConfig,
        weights: Weights,
        layers: tuple[int, int],
        *,
        embed: bool,
        head: bool,
        n_slots: int,
        n_ctx: int,
        compile_decode: bool = False,
        kv_types: tuple[str, str] = ("auto", "auto"),
        kv_pool: int | None = None,
        rope_of: Stage | None = None,
        depth: int = ROLLBACK,
        deterministic: bool = False,
        graph_padding: bool | None = None,
    ):
        """`kv_pool`: positions of a KV pool all slots share (each still up to `n_ctx`); None: each slot
        reserves its whole context. `rope_of`: a stage of the same model and context whose RoPE
        tables this one reads (the head's MTP block: 0.1 GiB at 96K positions, not held twice).
        `depth`: positions a recurrent layer's state can be taken back (the longest draft verified,
        at most ROLLBACK): each costs a copy of the state per slot and layer. `deterministic`: every
        token's floats independent of the batch it runs in (see `build_stage`). `graph_padding`: the CUDA
        graphs' padding slot (None: on CUDA; tests lay out a CPU stage as a GPU's)."""
        self.cfg, self.weights, self.g = cfg, weights, weights.g
        self.deterministic = deterministic
        for kind, flag in zip(kv_types, ("--cache-type-k", "--cache-type-v")):
            check_cache_type(kind, flag, cfg.head_dim)
        self.kv_types, self.kv_pool = kv_types, kv_pool
        self.device, self.dtype, self.int8 = weights.device, weights.dtype, weights.int8
        if n_slots < 1 or n_ctx < 1:
            raise UserError(f"need at least one slot and a positive context (got {n_slots} slots, n_ctx {n_ctx})")
        self.n_slots, self.n_ctx = n_slots, n_ctx
        self.has_embed, self.has_head = embed, head
        self.layers: dict[int, Layer] = {}
        self.layer_range = (0, 0)
        self.recurrent_progress = RecurrentProgress(n_slots, depth)
        self.depth = depth
        capture = self.device.type == "cuda"
        # The CUDA graphs' padding slot: a recurrent state row of its own, and ROLLBACK positions
        # past the context in the KV (a bucket's unused rows run at most ROLLBACK positions each).
        padded = capture if graph_padding is None else graph_padding
        self.state_rows = n_slots + 1 if padded else n_slots
        padding = ROLLBACK if padded else 0
        if kv_pool is not None and kv_pool < 1:
            raise UserError(f"the KV pool needs at least one position (got {kv_pool})")
        self.kv_blocks = (
            KVBlocks.reserved(n_slots, n_ctx, self.device, padding)
            if kv_pool is None
            else KVBlocks.pool(n_slots, n_ctx, kv_pool, self.device, padding)
        )
        if rope_of is not None:
            self._rope_global, self._rope_swa = rope_of._rope_global, rope_of._rope_swa
        else:
            self._rope_global = rope_table(cfg, n_ctx + padding, cfg.rope_base, cfg.rope_scale, self.device)
            self._rope_swa = rope_table(cfg, n_ctx + padding, cfg.rope_base_swa, 1.0, self.device)
        self.assign(*layers)
        if embed:
            self._embd_info = weights.tensor("token_embd.weight")
            # On a GPU a quantized table stays in pinned host memory, as llama.cpp keeps it (a 27B's
            # 248k rows are 0.8 GiB of a 16 GB card), unless it is also the output head (tied): the
            # lookup kernel reads just the rows asked for across the bus, graph-capturable. On CPU rows
            # are dequantized from the mmap as they are looked up, so a big table costs nothing at load.
            self._embd_table = None
            if self.device.type == "cuda":
                q = weights.quant("token_embd.weight", pinned=not cfg.tied)
                self._embd_table = q if q is not None else weights.dense(["token_embd.weight"])
        if head:
            self.output_norm = weights.vector("output_norm.weight")
            self._head_name = "token_embd.weight" if cfg.tied else "output.weight"
            self.output = weights.linear([self._head_name], terms=1)
        self.weights.scratch.fit(self.dtype, self.device)  # every weight of the stage is built: before any graph
        self.graphs = DecodeGraphs(self, compiled=compile_decode) if capture else None
        # Tokens per slot the decode graphs replay once warmed up: another run length runs eagerly, and
        # the engine pads a verify up to one of them (`Speculator.verify_lengths`). None: any length
        # (no graphs: on CPU a padding row costs time; or before a warm-up: captured on first use).
        self.graph_run_lengths: tuple[int, ...] | None = None
        self.prefill_graphs = PrefillGraphs(self, self.graphs) if capture else None
        self.packed_graphs = PackedGraphs(self, self.graphs) if capture else None
        self.head_graphs = HeadGraphs(self, self.graphs) if capture and head else None
        # Passes over the layers by how they ran (/status `stages[].steps`): a graph replayed, or eager and
        # why (eager decode steps on a GPU: the usual reason a batch serves slower than it should).
        self.steps: collections.Counter[str] = collections.Counter()

    # ---- layers and cache ------------------------------------------------------------------

    def assign(self, a: int, b: int) -> None:
        """Hold layers [a, b) from now on: keep those already here (with their KV), load the rest, free the others."""
        if not (0 <= a <= b <= self.cfg.n_layers):
            raise UserError(f"layer range [{a}, {b}) is outside the model's {self.cfg.n_layers} layers")
        kept = {il: self.layers[il] for il in range(a, b) if il in self.layers}
        self.layers = {}  # drop the old ones before loading new ones: peak memory stays one range
        self.layers = {il: kept.get(il) or self._layer(il) for il in range(a, b)}
        self.layer_range = (a, b)
        self.recurrent_progress.hold([layer.deltanet for layer in self.layers.values() if layer.deltanet is not None])
        if getattr(self, "graphs", None) is not None:
            self.graphs.reset()
            self.prefill_graphs.reset()
            self.packed_graphs.reset()
            self.weights.scratch.fit(self.dtype, self.device)  # the new layers' weights may be larger

    @property
    def recurrent(self) -> list[DeltaNet]:
        """The states of this stage's recurrent (DeltaNet) layers."""
        return self.recurrent_progress.nets

    def _layer(self, il: int) -> Layer:
        padding = self.state_rows > self.n_slots
        return Layer(self.cfg, self.weights, il, self.kv_blocks, self.kv_types, self.n_slots, self.depth, padding)

    def warm_up(self, per_slot=(1,), prefill_tokens: int = 0, mark=lambda phase: None) -> None:
        """Compile and capture the decode step for every batch bucket now (CUDA; nothing elsewhere),
        for runs of each length in `per_slot` (`graph_run_lengths`: 1 and a verify of draft max + 1),
        the only lengths the graphs replay from now on, and the prefill of prompt chunks up to
        `prefill_tokens` (0: on first use; a recurrent stage's packed steps up to as many tokens);
        the output head's graphs too. `mark(phase)` after each kind (a start's /status phases)."""
        if self.graphs is not None:
            self.graphs.warm_up(per_slot)
            self.graph_run_lengths = tuple(sorted({m for m in per_slot if m <= ROLLBACK}))
            if self.head_graphs is not None:
                self.head_graphs.warm_up()
            mark("decode graphs")  # with the output head's
        for name, graphs in (("prefill graphs", self.prefill_graphs), ("packed graphs", self.packed_graphs)):
            if graphs is not None and prefill_tokens:
                graphs.warm_up(prefill_tokens)
                mark(name)
        if self.device.type == "cuda":
            # The load's and the captures' temporaries stay cached in the allocator, unused until a
            # prompt needs them; NVML counts them against the card. Given back here, what the
            # process holds is what it serves with (the graphs keep their own pool).
            torch.cuda.empty_cache()

    def kv_clear(self, slot: int) -> None:
        """Forget a slot: its KV (pooled blocks go back to the pool) and its recurrent state."""
        self.kv_blocks.release(slot)
        self.recurrent_progress.restart(slot)

    def kv_shift(self, slot: int, keep: int, discard: int, n: int) -> None:
        """llama.cpp's context shift on `slot`, which holds `n` positions: positions [keep, keep +
        discard) are dropped and [keep + discard, n) move down by `discard`, each K turned back by
        that many positions of its layer's RoPE (K is cached rotated). Every position stays in the
        cache (no window trims it), so a windowed layer masks by the new positions, as llama.cpp's
        full-size SWA cache. A recurrent state cannot drop tokens: ValueError."""
        if self.recurrent:
            raise ValueError("a recurrent layer's state cannot be shifted")
        ropes = {False: self._rope_global, True: self._rope_swa}
        for layer in self.layers.values():
            cos, sin = rotation(ropes[bool(layer.window)], -discard)
            layer.kv.move(slot, keep + discard, n, -discard, lambda k, c=cos, s=sin: rotate(self.cfg, k, c, s))

    def slot_state(self, slot: int, n: int) -> dict[str, torch.Tensor]:
        """What this stage holds for `slot`'s first `n` positions, by name: what moves when a slot
        moves (contracts.slot_state); `place_slot_state` puts it back. A DeltaNet layer's entries are
        its state after the slot's tokens (saved only when those are n)."""
        out = {}
        for il, layer in self.layers.items():
            if layer.deltanet is not None:
                out[f"blk.{il}.conv"] = layer.deltanet.conv_state[slot]
                out[f"blk.{il}.ssm"] = layer.deltanet.ssm_state[slot]
            else:
                out |= {f"blk.{il}.{name}": view for name, view in layer.kv.views(slot, n).items()}
        return out

    def place_slot_state(self, slot: int, n: int, tensors: dict[str, torch.Tensor]) -> None:
        """Put the state of n tokens (`slot_state`'s names and shapes) into `slot`; its recurrent
        state continues from n."""
        self.kv_blocks.fit({slot: n})
        for il, layer in self.layers.items():
            if layer.deltanet is not None:
                layer.deltanet.conv_state[slot].copy_(tensors[f"blk.{il}.conv"])
                layer.deltanet.ssm_state[slot].copy_(tensors[f"blk.{il}.ssm"])
            else:
                prefix = f"blk.{il}."
                layer.kv.write_views(
                    slot, n, {k.removeprefix(prefix): t for k, t in tensors.items() if k.startswith(prefix)}
                )
        self.recurrent_progress.placed(slot, n)

    @property
    def kv_bytes(self) -> int:
        """KV cache and recurrent state (with its checkpoints), all slots."""
        return sum(t.nbytes for layer in self.layers.values() for t in layer.state_tensors())

    @property
    def state_bytes(self) -> int:
        """The recurrent (DeltaNet) part of `kv_bytes`: conv + SSM state and their checkpoints."""
        return sum(
            t.nbytes for layer in self.layers.values() if layer.deltanet is not None for t in layer.state_tensors()
        )

    @property
    def held_weight_bytes(self) -> int:
        """Bytes of every weight this stage keeps on its device, each storage once: layers (with a CPU
        layer's prefill copy once built), the embedding table (a GPU's), the output head, the norms
        and the RoPE tables. With `kv_bytes`, what the stage holds (contracts/footprint.py estimates it)."""
        storages: dict[int, int] = {}
        collect_storages(
            [
                self.layers,
                self._embd_table if self.has_embed else None,
                self._rope_global,
                self._rope_swa,
                getattr(self, "output", None),
                getattr(self, "output_norm", None),
            ],
            storages,
        )
        for layer in self.layers.values():
            for t in layer.state_tensors():
                storages.pop(t.untyped_storage().data_ptr(), None)
        return sum(storages.values())

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights read per decoded token (layers + output head; embedding rows are negligible)."""
        n = sum(layer.nbytes for layer in self.layers.values())
        return n + (self.output.nbytes if self.has_head else 0)

    # ---- forward -------------------------------------------------------------------------------

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids [T] -> float32 hidden states [T, n_embd] (Gemma's sqrt(n_embd) scale included)."""
        tokens = torch.as_tensor(tokens, dtype=torch.long)
        if (
            tokens.device.type == "cpu"
            and tokens.numel()
            and (int(tokens.min()) < 0 or int(tokens.max()) >= self.cfg.n_vocab)
        ):
            raise UserError(f"token id out of range 0..{self.cfg.n_vocab - 1}")
        if isinstance(self._embd_table, QuantWeight):
            h = embed_rows(self._embd_table, tokens.to(self.device))
        elif self._embd_table is not None:
            h = self._embd_table[tokens.to(self.device)].float()
        else:
            t = self._embd_info
            h = dequantize_rows(self.g.raw(t.name), t.ggml_type, self.cfg.n_embd, tokens.cpu()).to(self.device)
        return h * self.cfg.embed_scale if self.cfg.embed_scale != 1.0 else h

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Hidden states [R, n_embd] -> float32 logits [R, n_vocab]."""
        out = self.head_graphs.run(h) if self.head_graphs is not None else None
        return self.project(self.final_norm(h)) if out is None else out

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        """The output norm: what the head projects, what an MTP block drafts from (llama.cpp's `h_nextn`)
        and what an embedding pools (its `t_embd`)."""
        return rms_norm(h, self.output_norm, self.cfg.rms_eps)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """Normed hidden states [R, n_embd] -> float32 logits [R, n_vocab] through the output head."""
        out = self.output(x.to(self.dtype)).float()
        if self.output.scale is not None and out.shape[-1] > RESCORE_TOP:  # int8 head
            top = out.topk(RESCORE_TOP, dim=-1).indices
            t = self.weights.tensor(self._head_name)
            rows = dequantize_rows(self.g.raw(t.name), t.ggml_type, self.cfg.n_embd, top.cpu()).to(x.device)
            out.scatter_(1, top, torch.einsum("rd,rkd->rk", x, rows))
        if self.cfg.final_softcap:
            out = torch.tanh(out / self.cfg.final_softcap) * self.cfg.final_softcap
        return out

    def run_layers(self, h: torch.Tensor, slots, positions) -> torch.Tensor:
        """Run this stage's layers over a flat batch; writes their KV. h [T, n_embd] -> same shape, float32."""
        slots = torch.as_tensor(slots, dtype=torch.long)
        positions = torch.as_tensor(positions, dtype=torch.long)
        h = h.to(self.device, torch.float32, non_blocking=True)  # asynchronous only from page-locked memory
        if h.shape[0] == 0 or not self.layers:
            return h
        runs = slot_runs(slots, positions, self.n_slots, self.n_ctx)
        self.kv_blocks.fit({slot: p0 + n for slot, p0, n in runs})
        self.recurrent_progress.enter(runs)
        out = None
        per_slot = {n for _, _, n in runs}
        replayed = self.graph_run_lengths
        if len(per_slot) > 1:
            path = "eager: slots run different lengths"  # e.g. a prompt chunk beside decodes
        elif self.graphs is None:
            path = "eager: no graphs"
        elif replayed is not None and next(iter(per_slot)) not in replayed:
            path = "eager: a run length without a graph"  # another length would compile and capture mid-serving
        else:  # decode, or verifies of one draft length
            out = self.graphs.run(h, slots, positions, per_slot.pop())
            path = "decode graph" if out is not None else "eager: more slots or tokens than the graphs take"
        for name, graphs in (("prefill graph", self.prefill_graphs), ("packed graph", self.packed_graphs)):
            if out is None and graphs is not None:  # a prompt from its start; a recurrent stage's short steps
                out = graphs.run(h, runs)
                path = name if out is not None else path
        if out is None:
            out = self.forward(h, self._eager(slots, positions, runs))
        self.steps[path] += 1
        self.recurrent_progress.ran(runs)
        return out

    def run_layer(self, il: int, h: torch.Tensor, slots, positions) -> torch.Tensor:
        """Layer `il` alone, eagerly (the split advisor times layers one by one); writes its KV.
        Attention layers only: a recurrent layer's state would advance."""
        layer = self.layers[il]
        if layer.deltanet is not None:
            raise UserError(f"layer {il} is recurrent (DeltaNet): its state cannot be run out of order")
        slots = torch.as_tensor(slots, dtype=torch.long)
        positions = torch.as_tensor(positions, dtype=torch.long)
        runs = slot_runs(slots, positions, self.n_slots, self.n_ctx)
        self.kv_blocks.fit({slot: p0 + n for slot, p0, n in runs})
        h = h.to(self.device, torch.float32)
        return self.forward(h, self._eager(slots, positions, runs), [layer])

    def _eager(self, slots: torch.Tensor, positions: torch.Tensor, runs) -> ForwardBatch:
        """The batch of an eager forward over host `slots` / `positions`."""
        return ForwardBatch.of_runs(
            to_device(slots, self.device), to_device(positions, self.device), runs, self.deterministic
        )

    def forward(self, h: torch.Tensor, batch: ForwardBatch, layers=None, block=block) -> torch.Tensor:
        """The layers (all, or `layers`) over `batch`, eagerly; what the CUDA graphs capture. `block`
        runs one layer (`layer.block`, or its torch.compile'd form)."""
        positions = batch.positions
        ropes = {False: self._rope_global, True: self._rope_swa}
        ropes = {w: (cos[positions, None], sin[positions, None]) for w, (cos, sin) in ropes.items()}
        biases = {}
        for layer in self.layers.values() if layers is None else layers:
            bias = None
            if batch.mode in (Mode.BATCHED, Mode.PACKED) and self.device.type != "cuda" and layer.deltanet is None:
                if layer.window not in biases:
                    biases[layer.window] = decode_bias(self.cfg, positions, batch.kv_len, layer.window, self.dtype)
                bias = biases[layer.window]
            h = block(layer, h, ropes[bool(layer.window)], batch, bias)
        return h


def build_stage(
    g: GGUFFile,
    layers: tuple[int, int] | None = None,
    *,
    embed: bool = True,
    head: bool = True,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = "auto",
    n_slots: int = 4,
    n_ctx: int = 4096,
    cache_dir: Path | None = None,
    int8: bool | None = None,
    quantized: bool | None = None,
    compile_decode: bool = False,
    kv_types: tuple[str, str] = ("auto", "auto"),
    kv_pool: int | None = None,
    depth: int = ROLLBACK,
    deterministic: bool = False,
    graph_padding: bool | None = None,
) -> Stage:
    """The Stage of `g` for layers [a, b) (default: all), from `--device` / `--dtype` values or torch
    objects. `cache_dir` keeps converted int8 weights across runs (None: convert on every load);
    `int8` None picks int8 weights where they pay off: the int8 kernel beats the 16-bit ones only
    on CPU with 16-bit compute. `quantized` None keeps GGUF-quantized weights quantized on a GPU
    (its kernels); CPU runs the int8 path. `depth`: see `Stage`.

    `deterministic`: a token's floats depend only on the tokens before it, never on its batch
    (other slots, chunk boundaries, a cached prefix, a draft's length): every product row through
    one kernel, attention a query row at a time (docs/ARCHITECTURE.md, "Numerics"). CPU attention
    models only: CUDA kernels tile by row count, a recurrent layer's prefill is chunked."""
    cfg = ModelConfig.from_gguf(g)
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    if deterministic and device.type != "cpu":
        raise UserError(f"--deterministic runs on CPU workers only ({device}'s kernels tile by row count)")
    if deterministic and cfg.recurrent:
        raise UserError(f"--deterministic: {cfg.arch} has recurrent (DeltaNet) layers, whose prefill is chunked")
    if int8 is None:
        int8 = device.type == "cpu" and dtype != torch.float32
    if quantized is None:
        quantized = device.type == "cuda"
    weights = Weights(g, cfg.arch, device, dtype, int8, cache_dir, quantized, row_invariant=deterministic)
    return Stage(
        cfg,
        weights,
        layers or (0, cfg.n_layers),
        embed=embed,
        head=head,
        n_slots=n_slots,
        n_ctx=n_ctx,
        compile_decode=compile_decode,
        kv_types=kv_types,
        kv_pool=kv_pool,
        depth=depth,
        deterministic=deterministic,
        graph_padding=graph_padding,
    )
