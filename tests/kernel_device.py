"""Where the Triton kernels' tests run: on CUDA, or on CPU tensors under Triton's interpreter (the
CPU wheels of torch ship no Triton, but PyPI's `triton` installs on a CPU-only host and runs the
kernels with TRITON_INTERPRET=1, which conftest.py sets without a GPU); None: nowhere here."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

KERNEL_DEVICE = (
    "cuda"
    if torch.cuda.is_available()
    else ("cpu" if os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") else None)
)
needs_kernels = pytest.mark.skipif(
    KERNEL_DEVICE is None, reason="no CUDA device, and no `triton` package with TRITON_INTERPRET=1 for CPU"
)
