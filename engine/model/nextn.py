"""Qwen3.5's multi-token-prediction block (`blk.{n_layers}.nextn.*`), run on the head.

As llama.cpp's `qwen35` MTP graph (src/models/qwen35.cpp, `graph_mtp`): for a token x at position
p and the trunk's hidden state h of position p - 1 *after* the output norm (llama.cpp's `h_nextn`),

    y = eh_proj([enorm(embed(x)); hnorm(h)])        (embedding half first)
    y = one gated full-attention block (its own KV per slot, IMROPE at p) + its FFN
    h' = shared_head_norm(y)   (else the trunk's output_norm)
    logits = shared_head_head(h')   (else the trunk's output head)

and h' is what the next chained draft step takes as its h. The block's attention layer is built
by the one `Stage` implementation as layer `n_layers` of a config one attention layer longer, so its
KV cache, RoPE and attention are the trunk's own code. Embedding and output head are the head
stage's (no second copy of the vocabulary-sized tables).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from ..errors import UserError
from .stage import Stage
from .weights import Linear, QuantLinear

# Rows up to which the MTP block's input projection keeps float32 activations on a GPU (`NextN._project_in`).
PRECISE_ROWS = 16


def nextn_prefix(g, n_layers: int) -> str | None:
    """`blk.{n_layers}.nextn.` when the file carries an MTP block there, else None."""
    p = f"blk.{n_layers}.nextn."
    return p if p + "eh_proj.weight" in g.tensors else None


class NextN:
    """The MTP block of `head`'s model, with a KV cache of `head.n_slots` x `head.n_ctx`."""

    def __init__(self, head: Stage):
        cfg, w = head.cfg, head.weights
        if not (head.has_embed and head.has_head):
            raise UserError("the MTP block runs on the head: its stage needs the embedding and the output head")
        il = cfg.n_layers
        p = nextn_prefix(head.g, il)
        if p is None:
            raise UserError(f"{head.g.path}: no MTP block (tensor 'blk.{il}.nextn.eh_proj.weight' is missing)")
        if p + "embed_tokens.weight" in head.g.tensors:
            raise UserError(
                f"{head.g.path}: an MTP block with its own embedding ({p}embed_tokens) is not supported yet"
            )
        self.head = head
        block_cfg = dataclasses.replace(
            cfg, n_layers=il + 1, recurrent_layers=cfg.recurrent_layers + (False,), swa_layers=cfg.swa_layers + (False,)
        )
        self.block = Stage(
            block_cfg,
            w,
            (il, il + 1),
            embed=False,
            head=False,
            n_slots=head.n_slots,
            n_ctx=head.n_ctx,
            kv_types=head.kv_types,  # the block's KV in the head's cache types (q8_0: half of bf16's)
            kv_pool=head.kv_pool,
            rope_of=head,
        )
        # On CPU the input projection is float32 whatever the compute dtype: the int8 and 16-bit
        # kernels there take 16-bit rows only (`_project_in`).
        cpu = head.device.type == "cpu"
        self.eh_proj = Linear(w.f32(p + "eh_proj.weight").contiguous()) if cpu else w.linear([p + "eh_proj.weight"])
        self.enorm, self.hnorm = w.vector(p + "enorm.weight"), w.vector(p + "hnorm.weight")
        has = lambda name: p + name + ".weight" in head.g.tensors  # noqa: E731
        self.head_norm = w.vector(p + "shared_head_norm.weight") if has("shared_head_norm") else head.output_norm
        self.own_head = w.linear([p + "shared_head_head.weight"], terms=1) if has("shared_head_head") else None

    def run(self, tokens, h_prev: torch.Tensor, slots, positions) -> torch.Tensor:
        """Tokens [T] with the trunk's (or the previous draft step's) normed hidden state of the
        position before each: writes the block's KV, returns its normed output h' [T, n_embd]."""
        return self.step(tokens, h_prev, lambda x: self.block.run_layers(x, slots, positions))

    def step(self, tokens, h_prev: torch.Tensor, layer) -> torch.Tensor:
        """`run` with the block's layer given as `layer(x) -> y` (the draft chain's graph passes the
        block's graph-capturable forward over a fixed batch)."""
        d, eps = self.head.cfg.n_embd, self.head.cfg.rms_eps
        e = self.head.embed(tokens)
        h_prev = h_prev.to(e.device, torch.float32)
        x = torch.cat([F.rms_norm(e, (d,), self.enorm, eps), F.rms_norm(h_prev, (d,), self.hnorm, eps)], dim=-1)
        return F.rms_norm(layer(self._project_in(x)), (d,), self.head_norm, eps)

    def chain(self, tokens: torch.Tensor, h: torch.Tensor, k: int, layer_at, top_k: int):
        """k greedy draft steps from `tokens` [B] (device) and the hidden states before them: each
        step's argmax (the lowest id among ties, as the target's greedy pick) feeds the next step's
        embedding on the device. `layer_at(step)` is the block's layer for that step's positions.
        Returns the picks [B, k] and each pick's probability over the top `top_k` logits [B, k]
        (`top_k` 0: no p-min reads them, and the 248k-wide top-k per step is skipped: ones)."""
        picks, probs = [], []
        for step in range(k):
            h = self.step(tokens, h, layer_at(step))
            logits = self.logits(h)
            tokens = logits.argmax(-1)
            picks.append(tokens)
            if top_k:
                top = logits.float().topk(min(top_k, logits.shape[-1]), dim=-1).values
                probs.append(torch.softmax(top, dim=-1)[:, 0])
        picks = torch.stack(picks, 1)
        return picks, torch.stack(probs, 1) if top_k else torch.ones(picks.shape, device=picks.device)

    def _project_in(self, x: torch.Tensor) -> torch.Tensor:
        """eh_proj(x) for x [T, 2 n_embd] float32 -> float32, with x kept in float32 as llama.cpp's
        one-row mat-vec takes it. Rounding x to the 16-bit compute dtype first made the block's h'
        norm(round16(norm(e))) where the trunk's h is norm(e) (on `write_synthetic(bigram=True)`):
        a quarter of the components one 16-bit step off, enough to flip the top token of a big
        vocabulary (its top two logits often tie in bfloat16), so the block missed the very token it
        predicts. On a GPU, up to PRECISE_ROWS rows (the draft steps: a row per drafting slot; a few
        slots' verifies) go through the GEMV kernels that take float32 rows, reading the weight as
        it is kept; more rows (prompt chunks, whose only product is the block's KV, rounded to the
        compute dtype at the attention's input anyway) run in the compute dtype. On CPU the weight
        is float32 (its int8 and 16-bit kernels take 16-bit rows only)."""
        lin = self.eh_proj
        if isinstance(lin, QuantLinear):
            if x.device.type == "cuda" and x.shape[0] <= PRECISE_ROWS:
                return lin(x).float()  # its fused GEMV keeps float32 rows in float32 arithmetic
            return lin(x.to(self.block.dtype)).float()
        if lin.weight.dtype == torch.float32:
            return lin(x).float()
        if x.device.type == "cuda" and x.shape[0] <= PRECISE_ROWS and lin.scale is None:
            from ..kernels.triton_dense import DENSE_GEMV_MAX_ROWS as step
            from ..kernels.triton_dense import dmm

            w = lin.weight  # 16-bit, read once per `step` rows, the products summed in float32
            return torch.cat([dmm(x[i : i + step], w) for i in range(0, x.shape[0], step)])
        return lin(x.to(self.block.dtype)).float()

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The block's normed output [R, n_embd] -> float32 draft logits [R, n_vocab]."""
        if self.own_head is None:
            return self.head.project(h)
        return self.own_head(h.to(self.block.dtype)).float()

    def clear(self, slot: int) -> None:
        self.block.kv_clear(slot)

    @property
    def kv_bytes(self) -> int:
        return self.block.kv_bytes

    @property
    def weight_bytes(self) -> int:
        return self.block.weight_bytes + self.eh_proj.nbytes + (self.own_head.nbytes if self.own_head else 0)
