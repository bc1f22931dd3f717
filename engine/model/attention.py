"""The attention paths over a layer's KV cache; `attend` picks one by the batch's mode
(`forward_batch.Mode`) and device.

`attend_runs` serves any batch (prefill, speculative verify, decode) one slot run at a time
through SDPA. One token per slot with no host values, so a CUDA graph can capture it:
`attend_decode` on CUDA (the Triton kernel: each slot walks only its own positions, in the cache's
own type), `attend_batched` elsewhere (every slot attends over its first `kv_len` cache rows under
an additive `decode_bias`); `Mode.PACKED` batches (short mixed steps) the same way, each row a
query over its slot's positions up to its own. A prompt from position 0 with no host values:
`attend_fresh`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .config import ModelConfig
from .forward_batch import ForwardBatch, Mode
from .kv_cache import KVCache

# cuDNN attention re-plans for every new sequence length (~10 ms a call): decode would crawl.
_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attend(cfg: ModelConfig, kv: KVCache, window: int, q, k, v, batch: ForwardBatch, bias) -> torch.Tensor:
    """A layer's attention over `batch` (`window`: its sliding window, 0 for none; `bias`: the
    BATCHED mode's mask off CUDA, `decode_bias`), its K/V written into `kv` first."""
    slots, positions = batch.slots, batch.positions
    if batch.mode is Mode.FRESH:
        return attend_fresh(cfg, kv, window, q, k, v, slots, positions)
    if batch.mode in (Mode.BATCHED, Mode.PACKED):  # rows of any slots and positions, no host values
        if q.device.type == "cuda":
            return attend_decode(cfg, kv, window, q, k, v, slots, positions)
        return attend_batched(cfg, kv, q, k, v, slots, positions, batch.kv_len, bias)
    return attend_runs(cfg, kv, window, q, k, v, batch.runs, slots, positions, batch.per_row)


def attend_runs(
    cfg: ModelConfig, kv: KVCache, window: int, q, k, v, runs, slots, positions, per_row: bool = False
) -> torch.Tensor:
    """Attention per slot run: every row's K/V into the cache at once (64 decode slots: one indexed
    write, not 64), then each run attends over its visible cache span. `per_row` (`--deterministic`):
    a run's rows attend one at a time, each exactly as a decode step of that position does: SDPA's
    CPU kernel blocks a many-row call by query rows and key span, so a row's last bits depended
    on the rows beside it (a prompt chunk's boundaries, a verified draft's length)."""
    kv.scatter(slots, positions, k, v)
    outs, i = [], 0
    with sdpa_kernel(_SDPA_BACKENDS):  # once per layer: entered per run it was ~1/6 of a 64-slot CPU step
        for slot, p0, n in runs:
            if per_row and n > 1:
                outs += _attend_rows(cfg, kv, window, q[i : i + n], slot, p0, n)
            else:
                outs.append(_attend_run(cfg, kv, window, q[i : i + n], slot, p0, n))
            i += n
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _span_start(window: int, position: int) -> int:
    """The first cache position a query at `position` sees."""
    return max(0, position - window + 1) if window else 0


def _attend_run(cfg: ModelConfig, kv: KVCache, window: int, q, slot: int, p0: int, n: int) -> torch.Tensor:
    """The `n` query rows `q` of positions p0.. of `slot` over the cache span they see."""
    end, start = p0 + n, _span_start(window, p0)
    keys, vals = kv.read_run(slot, start, end)
    windowed = window and n > 1 and end - start > window
    if n == 1:
        mask, causal = None, False
    elif start == 0 and p0 == 0 and not windowed:
        mask, causal = None, True
    else:
        qpos = torch.arange(p0, end, device=q.device)[:, None]
        kpos = torch.arange(start, end, device=q.device)[None, :]
        mask, causal = kpos <= qpos, False
        if window:
            mask &= kpos > qpos - window
    return _sdpa(cfg, q, keys, vals, mask, causal)


