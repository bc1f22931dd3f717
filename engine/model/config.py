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
    # Hybrid: Gated DeltaNet layers, and every `full_attention_interval`-th layer a full-attention
    # layer whose Q projection also carries a sigmoid output gate. The FFN's input norm is named
    # post_attention_norm; RoPE is IMROPE over the first `rope.dimension_count` dims.
    "qwen35": {
        "rope_neox": True,
        "qk_norm": True,
        "attn_gate": True,
        "deltanet": True,
        "ffn_norm": "post_attention_norm",
    },
}
# Architectures llama.cpp has that we name in errors rather than calling them unknown.
NOT_YET = {"qwen35moe": "the MoE variant of Qwen3.5 (qwen35moe) is not supported yet; its dense sibling qwen35 is"}


@dataclass(frozen=True)
class DeltaNetShape:
    """Dimensions of the Gated DeltaNet layers (llama.cpp's ssm.* keys)."""

    conv_kernel: int  # ssm.conv_kernel: taps of the causal conv1d over Q, K, V
    head_k_dim: int  # ssm.state_size
    n_k_heads: int  # ssm.group_count (Q and K heads)
    n_v_heads: int  # ssm.time_step_rank (V heads; each reads K/Q head `v % n_k_heads`)
    head_v_dim: int  # ssm.inner_size / n_v_heads

    @property
    def conv_channels(self) -> int:
        return 2 * self.n_k_heads * self.head_k_dim + self.n_v_heads * self.head_v_dim


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
    attn_gate: bool = False  # Q projection interleaves [q, gate] per head; output *= sigmoid(gate)
    ffn_norm: str = "ffn_norm"  # tensor name of the FFN's input norm
    recurrent_layers: tuple[bool, ...] = field(default=())  # True: a Gated DeltaNet layer
    deltanet: DeltaNetShape | None = None
    # Rotary pairs that turn with the token's position (IMROPE text positions are [p, p, p, 0]:
    # pairs of the fourth section turn by 0); empty: all of them.
    rope_pair_moves: tuple[bool, ...] = field(default=())

    @property
    def recurrent(self) -> bool:
        return any(self.recurrent_layers)

    @classmethod
    def from_gguf(cls, g: GGUFFile) -> ModelConfig:
        arch = g.architecture
        if arch in NOT_YET:
            raise UserError(f"{g.path}: {NOT_YET[arch]}")
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

        # block_count includes the NextN (multi-token prediction) blocks, stored after the trunk.
        n_layers = int(key("block_count", required=True)) - int(key("nextn_predict_layers", 0) or 0)
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
        n_rot = int(key("rope.dimension_count", head_dim))
        deltanet, recurrent, pair_moves = None, (False,) * n_layers, ()
        if delta.get("deltanet"):
            deltanet = DeltaNetShape(
                conv_kernel=int(key("ssm.conv_kernel", required=True)),
                head_k_dim=int(key("ssm.state_size", required=True)),
                n_k_heads=int(key("ssm.group_count", required=True)),
                n_v_heads=int(key("ssm.time_step_rank", required=True)),
                head_v_dim=int(key("ssm.inner_size", required=True)) // int(key("ssm.time_step_rank")),
            )
            if deltanet.n_v_heads % deltanet.n_k_heads or deltanet.head_k_dim != deltanet.head_v_dim:
                raise UserError(f"{g.path}: DeltaNet needs V heads a multiple of K heads and equal head sizes")
            given = key("attention.recurrent_layers")
            if given is not None:
                recurrent = tuple(bool(x) for x in list(given)[:n_layers])
            else:
                interval = int(key("full_attention_interval", 4))
                recurrent = tuple((il + 1) % interval != 0 for il in range(n_layers))
            pair_moves = _imrope_text_pairs(list(key("rope.dimension_sections", required=True)), n_rot)
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
            n_rot=n_rot,
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
            attn_gate=delta.get("attn_gate", False),
            ffn_norm=delta.get("ffn_norm", "ffn_norm"),
            recurrent_layers=recurrent,
            deltanet=deltanet,
            rope_pair_moves=pair_moves,
        )


def _imrope_text_pairs(sections: list[int], n_rot: int) -> tuple[bool, ...]:
    """Which rotary pairs turn with a text token's position under ggml's interleaved M-RoPE: pair i
    is in sector i % sum(sections) and reads position t, h or w (all = p for text) by sector % 3
    within the first three sections' reach, else the fourth position (0 for text)."""
    total = sum(sections[:4])
    moves = []
    for i in range(n_rot // 2):
        s = i % total
        moves.append(s < 3 * sections[s % 3])
    return tuple(moves)
