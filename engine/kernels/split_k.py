"""Split-K for the GEMVs (`triton_qmatmul`, `triton_dense`): how many programs share K, their float32
partials, and one kernel that sums them in split order, so results stay deterministic (a layer split
must equal solo bit for bit)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@functools.cache
def sm_count(device: torch.device) -> int:
    """Multiprocessors to fill; 1 off CUDA (Triton's interpreter, TRITON_INTERPRET=1, on CPU tensors)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def plan(
    rows: int, n: int, k: int, block_n: int, block_k: int, per_sm: int, dtype: torch.dtype, device: torch.device
) -> tuple[tuple[int, int], int, torch.Tensor]:
    """A GEMV of [rows, k] by [n, k] in programs of BLOCK_N outputs: (grid, elements of K per program,
    output [splits, rows, n]). K is split until about `per_sm` programs a multiprocessor are in flight
    (enough loads), in whole BLOCK_K steps; the output is the result itself in `dtype` when K is not
    split, else float32 partials for `reduced`."""
    grid_n = triton.cdiv(n, block_n)
    splits = max(1, min(triton.cdiv(per_sm * sm_count(device), grid_n), k // block_k))
    k_split = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    splits = triton.cdiv(k, k_split)
    out = torch.empty(splits, rows, n, dtype=dtype if splits == 1 else torch.float32, device=device)
    return (grid_n, splits), k_split, out


def reduced(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[rows, n] in `dtype` from `plan`'s output once the GEMV has filled it: one launch when split."""
    splits, rows, n = out.shape
    if splits == 1:
        return out[0]
    y = torch.empty(rows, n, dtype=dtype, device=out.device)
    _sum_splits_kernel[(triton.cdiv(rows * n, 1024),)](out, y, splits, rows * n, BLOCK=1024)
    return y


@triton.jit
def _sum_splits_kernel(part_ptr, out_ptr, SPLITS, SIZE, BLOCK: tl.constexpr):
    """out = the split-K partials [SPLITS, SIZE] summed in split order, in out's dtype: one launch."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < SIZE
    acc = tl.zeros([BLOCK], tl.float32)
    s = 0
    while s < SPLITS:
        acc += tl.load(part_ptr + s * SIZE + i, mask=ok, other=0.0)
        s += 1
    tl.store(out_ptr + i, acc.to(out_ptr.dtype.element_ty), mask=ok)
