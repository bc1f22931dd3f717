"""One transformer block: its weights and KV cache or recurrent state (`Layer`), and `block`, the
arithmetic of one layer over a `ForwardBatch`.

`block` is a function of the layer, not a method: torch.compile traces it once per layer kind
(global, windowed, recurrent) and every layer of that kind reuses the trace (`graphs.DecodeGraphs`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels.qweight import QuantWeight
from .attention import attend
from .config import ModelConfig
from .deltanet import DeltaNet
from .forward_batch import ForwardBatch, Mode
from .kv_blocks import KVBlocks
from .kv_cache import KVCache
from .rope import rotate
from .weights import Linear, QuantLinear, Weights


class Layer:
    """Weights and KV cache (or recurrent state: `n_slots` rows, `depth` checkpoints each, one row
    more with `padding`, the CUDA graphs' padding slot) of transformer block `il`; its KV in
    `kv_blocks`, of the cache types `kv_types` (K, V)."""

    def __init__(
        self,
        cfg: ModelConfig,
        weights: Weights,
        il: int,
        kv_blocks: KVBlocks,
        kv_types: tuple[str, str],
        n_slots: int,
        depth: int,
        padding: bool,
    ):
        w, vec = weights, weights.vector
        p = f"blk.{il}."
        self.cfg, self.dtype = cfg, weights.dtype
        self.window = cfg.sliding_window if cfg.swa_layers[il] else 0
        self.attn_norm = vec(p + "attn_norm.weight")
        self.ffn_norm = vec(p + cfg.ffn_norm + ".weight")
        self.w_gate_up = w.linear([p + "ffn_gate.weight", p + "ffn_up.weight"])
        self.w_down = w.linear([p + "ffn_down.weight"])
        self.post_ffn_norm = vec(p + "post_ffw_norm.weight") if cfg.post_norms else None
        self.deltanet = DeltaNet(cfg, w, p, n_slots, depth, padding) if cfg.recurrent_layers[il] else None
        if self.deltanet is None:
            self._attention(weights, p, kv_blocks, kv_types)

    def _attention(self, w: Weights, p: str, kv_blocks: KVBlocks, kv_types: tuple[str, str]) -> None:
        cfg, vec = self.cfg, w.vector
        qkv = [p + n for n in ("attn_q", "attn_k", "attn_v")]
        self.wqkv = w.linear([n + ".weight" for n in qkv], [n + ".bias" for n in qkv] if cfg.qkv_bias else [])
        self.wo = w.linear([p + "attn_output.weight"])
        # Q and K heads are normalised together: one weight row per head, [n_head + n_head_kv, head_dim].
        self.qk_norm = None
        if cfg.qk_norm:
            q_w, k_w = vec(p + "attn_q_norm.weight"), vec(p + "attn_k_norm.weight")
            self.qk_norm = torch.cat([q_w.expand(cfg.n_head, -1), k_w.expand(cfg.n_head_kv, -1)])
        self.post_attn_norm = vec(p + "post_attention_norm.weight") if cfg.post_norms else None
        self.kv = KVCache(
            kv_blocks,
            cfg.n_head_kv,
            cfg.head_dim,
            compute=w.dtype,
            device=w.device,
            k_type=kv_types[0],
            v_type=kv_types[1],
        )

    @property
    def nbytes(self) -> int:
        mixer = self.deltanet.nbytes if self.deltanet else self.wqkv.nbytes + self.wo.nbytes
        return mixer + self.w_gate_up.nbytes + self.w_down.nbytes

    def state_tensors(self) -> tuple[torch.Tensor, ...]:
        """What the layer holds per slot: K and V, or the recurrent state with its checkpoints."""
        net = self.deltanet
        if net is None:
            return self.kv.tensors()
        return net.conv_state, net.ssm_state, net.conv_ckpt, net.ssm_ckpt


def collect_storages(obj, out: dict[int, int]) -> None:
    """{storage pointer: bytes} of every tensor in `obj`, through containers and the model's weight
    holders (not a layer's KV cache: `kv_bytes` counts it)."""
    if isinstance(obj, torch.Tensor):
        if not obj.is_pinned():  # the host's (the embedding table): no device memory
            out[obj.untyped_storage().data_ptr()] = obj.untyped_storage().nbytes()
    elif isinstance(obj, dict):
        collect_storages(list(obj.values()), out)
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            collect_storages(x, out)
    elif isinstance(obj, (Layer, DeltaNet, Linear, QuantLinear, QuantWeight)):
        collect_storages([v for v in vars(obj).values() if not isinstance(v, KVCache)], out)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x.float(), (x.shape[-1],), w, eps)


def block(layer: Layer, h: torch.Tensor, rope, batch: ForwardBatch, bias) -> torch.Tensor:
    """One layer over `batch`: h [T, n_embd] float32 -> same. `rope`: (cos, sin) at the batch's
    positions for this layer's kind; `bias`: `attention.attend`'s. Q and K travel together through
    norm and RoPE: fewer, larger kernels."""
    cfg, dtype = layer.cfg, layer.dtype
    T, n_q, qk_dim = h.shape[0], cfg.n_head, (cfg.n_head + cfg.n_head_kv) * cfg.head_dim
    x = rms_norm(h, layer.attn_norm, cfg.rms_eps).to(dtype)
    if layer.deltanet is not None:
        if batch.mode is Mode.BATCHED:
            return _ffn(layer, h + layer.deltanet.step(x, batch.slots, batch.per_slot))
        return _ffn(layer, h + layer.deltanet(x, batch))
    qkv = layer.wqkv(x)
    gate = None
    if cfg.attn_gate:  # Q rows come as [q, gate] per head: split the gate off
        qg = qkv[:, : 2 * n_q * cfg.head_dim].view(T, n_q, 2, cfg.head_dim)
        gate = qg[:, :, 1]
        qkv = torch.cat([qg[:, :, 0].reshape(T, -1), qkv[:, 2 * n_q * cfg.head_dim :]], dim=1)
    qk = qkv[:, :qk_dim].float().view(T, -1, cfg.head_dim)
    v = qkv[:, qk_dim:].view(T, cfg.n_head_kv, cfg.head_dim).to(dtype)
    if layer.qk_norm is not None:
        qk = F.rms_norm(qk, (cfg.head_dim,), None, cfg.rms_eps) * layer.qk_norm
    qk = rotate(cfg, qk, *rope).to(dtype)
    q, k = qk[:, :n_q], qk[:, n_q:]
    o = attend(cfg, layer.kv, layer.window, q, k, v, batch, bias)
    if gate is not None:
        o = o * torch.sigmoid(gate.float()).to(o.dtype)
    o = layer.wo(o.reshape(T, -1))
    if layer.post_attn_norm is not None:
        o = rms_norm(o, layer.post_attn_norm, cfg.rms_eps)
    return _ffn(layer, h + o)


def _ffn(layer: Layer, h: torch.Tensor) -> torch.Tensor:
    cfg = layer.cfg
    x = rms_norm(h, layer.ffn_norm, cfg.rms_eps).to(layer.dtype)
    gate, up = layer.w_gate_up(x).chunk(2, dim=-1)
    act = F.gelu(gate, approximate="tanh") if cfg.activation == "gelu_tanh" else F.silu(gate)
    o = layer.w_down(act.mul_(up))  # in place: one [T, n_ff] buffer less at a prompt's peak
    if layer.post_ffn_norm is not None:
        o = rms_norm(o, layer.post_ffn_norm, cfg.rms_eps)
    return h + o
