"""Embeddings from the generating model, as llama-server computes them.

The engine hands back a prompt's final hidden states after the output norm (llama.cpp's `t_embd`,
the input of the output head: what `--embedding` returns for a decoder such as Gemma 3); this
module pools them into one vector and normalises it.

- Pooling (`--pooling`, else the GGUF's `{arch}.pooling_type`, else `none`, as llama.cpp's context
  defaults): `none` every token's vector, `mean` their mean, `cls` the first token's, `last` the
  last token's. `rank` (`--reranking`, or a reranker's file) pools nothing here: a reranker's
  classification head scores query/document pairs on /rerank (model/rank.py).
- Normalisation (`embd_normalize`, llama.cpp's `common_embd_normalize`): -1 none, 0 max absolute
  scaled to the int16 range, 1 taxicab, 2 euclidean (the default), p > 2 the p-norm. Applied to a
  pooled vector only; `none` returns the raw per-token vectors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .errors import UserError

if TYPE_CHECKING:  # tensor methods only: the CLI imports the names below before torch may load
    import torch

POOLINGS = ("none", "mean", "cls", "last", "rank")
GGUF_POOLING = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}  # llama_pooling_type
DEFAULT_NORMALIZE = 2  # euclidean, llama-server's --embd-normalize default
INT16_RANGE = 32760.0


def resolve_pooling(flag: str | None, metadata: dict, arch: str) -> str:
    """The pooling the server uses: `--pooling`, else the model's own, else none."""
    if flag is None:
        code = metadata.get(f"{arch}.pooling_type")
        flag = GGUF_POOLING.get(int(code), "none") if code is not None else "none"
    if flag not in POOLINGS:
        raise UserError(f"--pooling must be one of {', '.join(POOLINGS)}, got {flag!r}")
    return flag


def pool(hidden: torch.Tensor, pooling: str) -> torch.Tensor:
    """[T, d] final-norm hidden states of one prompt -> [T, d] (none) or [1, d]."""
    if pooling == "none":
        return hidden
    if pooling == "mean":
        return hidden.mean(dim=0, keepdim=True)
    if pooling == "cls":
        return hidden[:1]
    if pooling == "last":
        return hidden[-1:]
    raise ValueError(f"unknown pooling {pooling!r}")


def normalize(v: torch.Tensor, p: int) -> torch.Tensor:
    """`v` [d] scaled by llama.cpp's normalisation `p` (float64 sums, float32 out; a zero vector stays zero)."""
    x = v.double()
    if p < 0:
        return v.float()
    if p == 0:
        total = x.abs().max() / INT16_RANGE
    elif p == 2:
        total = x.square().sum().sqrt()
    else:
        total = x.abs().pow(p).sum().pow(1.0 / p)
    return (x / total if total > 0 else x * 0).float()


def embed_vectors(hidden: torch.Tensor, pooling: str, p: int) -> list[torch.Tensor]:
    """What llama-server returns for one prompt: the pooled, normalised vector (a list of one), or
    with pooling none every token's raw vector."""
    pooled = pool(hidden.float(), pooling)
    if pooling == "none":
        return list(pooled)
    return [normalize(pooled[0], p)]