def _attend_rows(cfg: ModelConfig, kv: KVCache, window: int, q, slot: int, p0: int, n: int) -> list[torch.Tensor]:
    """`_attend_run`'s rows one by one, each over its own span as a decode step (n = 1) reads it:
    the run's span is read from the cache once, each row's a view of it."""
    first = _span_start(window, p0)
    keys, vals = kv.read_run(slot, first, p0 + n)
    outs = []
    for j in range(n):
        a, b = _span_start(window, p0 + j) - first, p0 + j + 1 - first
        outs.append(_sdpa(cfg, q[j : j + 1], keys[:, a:b], vals[:, a:b], None, False))
    return outs


def _sdpa(cfg: ModelConfig, q, keys, vals, mask, causal: bool) -> torch.Tensor:
    """q [n, n_head, head_dim] over keys/values [n_kv, span, head_dim] -> [n, n_head, head_dim]."""
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        keys.unsqueeze(0),
        vals.unsqueeze(0),
        attn_mask=mask,
        is_causal=causal,
        scale=cfg.attn_scale,
        enable_gqa=True,
    )
    return o[0].transpose(0, 1)


def attend_fresh(cfg: ModelConfig, kv: KVCache, window: int, q, k, v, slots, positions) -> torch.Tensor:
    """One slot's run from position 0 with no host values (the prefill graphs): what `attend_runs`
    does for it. K/V go into the cache and come back in its type, then causal attention (within the
    window on a sliding-window layer)."""
    kv.scatter(slots, positions, k, v)
    keys, vals = (t.transpose(0, 1).unsqueeze(0) for t in kv.rows(slots, positions))
    mask, causal = None, True
    if window and q.shape[0] > window:
        back = positions[:, None] - positions[None, :]
        mask, causal = (back >= 0) & (back < window), False
    with sdpa_kernel(_SDPA_BACKENDS):
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            keys,
            vals,
            attn_mask=mask,
            is_causal=causal,
            scale=cfg.attn_scale,
            enable_gqa=True,
        )
    return o[0].transpose(0, 1)


def decode_bias(
    cfg: ModelConfig, positions: torch.Tensor, kv_len: int, window: int, dtype: torch.dtype
) -> torch.Tensor:
    """Additive attention mask [B * n_kv, group, kv_len]: 0 where a slot's token may look, -inf elsewhere."""
    kpos = torch.arange(kv_len, device=positions.device)[None, :]
    visible = kpos <= positions[:, None]
    if window:
        visible &= kpos > positions[:, None] - window
    bias = torch.zeros(visible.shape, dtype=dtype, device=positions.device).masked_fill_(~visible, float("-inf"))
    group = cfg.n_head // cfg.n_head_kv
    return bias[:, None, None, :].expand(-1, cfg.n_head_kv, group, -1).reshape(-1, group, kv_len)


def attend_batched(cfg: ModelConfig, kv: KVCache, q, k, v, slots, positions, kv_len: int, bias) -> torch.Tensor:
    """One token per slot: scatter K/V, gather each slot's first `kv_len` cache rows, attend under `bias`.
    Grouped-query heads share their K/V through a batched matmul, not a copy per head."""
    kv.scatter(slots, positions, k, v)
    keys, vals = (t.reshape(-1, kv_len, cfg.head_dim) for t in kv.gather(slots, kv_len))
    q = q.reshape(keys.shape[0], -1, cfg.head_dim)  # [B * n_kv, group, head_dim]
    scores = torch.baddbmm(bias, q, keys.transpose(1, 2), alpha=cfg.attn_scale)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(vals.dtype)
    return torch.bmm(probs, vals).view(q.shape[0] // cfg.n_head_kv, cfg.n_head, cfg.head_dim)


def attend_decode(cfg: ModelConfig, kv: KVCache, window: int, q, k, v, slots, positions) -> torch.Tensor:
    """One token per slot through the decode-attention kernel: scatter K/V, attend over each slot's
    positions up to its own (the last `window` of them on a sliding-window layer)."""
    from ..kernels.triton_attention import decode_attention, default_splits

    kv.scatter(slots, positions, k, v)
    splits = default_splits(q.shape[0], cfg.n_head_kv, kv.blocks.n_ctx, cfg.head_dim, q.device)
    args = (slots, positions, kv.blocks.table, kv.blocks.n_ctx, window, cfg.attn_scale, splits)
    return decode_attention(q, *kv.stored(), *args)
