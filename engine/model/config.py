"""The model's shape and its architecture's deltas, read from GGUF metadata.

Every supported architecture runs through one transformer implementation; what differs between
them is data: `ARCHITECTURES` lists each one's deltas from the llama baseline.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..errors import UserError
from ..gguf_file import GGUFFile

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


@dataclass(frozen=True)
class ModelConfig:
    """Shape and architecture deltas of one GGUF model; `from_gguf` fills it from the metadata."""

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
