"""One transformer implementation for every supported architecture; the differences are data.

`ModelConfig.from_gguf` reads the shape from metadata and the architecture's deltas from
`ARCHITECTURES` (RoPE style, biases, Q/K norms, extra norms, activation, sliding window, ...).
A `Stage` materialises the embedding (optional), a layer range [a, b) and the output head
(optional) of one GGUF file on one device, with a static KV cache per slot:
`[n_slots, n_kv_heads, n_ctx, head_dim]` per layer.

A batch is a flat list of tokens with a slot and a position each; the tokens of one slot are
contiguous with increasing positions (nano-vllm style). The same call therefore serves a
prefill (one slot, many tokens), a speculative verify and a batched decode (many slots, one
token each). KV rollback is implicit: positions at or after a slot's length get overwritten.

Numerics: the residual stream and the norms are float32; the matrix products run in the
compute dtype. On CPU with a 16-bit compute dtype the weights are int8 with a bfloat16 scale
per row (`torch.ops.aten._weight_int8pack_mm`; torch's 16-bit single-row GEMM is slow there and
decode is memory-bound): layers as two terms (the second quantizes the first one's residual,
so they are as exact as float32 weights), the output head (Gemma 3's tied 262k rows, 63% of
the weights) as one term whose top `RESCORE_TOP` logits per row are recomputed from the exact
rows. Many-row products (prefill) use a kept bfloat16 copy of the layers instead. Converted
weights of big files are cached on disk and memory-mapped. A float32 Stage keeps exact
dequantized weights everywhere (the reference path for tests). On CUDA, `DecodeGraphs` replays
a captured (optionally torch.compile'd) decode step per batch size.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..device import resolve_device, resolve_dtype
from ..errors import UserError
from ..gguf_file import GGUFFile
from ..quant import dequantize, dequantize_rows

# Per-architecture deltas from the llama baseline (interleaved RoPE, SiLU, no extras).
ARCHITECTURES: dict[str, dict] = {
    "llama": {},
    "qwen2": {"rope_neox": True, "qkv_bias": True},
    "qwen3": {"rope_neox": True, "qk_norm": True},
    "gemma3": {
        "rope_neox": True,
        "qk_norm": True,
        "post_norms": True,
        "embed_scale": True,
        "activation": "gelu_tanh",
        "swa_pattern": 6,  # layers with il % 6 < 5 use the sliding window
        "rope_base_swa": 10_000.0,
    },
}

# cuDNN attention re-plans for every new sequence length (~10 ms a call): decode would crawl.
_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
# Above this many rows (prefill), int8 layers run as a bfloat16 GEMM instead of the int8 kernel.
_INT8_MAX_ROWS = 16
# Logits recomputed exactly after the int8 head: far more than any near-tie of the top token.
RESCORE_TOP = 32
# Files at least this big keep their converted (int8) weights in the on-disk cache.
_CACHE_MIN_FILE_BYTES = 64 << 20
# Rows converted per step when building int8 weights: bounds the float32 temporaries.
_CONVERT_ROWS = 16384


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_layers: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_vocab: int
    n_ctx_train: int
    rms_eps: float
    rope_base: float
    rope_base_swa: float
    rope_scale: float  # positions are divided by this on global (non-window) layers
    n_rot: int
    rope_neox: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    post_norms: bool = False
    embed_scale: float = 1.0
    activation: str = "silu"
    sliding_window: int = 0
    swa_layers: tuple[bool, ...] = field(default=())
    attn_scale: float = 1.0
    final_softcap: float = 0.0
    tied: bool = False

    @classmethod
    def from_gguf(cls, g: GGUFFile) -> ModelConfig:
        arch = g.architecture
        if arch not in ARCHITECTURES:
            raise UserError(
                f"{g.path}: unsupported model architecture {arch!r} (supported: {', '.join(ARCHITECTURES)})"
            )
        delta = ARCHITECTURES[arch]

        def key(name, default=None, required=False):
            v = g.get(f"{arch}.{name}", default)
            if v is None and required:
                raise UserError(f"{g.path}: metadata key {arch}.{name} is missing")
            return v

        n_layers = int(key("block_count", required=True))
        n_embd = int(key("embedding_length", required=True))
        n_head = int(key("attention.head_count", required=True))
        n_head_kv = int(key("attention.head_count_kv", n_head))
        head_dim = int(key("attention.key_length", n_embd // n_head))
        if "token_embd.weight" not in g.tensors:
            raise UserError(f"{g.path}: tensor 'token_embd.weight' is missing")
        n_vocab = g.tensors["token_embd.weight"].shape[0]
        window = int(key("attention.sliding_window", 0) or 0) if "swa_pattern" in delta else 0
        pattern = int(key("attention.sliding_window_pattern", delta.get("swa_pattern", 0)) or 0)
        swa = tuple(bool(window and pattern and il % pattern < pattern - 1) for il in range(n_layers))
        scaling = key("rope.scaling.type", "none")
        rope_base = float(key("rope.freq_base", 10_000.0))
        return cls(
            arch=arch,
            n_layers=n_layers,
            n_embd=n_embd,
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim=head_dim,
            n_ff=int(key("feed_forward_length", required=True)),
            n_vocab=n_vocab,
            n_ctx_train=int(key("context_length", 4096)),
            rms_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_base=rope_base,
            rope_base_swa=float(delta.get("rope_base_swa", rope_base)),
            rope_scale=float(key("rope.scaling.factor", 1.0) or 1.0) if scaling == "linear" else 1.0,
            n_rot=int(key("rope.dimension_count", head_dim)),
            rope_neox=delta.get("rope_neox", False),
            qkv_bias=delta.get("qkv_bias", False),
            qk_norm=delta.get("qk_norm", False),
            post_norms=delta.get("post_norms", False),
            embed_scale=math.sqrt(n_embd) if delta.get("embed_scale") else 1.0,
            activation=delta.get("activation", "silu"),
            sliding_window=window,
            swa_layers=swa,
            attn_scale=float(key("attention.scale", 0.0) or 1.0 / math.sqrt(head_dim)),
            final_softcap=float(key("final_logit_softcapping", 0.0) or 0.0),
            tied="output.weight" not in g.tensors,
        )


class Linear:
    """y = x @ W^T (+ b). W is dense in the compute dtype, or int8 rows with a bfloat16 scale each
    (`scale`), stored as `terms` stacked row blocks whose products add up: a second term quantizes
    the first one's residual, so two int8 terms are about as exact as float32 weights."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor | None = None, bias=None, terms: int = 1):
        self.weight, self.scale, self.bias, self.terms = weight, scale, bias, terms
        self._dense = None

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + (0 if self.scale is None else self.scale.nbytes)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.scale is None:
            y = F.linear(x, self.weight)
        elif x.shape[0] > _INT8_MAX_ROWS and self.terms > 1:
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


