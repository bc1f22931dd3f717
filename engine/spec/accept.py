"""Speculative decoding: drafters that propose tokens, and the exact accept step that checks them.

A step with a draft of k tokens runs k+1 tokens of the slot through the target model in one
`Pipeline.forward` (through the split: one round trip per peer). Row i of those logits is the
target's distribution after the slot's history plus draft[:i]. The accept step keeps the draft
prefix the target agrees with and adds one token of the target's own, so every step emits at
least one token and the output follows the target exactly:

- greedy: accept while draft[i] equals the target's pick at row i; output is token for token
  the non-speculative greedy output.
- temperature > 0, a draft sampled from the drafter's q: rejection sampling (Leviathan et al. 2023 /
  Chen et al. 2023): accept x with probability min(1, p(x)/q(x)), on rejection sample from
  norm(max(0, p - q)).
- temperature > 0, a draft chosen deterministically (n-gram lookup, greedy draft): q is a point mass
  on x, which reduces to accepting x with probability p(x), else a draw of p without x: the same as
  drawing the target's token at each row and keeping the draft while it matches (`accept_greedy`
  over those draws, llama.cpp's sample-and-match), which the verifier does: with the row's own
  seeded randomness the text equals the non-speculative one.

KV rollback is implicit: the runtime advances the slot's length by accepted + 1, so the KV rows of
rejected draft tokens (head and peers) are overwritten by the next step.
"""

from __future__ import annotations

import torch

from ..serving.sampling import draw


def accept_greedy(targets: list[int], draft: list[int]) -> list[int]:
    """Tokens to emit given the target's pick (argmax or seeded draw) at each of the k+1 verified
    rows: the draft prefix that matches, then the target's token at the first mismatch (or after
    the whole draft)."""
    if len(targets) != len(draft) + 1:
        raise ValueError(f"need k+1={len(draft) + 1} target picks, got {len(targets)}")
    m = 0
    while m < len(draft) and draft[m] == targets[m]:
        m += 1
    return draft[:m] + [targets[m]]


def accept_sampled(p: torch.Tensor, draft: list[int], q: torch.Tensor, u: torch.Tensor) -> list[int]:
    """Rejection sampling. `p[k+1, V]`: the target's probabilities (after the request's sampling
    transforms) at each verified row; `q[k, V]`: the drafter's, the draft sampled from it; `u[k+1, 2]`:
    independent uniforms in (0, 1), row i's accept test and its draw. Emitted tokens are distributed
    exactly as sampling from p."""
    k = len(draft)
    if p.shape[0] != k + 1:
        raise ValueError(f"need k+1={k + 1} target rows, got {p.shape[0]}")
    out: list[int] = []
    for i, x in enumerate(draft):
        px, qx = float(p[i, x]), float(q[i, x])
        if qx > 0 and float(u[i, 0]) < min(1.0, px / qx):
            out.append(x)
            continue
        residual = torch.clamp(p[i] - q[i], min=0.0)
        if float(residual.sum()) <= 0.0:  # p == q up to rounding: any p-sample is right
            residual = p[i]
        out.append(int(draw(residual[None], u[i : i + 1, 1])))
        return out
    out.append(int(draw(p[k : k + 1], u[k : k + 1, 1])))
    return out


# ---------------------------------------------------------------- acceptance statistics
