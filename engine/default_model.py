"""The model a worker serves: `--model`, else the embedded default (contracts/default_model.py)."""

from __future__ import annotations

from pathlib import Path

from ..contracts.default_model import default_model_path

__all__ = ["default_model_path", "model_path"]


def model_path(model: str | Path | None) -> Path:
    """The `--model` the user gave, else the embedded default."""
    return Path(model) if model else default_model_path()