def _prepared_cache(g: GGUFFile, key: str, build) -> dict[str, torch.Tensor]:
    """Converted weights of a big model, kept on disk by file fingerprint and memory-mapped on later
    loads: converting Gemma's 262k-row head to int8 costs seconds, mapping it costs milliseconds.
    Small files (tests, synthetic models) are converted every time."""
    root = os.environ.get("HYDRA_CACHE_DIR") or Path.home() / ".cache" / "hydra-console" / "prepared"
    if g.path.stat().st_size < _CACHE_MIN_FILE_BYTES or str(root) == "off":
        return build()
    path = Path(root) / g.fingerprint / f"{key}.pt"
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


class _Layer:
    """Weights and KV cache of one transformer block."""

    def __init__(self, stage: Stage, il: int):
        cfg = stage.cfg
        p = f"blk.{il}."
        vec = stage._vector
        self.window = cfg.sliding_window if cfg.swa_layers[il] else 0
        self.attn_norm = vec(p + "attn_norm.weight")
        qkv = [p + n for n in ("attn_q", "attn_k", "attn_v")]
        self.wqkv = stage._linear([n + ".weight" for n in qkv], [n + ".bias" for n in qkv] if cfg.qkv_bias else [])
        self.wo = stage._linear([p + "attn_output.weight"])
        # Q and K heads are normalised together: one weight row per head, [n_head + n_head_kv, head_dim].
        self.qk_norm = None
        if cfg.qk_norm:
            q_w, k_w = vec(p + "attn_q_norm.weight"), vec(p + "attn_k_norm.weight")
            self.qk_norm = torch.cat([q_w.expand(cfg.n_head, -1), k_w.expand(cfg.n_head_kv, -1)])
        self.post_attn_norm = vec(p + "post_attention_norm.weight") if cfg.post_norms else None
        self.ffn_norm = vec(p + "ffn_norm.weight")
        self.w_gate_up = stage._linear([p + "ffn_gate.weight", p + "ffn_up.weight"])
        self.w_down = stage._linear([p + "ffn_down.weight"])
        self.post_ffn_norm = vec(p + "post_ffw_norm.weight") if cfg.post_norms else None
        shape = (stage.n_slots, cfg.n_head_kv, stage.n_ctx, cfg.head_dim)
        self.k_cache = torch.zeros(shape, dtype=stage.dtype, device=stage.device)
        self.v_cache = torch.zeros(shape, dtype=stage.dtype, device=stage.device)

    @property
    def nbytes(self) -> int:
        return sum(lin.nbytes for lin in (self.wqkv, self.wo, self.w_gate_up, self.w_down))


