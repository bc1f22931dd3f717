"""The dense 16-bit GEMV (`hydra::dmm`) against float64, on CUDA or under Triton's interpreter."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from hydra_console.engine.kernels.triton_dense import DENSE_GEMV_MAX_ROWS, dense_gemv

DEVICE = (
    "cuda"
    if torch.cuda.is_available()
    else ("cpu" if os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") else None)
)
pytestmark = pytest.mark.skipif(DEVICE is None, reason="no CUDA device, and no Triton interpreter")


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8])
@pytest.mark.parametrize(
    "n,k,config",
    [
        (37, 96, (4, 32, 4, 4)),  # rows past N's last block, K not a multiple of BLOCK_K: both masks
        (64, 256, (2, 64, 4, 64)),  # split K over four programs: partials summed by the second kernel
        (48, 512, None),  # the configuration decode uses
    ],
)
def test_dense_gemv_matches_float64(rows, n, k, config):
    if config is None and rows > DENSE_GEMV_MAX_ROWS:
        pytest.skip("cuBLAS takes these rows")
    g = torch.Generator().manual_seed(rows * 1000 + n)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(torch.bfloat16)
    ref = x.double() @ w.double().T
    y = dense_gemv(x.to(DEVICE), w.to(DEVICE), config)
    assert y.shape == (rows, n) and y.dtype == torch.bfloat16
    # float32 accumulation, then one rounding to bfloat16 (the interpreter truncates: two ulps)
    torch.testing.assert_close(y.cpu().double(), ref, rtol=2**-7, atol=2**-7 * ref.abs().max().item())


def test_dense_gemv_is_deterministic_and_refuses_too_many_rows():
    """A layer split must equal solo bit for bit: the split-K partials are summed in a fixed order."""
    x = torch.randn(2, 256).to(DEVICE)
    w = torch.randn(64, 256).to(DEVICE)
    a, b = dense_gemv(x, w, (2, 64, 4, 64)), dense_gemv(x, w, (2, 64, 4, 64))
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match=f"1..{DENSE_GEMV_MAX_ROWS} rows"):
        dense_gemv(torch.randn(DENSE_GEMV_MAX_ROWS + 1, 256).to(DEVICE), w)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the decode path's dispatch and CUDA graphs need CUDA")
def test_linear_takes_the_gemv_for_decode_rows_under_compile_and_graphs():
    from hydra_console.engine.model.weights import Linear

    w = (torch.randn(3072, 2048, device="cuda") / 45).to(torch.bfloat16)
    lin = Linear(w)
    step = torch.compile(lambda x: lin(x), fullgraph=True)
    for rows in (1, DENSE_GEMV_MAX_ROWS, 16):  # 16 rows: cuBLAS
        x = torch.randn(rows, 2048, device="cuda", dtype=torch.bfloat16)
        ref = x.float() @ w.float().T
        eager = lin(x)
        torch.testing.assert_close(step(x).float(), ref, rtol=1e-2, atol=1e-2)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = lin(x)
        graph.replay()
        assert torch.equal(out, eager)
