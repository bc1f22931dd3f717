"""Rotary position embedding: precomputed cos/sin tables and the rotation, for both pair layouts."""

from __future__ import annotations

import numpy as np
import torch

from .config import ModelConfig


def rope_table(
    cfg: ModelConfig, n_ctx: int, base: float, scale: float, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin [n_ctx, n_rot] in float32 laid out for `rotate`; angles in float64."""
    n_rot = cfg.n_rot
    inv = base ** (-np.arange(0, n_rot, 2, dtype=np.float64) / n_rot)
    if cfg.rope_pair_moves:  # IMROPE text positions: some pairs stay at position 0
        inv = inv * np.array(cfg.rope_pair_moves, dtype=np.float64)
    ang = np.outer(np.arange(n_ctx, dtype=np.float64) / scale, inv)
    cos, sin = np.cos(ang), np.sin(ang)
    if cfg.rope_neox:  # pairs (i, i + n_rot/2): first half gets -sin
        cos, sin = np.concatenate([cos, cos], 1), np.concatenate([-sin, sin], 1)
    else:  # pairs (2i, 2i+1): even dims get -sin
        cos, sin = np.repeat(cos, 2, 1), np.stack([-sin, sin], -1).reshape(len(sin), -1)
    return tuple(torch.from_numpy(t.astype(np.float32)).to(device) for t in (cos, sin))


def rotate(cfg: ModelConfig, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first n_rot dims of each head: x·cos + partner(x)·sin, where the partner of a
    dim is its rotate-half twin (NEOX) or its neighbour in the pair (llama); `sin` carries the signs."""
    n_rot = cfg.n_rot
    rot = x[..., :n_rot] if n_rot < x.shape[-1] else x
    if cfg.rope_neox:
        partner = rot.roll(n_rot // 2, dims=-1)
    else:
        partner = rot.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    out = torch.addcmul(rot * cos, partner, sin)
    return out if rot is x else torch.cat([out, x[..., n_rot:]], dim=-1)


def rotation(table: tuple[torch.Tensor, torch.Tensor], delta: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin [n_rot] of a rotation by `delta` positions (negative: back), from a
    `rope_table`: RoPE is a rotation per pair, so K rotated at position p and then by `delta` is K
    rotated at p + delta (llama.cpp's K-shift)."""
    cos, sin = table
    return (cos[delta], sin[delta]) if delta >= 0 else (cos[-delta], -sin[-delta])