class Stage:
    """Embedding (optional) + layers [a, b) + final norm and output head (optional) on one device."""

    def __init__(
        self,
        cfg: ModelConfig,
        g: GGUFFile,
        layers: tuple[int, int] | None = None,
        embed: bool = True,
        head: bool = True,
        device="cpu",
        dtype="auto",
        n_slots: int = 4,
        n_ctx: int = 4096,
        int8: bool | None = None,
        compile_decode: bool = False,
    ):
        self.cfg, self.g = cfg, g
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        # int8 weights pay off where the int8 kernel beats the 16-bit ones: CPU with 16-bit compute.
        self.int8 = self.device.type == "cpu" and self.dtype != torch.float32 if int8 is None else int8
        if n_slots < 1 or n_ctx < 1:
            raise UserError(f"need at least one slot and a positive context (got {n_slots} slots, n_ctx {n_ctx})")
        self.n_slots, self.n_ctx = n_slots, n_ctx
        self.has_embed, self.has_head = embed, head
        self._rope_global = self._rope_table(cfg.rope_base, cfg.rope_scale)
        self._rope_swa = self._rope_table(cfg.rope_base_swa, 1.0)
        self.layers: dict[int, _Layer] = {}
        self.layer_range = (0, 0)
        self.assign(*(layers or (0, cfg.n_layers)))
        if embed:
            self._embd_info = self._tensor("token_embd.weight")
            # On a GPU the table lives on the device (graph-capturable lookups); on CPU rows are
            # dequantized from the mmap as they are looked up, so a 262k-row table costs nothing at load.
            self._embd_table = self._weight_f32("token_embd.weight").to(self.dtype) if self.device.type == "cuda" else None
        if head:
            self.output_norm = self._vector("output_norm.weight")
            self._head_name = "token_embd.weight" if cfg.tied else "output.weight"
            self.output = self._linear([self._head_name], terms=1)
        self.graphs = DecodeGraphs(self, compiled=compile_decode) if self.device.type == "cuda" else None

    # ---- loading -------------------------------------------------------------------------------

    def _tensor(self, name: str):
        try:
            return self.g.tensors[name]
        except KeyError:
            raise UserError(f"{self.g.path}: tensor {name!r} is missing (architecture {self.cfg.arch})") from None

    def _weight_f32(self, name: str) -> torch.Tensor:
        """The tensor dequantized to float32; on a GPU the bytes move first and decode there."""
        t = self._tensor(name)
        raw = torch.from_numpy(self.g.raw(name))
        if self.device.type == "cuda":
            raw = raw.to(self.device)
        return dequantize(raw, t.ggml_type, t.shape)

    def _vector(self, name: str) -> torch.Tensor:
        return self._weight_f32(name).to(self.device)

    def _linear(self, names: list[str], bias_names: list[str] = (), terms: int = 2) -> Linear:
        """One Linear over the row-wise concatenation of tensors `names` (fused QKV, fused gate+up);
        int8 weights get `terms` terms (the output head one: its top logits are rescored exactly)."""
        bias = torch.cat([self._weight_f32(n) for n in bias_names]).to(self.device) if bias_names else None
        if not self.int8:
            parts = [self._weight_f32(n) for n in names]
            return Linear((parts[0] if len(parts) == 1 else torch.cat(parts)).to(self.dtype), None, bias)

        def convert() -> dict[str, torch.Tensor]:
            per_term = [[] for _ in range(2 * terms)]  # q and scale of each term, over all row chunks
            for name in names:
                t = self._tensor(name)
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
            self._tensor(name)  # a missing tensor is an error even when a converted copy is cached
        prepared = _prepared_cache(self.g, key, convert)
        return Linear(prepared["weight"], prepared["scale"], bias, terms)

    def _rope_table(self, base: float, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin [n_ctx, n_rot] in float32 laid out for `_rotate`; angles in float64."""
        n_rot = self.cfg.n_rot
        inv = base ** (-np.arange(0, n_rot, 2, dtype=np.float64) / n_rot)
        ang = np.outer(np.arange(self.n_ctx, dtype=np.float64) / scale, inv)
        cos, sin = np.cos(ang), np.sin(ang)
        if self.cfg.rope_neox:  # pairs (i, i + n_rot/2): first half gets -sin
            cos, sin = np.concatenate([cos, cos], 1), np.concatenate([-sin, sin], 1)
        else:  # pairs (2i, 2i+1): even dims get -sin
            cos, sin = np.repeat(cos, 2, 1), np.stack([-sin, sin], -1).reshape(len(sin), -1)
        return tuple(torch.from_numpy(t.astype(np.float32)).to(self.device) for t in (cos, sin))

    def assign(self, a: int, b: int) -> None:
        """Hold layers [a, b) from now on: keep those already here (with their KV), load the rest, free the others."""
        if not (0 <= a <= b <= self.cfg.n_layers):
            raise UserError(f"layer range [{a}, {b}) is outside the model's {self.cfg.n_layers} layers")
        kept = {il: self.layers[il] for il in range(a, b) if il in self.layers}
        self.layers = {}  # drop the old ones before loading new ones: peak memory stays one range
        self.layers = {il: kept.get(il) or _Layer(self, il) for il in range(a, b)}
        self.layer_range = (a, b)
        if getattr(self, "graphs", None) is not None:
            self.graphs.reset()

    def kv_clear(self, slot: int) -> None:
        for layer in self.layers.values():
            layer.k_cache[slot].zero_()
            layer.v_cache[slot].zero_()

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights read per decoded token (layers + output head; embedding rows are negligible)."""
        n = sum(layer.nbytes for layer in self.layers.values())
        return n + (self.output.nbytes if self.has_head else 0)

    # ---- forward -------------------------------------------------------------------------------

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids [T] -> float32 hidden states [T, n_embd] (Gemma's sqrt(n_embd) scale included)."""
        tokens = torch.as_tensor(tokens, dtype=torch.long)
        if tokens.device.type == "cpu" and tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.cfg.n_vocab):
            raise UserError(f"token id out of range 0..{self.cfg.n_vocab - 1}")
        if self._embd_table is not None:
            h = self._embd_table[tokens.to(self.device)].float()
        else:
            t = self._embd_info
            h = dequantize_rows(self.g.raw(t.name), t.ggml_type, self.cfg.n_embd, tokens.cpu()).to(self.device)
        return h * self.cfg.embed_scale if self.cfg.embed_scale != 1.0 else h

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Hidden states [R, n_embd] -> float32 logits [R, n_vocab]."""
        x = self._norm(h, self.output_norm)
        out = self.output(x.to(self.dtype)).float()
        if self.output.scale is not None and out.shape[-1] > RESCORE_TOP:  # int8 head
            top = out.topk(RESCORE_TOP, dim=-1).indices
            t = self._tensor(self._head_name)
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
        runs = self._runs(slots, positions)
        if self.graphs is not None and all(n == 1 for _, _, n in runs):
            out = self.graphs.run(h, slots, positions)
            if out is not None:
                return out
        return self._forward(h, slots.to(self.device), positions.to(self.device), runs)

    def _runs(self, slots: torch.Tensor, positions: torch.Tensor) -> list[tuple[int, int, int]]:
        """(slot, first position, length) of each slot's contiguous token run; checks the batch."""
        s, p = slots.tolist(), positions.tolist()
        runs, i = [], 0
        while i < len(s):
            j = i + 1
            while j < len(s) and s[j] == s[i]:
                if p[j] != p[j - 1] + 1:
                    raise ValueError(f"positions of slot {s[i]} must increase by one within a batch")
                j += 1
            if not 0 <= s[i] < self.n_slots:
                raise UserError(f"slot {s[i]} does not exist (this stage has {self.n_slots} slots)")
            if p[i] < 0 or p[j - 1] >= self.n_ctx:
                raise UserError(f"prompt too long: position {p[j - 1]} is beyond the context of {self.n_ctx} tokens")
            runs.append((s[i], p[i], j - i))
            i = j
        return runs

    def _forward(self, h, slots, positions, runs, batched: bool = False, kv_len: int | None = None):
        """The layers, eagerly. `batched`: one token per slot, attention over gathered caches of
        length `kv_len` with a mask from positions (no host values: CUDA-graph capturable).
        Q and K travel together through norm and RoPE: fewer, larger kernels."""
        cfg = self.cfg
        T, n_q, qk_dim = h.shape[0], cfg.n_head, (cfg.n_head + cfg.n_head_kv) * cfg.head_dim
        ropes = {False: self._rope_global, True: self._rope_swa}
        ropes = {w: (cos[positions, None], sin[positions, None]) for w, (cos, sin) in ropes.items()}
        biases = {}
        for layer in self.layers.values():
            x = self._norm(h, layer.attn_norm).to(self.dtype)
            qkv = layer.wqkv(x)
            qk = qkv[:, :qk_dim].float().view(T, -1, cfg.head_dim)
            v = qkv[:, qk_dim:].view(T, cfg.n_head_kv, cfg.head_dim).to(self.dtype)
            if layer.qk_norm is not None:
                qk = F.rms_norm(qk, (cfg.head_dim,), None, cfg.rms_eps) * layer.qk_norm
            qk = self._rotate(qk, *ropes[bool(layer.window)]).to(self.dtype)
            q, k = qk[:, :n_q], qk[:, n_q:]
            if batched:
                if layer.window not in biases:
                    biases[layer.window] = self._decode_bias(positions, kv_len, layer.window)
                o = self._attend_batched(layer, q, k, v, slots, positions, kv_len, biases[layer.window])
            else:
                o = self._attend_runs(layer, q, k, v, runs)
            o = layer.wo(o.reshape(T, -1))
            if layer.post_attn_norm is not None:
                o = self._norm(o, layer.post_attn_norm)
            h = h + o
            x = self._norm(h, layer.ffn_norm).to(self.dtype)
            gate, up = layer.w_gate_up(x).chunk(2, dim=-1)
            act = F.gelu(gate, approximate="tanh") if cfg.activation == "gelu_tanh" else F.silu(gate)
            o = layer.w_down(act * up)
            if layer.post_ffn_norm is not None:
                o = self._norm(o, layer.post_ffn_norm)
            h = h + o
        return h

    def _attend_runs(self, layer: _Layer, q, k, v, runs) -> torch.Tensor:
        """Attention per slot run: write K/V into the cache, attend over the run's visible cache span."""
        outs, i = [], 0
        for slot, p0, n in runs:
            end = p0 + n
            layer.k_cache[slot, :, p0:end] = k[i : i + n].transpose(0, 1)
            layer.v_cache[slot, :, p0:end] = v[i : i + n].transpose(0, 1)
            start = max(0, p0 - layer.window + 1) if layer.window else 0
            keys = layer.k_cache[slot, :, start:end].unsqueeze(0)
            vals = layer.v_cache[slot, :, start:end].unsqueeze(0)
            qr = q[i : i + n].transpose(0, 1).unsqueeze(0)
            windowed = layer.window and n > 1 and end - start > layer.window
            if n == 1:
                mask, causal = None, False
            elif start == 0 and p0 == 0 and not windowed:
                mask, causal = None, True
            else:
                qpos = torch.arange(p0, end, device=q.device)[:, None]
                kpos = torch.arange(start, end, device=q.device)[None, :]
                mask, causal = kpos <= qpos, False
                if layer.window:
                    mask &= kpos > qpos - layer.window
            with sdpa_kernel(_SDPA_BACKENDS):
                o = F.scaled_dot_product_attention(
                    qr, keys, vals, attn_mask=mask, is_causal=causal, scale=self.cfg.attn_scale, enable_gqa=True
                )
            outs.append(o[0].transpose(0, 1))
            i += n
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _decode_bias(self, positions: torch.Tensor, kv_len: int, window: int) -> torch.Tensor:
        """Additive attention mask [B * n_kv, group, kv_len]: 0 where a slot's token may look, -inf elsewhere."""
        cfg = self.cfg
        kpos = torch.arange(kv_len, device=positions.device)[None, :]
        visible = kpos <= positions[:, None]
        if window:
            visible &= kpos > positions[:, None] - window
        bias = torch.zeros(visible.shape, dtype=self.dtype, device=positions.device).masked_fill_(~visible, float("-inf"))
        group = cfg.n_head // cfg.n_head_kv
        return bias[:, None, None, :].expand(-1, cfg.n_head_kv, group, -1).reshape(-1, group, kv_len)

    def _attend_batched(self, layer: _Layer, q, k, v, slots, positions, kv_len: int, bias) -> torch.Tensor:
        """One token per slot: scatter K/V, gather each slot's first `kv_len` cache rows, attend under `bias`.
        Grouped-query heads share their K/V through a batched matmul, not a copy per head."""
        cfg = self.cfg
        layer.k_cache[slots, :, positions] = k
        layer.v_cache[slots, :, positions] = v
        keys = layer.k_cache[slots, :, :kv_len].reshape(-1, kv_len, cfg.head_dim)
        vals = layer.v_cache[slots, :, :kv_len].reshape(-1, kv_len, cfg.head_dim)
        q = q.reshape(keys.shape[0], -1, cfg.head_dim)  # [B * n_kv, group, head_dim]
        scores = torch.baddbmm(bias, q, keys.transpose(1, 2), alpha=cfg.attn_scale)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(vals.dtype)
        return torch.bmm(probs, vals).view(q.shape[0] // cfg.n_head_kv, cfg.n_head, cfg.head_dim)

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), w, self.cfg.rms_eps)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE on the first n_rot dims of each head: x·cos + partner(x)·sin, where the partner of a
        dim is its rotate-half twin (NEOX) or its neighbour in the pair (llama); `sin` carries the signs."""
        n_rot = self.cfg.n_rot
        rot = x[..., :n_rot] if n_rot < x.shape[-1] else x
        if self.cfg.rope_neox:
            partner = rot.roll(n_rot // 2, dims=-1)
        else:
            partner = rot.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
        out = torch.addcmul(rot * cos, partner, sin)
        return out if rot is x else torch.cat([out, x[..., n_rot:]], dim=-1)


class DecodeGraphs:
    """CUDA graphs of one decode step (one token per slot) per batch size, captured on first use.

    Inputs are copied into static buffers (slots and positions through pinned host memory, so the
    host never waits for the device), the graph replays the whole layer stack, and the output
    buffer is cloned out. Attention covers the whole per-slot cache (`n_ctx` rows) under a
    position mask, so one graph serves every position.
    """

    def __init__(self, stage: Stage, max_batch: int | None = None, compiled: bool = False):
        self.stage = stage
        # torch.compile fuses the many small element-wise kernels between the matrix products
        # (norms, casts, RoPE, residual adds); the graph then replays the fused kernels.
        self.forward = torch.compile(stage._forward, dynamic=False) if compiled else stage._forward
        self.max_batch = max_batch or stage.n_slots
        self.graphs: dict[int, tuple] = {}
        self.pool = None

    def reset(self) -> None:
        self.graphs.clear()

    def run(self, h: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        B = h.shape[0]
        if B > self.max_batch or len(set(slots.tolist())) != B:
            return None
        if B not in self.graphs:
            self.graphs[B] = self._capture(B)
        graph, h_in, index, host, copied, out = self.graphs[B]
        copied.synchronize()  # the previous step's copy out of `host` has finished
        host[0].copy_(slots)
        host[1].copy_(positions)
        index.copy_(host, non_blocking=True)
        copied.record()
        h_in.copy_(h)
        graph.replay()
        return out.clone()

    def _capture(self, B: int):
        st = self.stage
        dev = st.device
        h_in = torch.zeros(B, st.cfg.n_embd, device=dev)
        index = torch.stack([torch.arange(B), torch.zeros(B, dtype=torch.long)]).to(dev)  # slots, positions
        host = torch.zeros(2, B, dtype=torch.long).pin_memory()

        def step():
            return self.forward(h_in, index[0], index[1], None, batched=True, kv_len=st.n_ctx)

        # Warm up on a side stream (allocator and kernel selection), as torch's docs prescribe. The
        # warm-up really writes K/V at position 0 of slots 0..B-1: keep those rows and put them back.
        saved = [(layer.k_cache[:B, :, 0].clone(), layer.v_cache[:B, :, 0].clone()) for layer in st.layers.values()]
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):
                step()
        torch.cuda.current_stream(dev).wait_stream(side)
        for layer, (k, v) in zip(st.layers.values(), saved):
            layer.k_cache[:B, :, 0] = k
            layer.v_cache[:B, :, 0] = v
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = step()
        self.pool = graph.pool()
        copied = torch.cuda.Event()
        copied.record()
        return graph, h_in, index, host, copied, out
