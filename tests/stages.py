"""Test support (not a test module): build a Stage from a GGUF and run a slot's tokens through it."""

from __future__ import annotations

import torch

from hydra_console.engine.gguf_file import GGUFFile
from hydra_console.engine.model import build_stage


def load(path, **kw):
    """A float32 CPU stage of the whole model unless `kw` says otherwise."""
    kw.setdefault("dtype", "float32")
    kw.setdefault("n_ctx", 512)
    return build_stage(GGUFFile(path), **kw)


def prefill(stage, tokens, slot=0, start=0):
    """Logits of `tokens` run in `slot` from position `start`."""
    n = len(tokens)
    h = stage.run_layers(stage.embed(torch.tensor(tokens)), torch.full((n,), slot), torch.arange(start, start + n))
    return stage.logits(h)
