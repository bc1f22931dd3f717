"""Hydra: a layer-split LLM engine and its operator console."""

__version__ = "0.1.0"
