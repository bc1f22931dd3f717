"""Random GGUF quantized blocks whose dequantized weights have zero mean and a chosen spread: what
synthetic files hold for the types gguf cannot quantize (the K-quants), and what kernel tests feed."""

from __future__ import annotations

import gguf
import numpy as np
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as T

# Block types that `random_blocks` writes: per type, the byte offsets of the float16 block scale d
# and of the float16 min field (None where the type has none), and min / d. Legacy types add the
# min (m = -d * mean code), K-quants subtract it (dmin = d * mean code, with each sub-block's min
# tied to its scale by `_tie_mins`), so the dequantized weights have zero mean either way.
_SCALE_FIELDS = {
    T.Q4_0: (0, None, 0.0),
    T.Q4_1: (0, 2, -7.5),
    T.Q5_0: (0, None, 0.0),
    T.Q5_1: (0, 2, -15.5),
    T.Q8_0: (0, None, 0.0),
    T.Q2_K: (80, 82, 1.5),
    T.Q3_K: (108, None, 0.0),
    T.Q4_K: (0, 2, 7.5),
    T.Q5_K: (0, 2, 15.5),
    T.Q6_K: (208, None, 0.0),
}
# The ones gguf cannot quantize: the writer uses random blocks for these.
K_QUANTS = (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K)


def check_row(name: str, cols: int, qt: T) -> None:
    block = GGML_QUANT_SIZES[qt][0]
    if cols % block:
        raise ValueError(f"{name}: row length {cols} is not a multiple of the {qt.name} block size {block}")


def random_blocks(shape: tuple[int, int], qt: T, std: float, rng: np.random.Generator) -> np.ndarray:
    """Random zero-mean blocks [rows, bytes per row] whose dequantized values have roughly standard deviation `std`.

    Every code appears; the block scales vary by up to 2x between blocks, so that kernels
    that index the wrong block's scale are caught.
    """
    block, type_size = GGML_QUANT_SIZES[qt]
    rows, cols = shape
    blocks = rng.integers(0, 256, size=(rows * cols // block, type_size), dtype=np.uint8)
    d_at, min_at, min_ratio = _SCALE_FIELDS[qt]
    _tie_mins(blocks, qt)
    spread = rng.uniform(0.7, 1.4, size=len(blocks)).astype(np.float32)

    def set_scale(d: float) -> None:
        for at, value in ((d_at, d * spread), (min_at, d * spread * min_ratio)):
            if at is not None:
                blocks[:, at : at + 2] = value.astype(np.float16).view(np.uint8).reshape(-1, 2)

    set_scale(1e-2)
    probe = gguf.quants.dequantize(blocks[: min(len(blocks), 64)], qt)
    set_scale(1e-2 * std / max(float(probe.std()), 1e-12))
    return blocks.reshape(rows, cols // block * type_size)


def _tie_mins(blocks: np.ndarray, qt: T) -> None:
    """Make every sub-block's 4- or 6-bit min equal its scale, in place."""
    if qt == T.Q2_K:  # bytes 0..15: scale in the low nibble, min in the high one
        blocks[:, :16] = (blocks[:, :16] & 0x0F) * 0x11
    elif qt in (T.Q4_K, T.Q5_K):
        # Bytes 4..15 pack (scale, min) pairs: bytes 4..7 hold the low 6 bits of scales 0..3 (and the top
        # bits of scales 4..7), bytes 8..11 the same for mins, bytes 12..15 the low nibbles of scales 4..7
        # and mins 4..7. Equal scale and min bytes, and equal nibbles, tie each min to its scale.
        blocks[:, 8:12] = blocks[:, 4:8]
        blocks[:, 12:16] = (blocks[:, 12:16] & 0x0F) * 0x11
