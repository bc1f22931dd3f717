"""Quantized weights that stay quantized on the GPU, and the kernels that multiply by them."""

from .qlinear import qlinear
from .qweight import LAYOUTS, QuantWeight

__all__ = ["LAYOUTS", "QuantWeight", "qlinear"]
