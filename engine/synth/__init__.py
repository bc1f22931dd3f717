"""Random-weight GGUF files of any supported architecture and shape.

Tiny ones make the fast tests; big ones (e.g. the 1.1B llama shape) make GPU benchmarks
where the real model cannot be copied. Weights are scaled by 1/sqrt(fan_in) so that the
activations of a few layers stay in a sane range; norm weights sit near 1. Each file
carries a small but complete tokenizer of the family the architecture uses: SPM for
llama/gemma3, byte-level BPE for qwen2/qwen3/qwen35.

qwen35 files follow llama.cpp's loader (src/models/qwen35.cpp) key for key and tensor for tensor,
so llama.cpp itself loads them (the reference logits under tests/data/reference come from that).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as T

from .blocks import K_QUANTS, check_row, random_blocks
from .vocab import tiny_vocab

ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3", "qwen35")

# The users' model (issue 37): Qwen3.5-27B's shape as llama.cpp's Q5_K_M mix, a trunk that follows
# a bigram table and a NextN block that predicts it exactly (MTP acceptance 1 at p-min 0), and a
# training context llama-server does not cap a 96K slot at. `python -m hydra_console.engine.synth`.
QWEN35_27B = dict(
    arch="qwen35",
    n_layers=64,
    n_embd=5120,
    n_head=24,
    n_head_kv=4,
    head_dim=256,
    n_ff=17408,
    vocab_size=248320,
    ssm_state=128,
    ssm_groups=16,
    ssm_v_heads=48,
    conv_kernel=4,
    full_attention_interval=4,
    qtype="Q5_K_M",
    bigram=True,
    nextn=True,
    n_ctx=262144,
)
SHAPES = {"qwen35-27b": QWEN35_27B}

FIM_TOKENS = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")
# llama.cpp's converter writes it into every Qwen3 reranker (conversion/qwen.py, Qwen3Model)
QWEN3_RERANK_TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
    'provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
    "<|im_start|>user\n<Instruct>: Given a web search query, retrieve relevant passages that answer the query\n"
    "<Query>: {query}\n<Document>: {document}<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n"
)


def write_synthetic(
    path,
    arch: str = "llama",
    n_layers: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    head_dim: int | None = None,
    n_ff: int = 128,
    n_ctx: int = 512,
    qtype="F32",
    seed: int = 0,
    vocab: str = "tiny",
    vocab_size: int | None = None,
    tied: bool | None = None,
    sliding_window: int = 8,
    n_rot: int | None = None,
    full_attention_interval: int = 2,
    rope_sections: tuple[int, int, int, int] = (2, 2, 2, 2),
    ssm_state: int = 16,
    ssm_groups: int = 2,
    ssm_v_heads: int = 4,
    conv_kernel: int = 4,
    nextn: bool = False,
    bigram: bool = False,
    mtp_accuracy: float = 1.0,
    logit_scale: float = 1.0,
    fim: bool = False,
    reranker: bool = False,
    header_only: bool = False,
) -> Path:
    """Write a random-weight GGUF and return its path.

    `qtype` (name or GGMLQuantizationType) applies to the 2-D weights; norms and biases stay F32.
    `Q4_K_M` / `Q5_K_M` write llama.cpp's mixes: Q6_K for the output head, every `attn_v` and the
    `ffn_down` of every other layer, the named K-quant elsewhere.
    `vocab_size` pads the tiny vocabulary with generated pieces (big shapes). `tied` (default: only
    gemma3) leaves out `output.weight` so the output head reuses the token embedding.
    `sliding_window` is gemma3's window; it is small by default so tests exercise it.
    qwen35: every `full_attention_interval`-th layer is full attention, the others Gated DeltaNet
    (`ssm_groups` Q/K heads and `ssm_v_heads` V heads of `ssm_state` dims, a conv of `conv_kernel`
    taps); `n_rot` (default head_dim / 4, as Qwen3.5's partial rotary) and IMROPE `rope_sections`
    (the default's fourth section leaves the last pairs unrotated for text, which tests that rule);
    `nextn` adds Qwen3.5's multi-token-prediction block as layer `n_layers` (written last, so the
    trunk's weights are those of the same file without it).
    `bigram` zeroes what every block writes into the residual stream (`attn_output`, `ssm_out`,
    `ffn_down`), so a position's logits depend on its token alone; with `nextn` the MTP block then
    passes the token's embedding through (`eh_proj` = [I 0], `enorm` = 1, no `shared_head_norm`) and
    predicts exactly the trunk's next token: MTP drafts the target accepts (tests, benches).
    `mtp_accuracy` < 1 (with `bigram` and `nextn`) gives the block its own output head
    (`shared_head_head`): the trunk's with the rows of a random (1 - mtp_accuracy) share of the
    vocabulary rotated among themselves, so the block's pick is the trunk's next token t exactly when
    t is outside that share: a draft token is right with that chance. `logit_scale` multiplies the
    output head (untied files): the logits' spread, so how peaked the next-token distribution is
    (a `bigram` trunk at scale 1 is nearly flat: top probability ~0.05 at temperature 0.7, ~0.6 at
    scale 4), which sampled speculation's acceptance follows. `fim` adds Qwen's fill-in-the-middle
    control tokens (<|fim_prefix|>, <|fim_suffix|>, <|fim_middle|>) to the vocabulary.
    `reranker` (qwen3) makes a Qwen3 reranker as llama.cpp's converter writes one: pooling type rank,
    the classifier labels ["yes", "no"], the `rerank` chat template, and `cls.output.weight` [2, n_embd]
    (random rows where the converter takes the LM head's "yes" and "no" rows; written last, so the
    other weights are those of the same file without it).
    `header_only` writes the metadata and the tensor table and no weights: the file is extended to
    its full size as a hole (sparse: a 27B shape takes a few MB of disk and no time), so readers of
    the header (the footprint, the console's split plan) see the real model's shapes; its data reads
    as zeros.
    """
    if arch not in ARCHITECTURES:
        raise ValueError(f"unsupported architecture {arch!r}; choose one of {', '.join(ARCHITECTURES)}")
    if not 0.0 <= mtp_accuracy <= 1.0 or (mtp_accuracy < 1.0 and not (nextn and bigram)):
        raise ValueError(f"mtp_accuracy must be in [0, 1] and needs nextn and bigram, got {mtp_accuracy!r}")
    if logit_scale <= 0 or (logit_scale != 1.0 and (tied if tied is not None else arch == "gemma3")):
        raise ValueError(f"logit_scale must be > 0 and needs an untied output head, got {logit_scale!r}")
    if vocab != "tiny":
        raise ValueError(f"unknown vocabulary kind {vocab!r} (only 'tiny')")
    mix = isinstance(qtype, str) and qtype.upper() in _MIXES
    qt = T[_MIXES[qtype.upper()] if mix else qtype.upper()] if isinstance(qtype, str) else T(qtype)

    def type_of(name: str) -> T:
        if mix and (
            name == "output.weight" or ".attn_v." in name or (".ffn_down." in name and int(name.split(".")[1]) % 2 == 0)
        ):
            return T.Q6_K
        return qt

    head_dim = head_dim or n_embd // n_head
    if n_head % n_head_kv:
        raise ValueError(f"n_head {n_head} is not a multiple of n_head_kv {n_head_kv}")
    tied = arch == "gemma3" if tied is None else tied
    rng = np.random.default_rng(seed)
    path = Path(path)

    tokens, scores, types, merges, special = tiny_vocab(arch, vocab_size)
    if fim:
        tokens, scores = tokens + list(FIM_TOKENS), scores + [-1000.0] * len(FIM_TOKENS)
        types = types + [gguf.TokenType.CONTROL] * len(FIM_TOKENS)
    n_vocab = len(tokens)

    w = (_TableWriter if header_only else gguf.GGUFWriter)(str(path), arch)
    w.add_name(f"synthetic-{arch}")
    w.add_context_length(n_ctx)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layers + int(nextn))
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(1e-5 if arch == "llama" else 1e-6)
    w.add_file_type(_file_type(qt))
    if arch == "gemma3":
        w.add_rope_freq_base(1_000_000.0)
        w.add_sliding_window(sliding_window)
    elif arch == "qwen35":
        w.add_rope_freq_base(10_000_000.0)
        w.add_rope_dimension_count(n_rot or head_dim // 4)
        w.add_rope_dimension_sections(list(rope_sections))
        w.add_full_attention_interval(full_attention_interval)
        w.add_ssm_conv_kernel(conv_kernel)
        w.add_ssm_state_size(ssm_state)
        w.add_ssm_group_count(ssm_groups)
        w.add_ssm_time_step_rank(ssm_v_heads)
        w.add_ssm_inner_size(ssm_state * ssm_v_heads)
        if nextn:
            w.add_nextn_predict_layers(1)
    else:
        w.add_rope_freq_base(10_000.0 if arch == "llama" else 1_000_000.0)
        w.add_rope_dimension_count(head_dim)

    if arch in ("llama", "gemma3"):
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_add_space_prefix(arch == "llama")
        w.add_add_bos_token(True)
    else:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(arch if arch == "qwen35" else "qwen2")
        w.add_token_merges(merges)
        w.add_add_bos_token(False)
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    for key, tok in special.items():
        getattr(w, f"add_{key}_token_id")(tokens.index(tok))

    def dense(name: str, rows: int, cols: int, std: float) -> tuple[np.ndarray, T | None]:
        """Writes the weight; returns what was written (rows first) and its raw type."""
        qt = type_of(name)
        zero = bigram and name.endswith(("attn_output.weight", "ssm_out.weight", "ffn_down.weight"))
        eye = bigram and name.endswith("nextn.eh_proj.weight")
        if eye and qt in K_QUANTS:  # random K-quant blocks cannot hold the identity the construction needs
            qt = T.F16
        if header_only:  # the shape and type only: no data is made
            check_row(name, cols, qt)
            block, size = GGML_QUANT_SIZES[qt]
            w.add_tensor_info(name, (rows, cols), np.dtype(np.float32), rows * cols // block * size, raw_dtype=qt)
            return
        if qt in K_QUANTS and not (zero or eye):  # random blocks need only the std: no float matrix (27B files)
            check_row(name, cols, qt)
            data = random_blocks((rows, cols), qt, std, rng)
            w.add_tensor(name, data, raw_dtype=qt)
            return data, qt
        if zero:
            x = np.zeros((rows, cols), np.float32)
        elif eye:
            x = np.eye(rows, cols, dtype=np.float32)
        else:
            x = rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(std)
        return _add_weight(w, name, x, qt, rng)

    def vec(name: str, n: int, center: float = 1.0, spread: float = 0.1) -> None:
        x = (center + spread * rng.standard_normal(n)).astype(np.float32)
        w.add_tensor(name, np.ones(n, np.float32) if bigram and name.endswith("nextn.enorm.weight") else x)

    head = dense("token_embd.weight", n_vocab, n_embd, 1.0 / np.sqrt(n_embd) if arch == "gemma3" else 1.0)
    vec("output_norm.weight", n_embd)
    if not tied:
        head = dense("output.weight", n_vocab, n_embd, logit_scale / np.sqrt(n_embd))
    q_dim, kv_dim = n_head * head_dim, n_head_kv * head_dim
    if nextn and arch != "qwen35":
        raise ValueError("only qwen35 files carry a NextN block here")
    if reranker and arch != "qwen3":
        raise ValueError("only qwen3 files are written as rerankers here")
    for i in range(n_layers + int(nextn)):
        p = f"blk.{i}."
        vec(p + "attn_norm.weight", n_embd)
        if i == n_layers:  # the NextN block: a gated-attention block fed by eh_proj([enorm(e); hnorm(h)])
            dense(p + "nextn.eh_proj.weight", n_embd, 2 * n_embd, 1.0 / np.sqrt(2 * n_embd))
            for name in ("enorm", "hnorm") if bigram else ("enorm", "hnorm", "shared_head_norm"):
                vec(p + f"nextn.{name}.weight", n_embd)
            if mtp_accuracy < 1.0:
                rows, raw = head
                wrong = np.random.default_rng(seed + 1).permutation(n_vocab)[: round((1 - mtp_accuracy) * n_vocab)]
                order = np.arange(n_vocab)
                order[wrong] = np.roll(wrong, 1)
                w.add_tensor(p + "nextn.shared_head_head.weight", rows[order], raw_dtype=raw)
        if arch == "qwen35":
            if (i + 1) % full_attention_interval and i < n_layers:
                _deltanet_tensors(w, p, n_embd, ssm_state, ssm_groups, ssm_v_heads, conv_kernel, dense, vec, rng)
            else:
                dense(p + "attn_q.weight", 2 * q_dim, n_embd, 1.0 / np.sqrt(n_embd))  # per head: q, then its gate
                dense(p + "attn_k.weight", kv_dim, n_embd, 1.0 / np.sqrt(n_embd))
                dense(p + "attn_v.weight", kv_dim, n_embd, 1.0 / np.sqrt(n_embd))
                dense(p + "attn_output.weight", n_embd, q_dim, 0.5 / np.sqrt(q_dim))
                vec(p + "attn_q_norm.weight", head_dim)
                vec(p + "attn_k_norm.weight", head_dim)
            vec(p + "post_attention_norm.weight", n_embd)  # the FFN's input norm in qwen35
            _ffn_tensors(p, n_embd, n_ff, dense, vec, with_norm=False)
            continue
        dense(p + "attn_q.weight", q_dim, n_embd, 1.0 / np.sqrt(n_embd))
        dense(p + "attn_k.weight", kv_dim, n_embd, 1.0 / np.sqrt(n_embd))
        dense(p + "attn_v.weight", kv_dim, n_embd, 1.0 / np.sqrt(n_embd))
        dense(p + "attn_output.weight", n_embd, q_dim, 0.5 / np.sqrt(q_dim))
        if arch == "qwen2":
            for name, n in (("attn_q", q_dim), ("attn_k", kv_dim), ("attn_v", kv_dim)):
                vec(p + name + ".bias", n, center=0.0, spread=0.1)
        if arch in ("qwen3", "gemma3"):
            vec(p + "attn_q_norm.weight", head_dim)
            vec(p + "attn_k_norm.weight", head_dim)
        if arch == "gemma3":
            vec(p + "post_attention_norm.weight", n_embd)
            vec(p + "post_ffw_norm.weight", n_embd)
        _ffn_tensors(p, n_embd, n_ff, dense, vec, with_norm=True)
    if reranker:
        w.add_pooling_type(gguf.PoolingType.RANK)
        w.add_classifier_output_labels(["yes", "no"])
        w.add_chat_template([{"name": "rerank", "template": QWEN3_RERANK_TEMPLATE}])
        dense("cls.output.weight", 2, n_embd, 1.0 / np.sqrt(n_embd))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    if header_only:
        w.write_table_and_hole()
    else:
        w.write_tensors_to_file()
    w.close()
    return path


class _TableWriter(gguf.GGUFWriter):
    """A writer of the tensor table alone (`header_only`): `add_tensor` records a tensor's shape and
    type, and the data region becomes a hole of its size."""

    def add_tensor(self, name, tensor, raw_shape=None, raw_dtype=None, tensor_endianess=None) -> None:
        self.add_tensor_info(name, raw_shape or tensor.shape, tensor.dtype, tensor.nbytes, raw_dtype=raw_dtype)

    def write_table_and_hole(self) -> None:
        self.write_ti_data_to_file()
        (fout,) = self.fout
        start = self.ggml_pad(fout.tell(), self.data_alignment)
        fout.truncate(start + sum(self.ggml_pad(ti.nbytes, self.data_alignment) for ti in self.tensors[0].values()))


_MIXES = {"Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K"}


def _ffn_tensors(p: str, n_embd: int, n_ff: int, dense, vec, with_norm: bool) -> None:
    if with_norm:
        vec(p + "ffn_norm.weight", n_embd)
    dense(p + "ffn_gate.weight", n_ff, n_embd, 1.0 / np.sqrt(n_embd))
    dense(p + "ffn_up.weight", n_ff, n_embd, 1.0 / np.sqrt(n_embd))
    dense(p + "ffn_down.weight", n_embd, n_ff, 0.5 / np.sqrt(n_ff))


def _deltanet_tensors(w, p, n_embd, d_state, n_k, n_v, kernel, dense, vec, rng) -> None:
    """One Gated DeltaNet layer as llama.cpp's qwen35 loader names and shapes it (torch order)."""
    value_dim = n_v * d_state
    channels = 2 * n_k * d_state + value_dim
    dense(p + "attn_qkv.weight", channels, n_embd, 1.0 / np.sqrt(n_embd))
    dense(p + "attn_gate.weight", value_dim, n_embd, 1.0 / np.sqrt(n_embd))  # z, the output gate
    dense(p + "ssm_beta.weight", n_v, n_embd, 1.0 / np.sqrt(n_embd))
    dense(p + "ssm_alpha.weight", n_v, n_embd, 1.0 / np.sqrt(n_embd))
    # Small rows (kernel taps, per-head scalars) stay F32 in any file type, as in converted models.
    w.add_tensor(
        p + "ssm_conv1d.weight", (rng.standard_normal((channels, kernel)) / np.sqrt(kernel)).astype(np.float32)
    )
    vec(p + "ssm_dt.bias", n_v, center=0.0, spread=0.5)
    w.add_tensor(p + "ssm_a", (-np.exp(rng.uniform(-1.0, 0.5, n_v))).astype(np.float32))  # -exp(A_log)
    vec(p + "ssm_norm.weight", d_state)
    dense(p + "ssm_out.weight", n_embd, value_dim, 0.5 / np.sqrt(value_dim))


def _file_type(qt: T) -> int:
    by_type = {T.F32: gguf.LlamaFileType.ALL_F32, T.F16: gguf.LlamaFileType.MOSTLY_F16}
    if qt in by_type:
        return int(by_type[qt])
    try:
        return int(gguf.LlamaFileType[f"MOSTLY_{qt.name}"])
    except KeyError:
        return int(gguf.LlamaFileType.GUESSED)


def _add_weight(
    w: gguf.GGUFWriter, name: str, x: np.ndarray, qt: T, rng: np.random.Generator
) -> tuple[np.ndarray, T | None]:
    """Writes `x` as `qt`; returns what was written and its raw type (None: numpy's own)."""
    check_row(name, x.shape[1], qt)
    if qt == T.F32:
        data, raw = x, None
    elif qt in K_QUANTS:
        data, raw = random_blocks(x.shape, qt, float(x.std()), rng), qt
    else:
        try:
            data = gguf.quants.quantize(x, qt)
        except NotImplementedError:
            raise ValueError(f"synthetic weights cannot be written as {qt.name}") from None
        raw = qt if qt != T.F16 else None
    w.add_tensor(name, data, raw_dtype=raw)
    return data, raw
