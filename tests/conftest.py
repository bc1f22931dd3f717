"""Shared fixtures: tiny synthetic models, the default model, free ports."""

from __future__ import annotations

import json
import socket

import pytest

from hydra_console.engine.default_model import default_model_path
from hydra_console.engine.synth import write_synthetic


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """Factory `tiny_model(arch="llama", **shape) -> Path`: a synthetic GGUF, written once per argument set."""
    root = tmp_path_factory.mktemp("synthetic-models")
    cache = {}

    def make(arch: str = "llama", **kw):
        key = json.dumps([arch, sorted(kw.items())], default=str)
        if key not in cache:
            cache[key] = write_synthetic(root / f"{arch}-{len(cache)}.gguf", arch, **kw)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def default_model():
    """Path of the real Gemma 3 270M Q4_K_M GGUF."""
    return default_model_path()


@pytest.fixture
def free_port():
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
