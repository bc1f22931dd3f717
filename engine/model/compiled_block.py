"""`layer.block` compiled per call shape and kept on disk, so that a worker's restart loads its compiled
layers instead of tracing them again.

torch.compile's own caches (inductor's FX graphs, Triton's kernels) survive a restart, but every start
still runs dynamo's trace of each graph, most of a warm compile (docs/PERF.md, sessions 21 and 29): the
27B's MTP start traced 11 graphs. `aot_compile` (torch >= 2.10) keeps a whole compiled function with
its guards; loading one skips the trace. Older torch, or a graph it cannot keep, compiles through
torch.compile as before."""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import torch

from .layer import block

log = logging.getLogger("hydra.compile")


def source_digest() -> str:
    """What a saved compile depends on besides its guards: torch's version and the engine's source (the
    code it traced, and the module constants it read, which no guard keeps). Another digest is
    another folder."""
    engine = Path(__file__).parent.parent
    h = hashlib.sha256(torch.__version__.encode())
    for path in sorted(engine.rglob("*.py")):
        h.update(str(path.relative_to(engine)).encode() + path.read_bytes())
    return h.hexdigest()[:16]


def call_key(layer, h: torch.Tensor, batch) -> str:
    """Which saved compiles a call may use: its layer's kind, rows and mode. Their guards pick among
    them (a recurrent layer's graph depends on its slots and run length too, an attention layer's on
    its rows alone; a layer whose weights have other types or shapes needs one of its own)."""
    kind = ("recurrent" if layer.deltanet is not None else "attention", layer.window)
    return hashlib.sha256(repr((kind, tuple(h.shape), h.dtype, batch.mode.name)).encode()).hexdigest()[:16]


class CompiledBlock:
    """Callable as `block`: each call runs a compiled graph whose guards hold for its arguments, loaded
    from `directory` (None: kept in memory only) or compiled now and saved there. `compiled` and
    `loaded` count this process's traces and loads."""

    def __init__(self, directory: Path | None, backend: str = "inductor"):
        self.directory = directory / source_digest() if directory is not None else None
        self.graphs: dict[str, list] = {}
        self.compiled = self.loaded = 0
        self.backend = backend
        self.ahead = torch.compile(block, backend=backend, dynamic=False, fullgraph=True)
        if not (hasattr(torch.compiler, "load_compiled_function") and hasattr(self.ahead, "aot_compile")):
            self._jit(backend)

    def _jit(self, backend: str) -> None:
        """torch's own per-shape cache from now on, a trace per shape on every start (torch < 2.10)."""
        self.ahead = None
        # Entries: a batch bucket x a run length x a layer kind; past the limit dynamo runs eagerly.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        self.jit = torch.compile(block, backend=backend, dynamic=False)

    def __call__(self, layer, h, rope, batch, bias):
        args = (layer, h, rope, batch, bias)
        if self.ahead is None:
            return self.jit(*args)
        key = call_key(layer, h, batch)
        if key not in self.graphs:
            self.graphs[key] = self._load(key)
        for fn in self.graphs[key]:
            if fn.guard_check(*args):
                return fn(*args)
        try:
            fn = self.ahead.aot_compile((args, {}))
        except Exception as e:  # what this torch cannot keep whole (a guard it cannot save): traced per start
            log.warning("layers compiled per start: aot_compile failed (%s: %s)", type(e).__name__, e)
            self._jit(self.backend)
            return self.jit(*args)
        self.compiled += 1
        self.graphs[key].append(fn)
        self._save(key, fn)
        return fn(*args)

    def _files(self, key: str) -> list[Path]:
        return sorted(self.directory.glob(f"{key}-*.bin")) if self.directory is not None else []

    def _load(self, key: str) -> list:
        fns = []
        for path in self._files(key):
            try:
                with path.open("rb") as f:
                    fns.append(torch.compiler.load_compiled_function(f))
                self.loaded += 1
            except Exception as e:  # another machine's, torn or stale: compiled again when needed
                log.warning("compiled layer %s not loaded (%s: %s): removed", path.name, type(e).__name__, e)
                path.unlink(missing_ok=True)
        return fns

    def _save(self, key: str, fn) -> None:
        if self.directory is None:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        taken = {int(p.stem.rsplit("-", 1)[1]) for p in self._files(key)}
        index = next(i for i in range(len(taken) + 1) if i not in taken)
        # Written aside and renamed: a head and a peer on one host share the folder, and a reader
        # must never find half a file (it would remove it as torn).
        part = self.directory / f".{key}-{index}.{os.getpid()}"
        try:
            fn.save_compiled_function(str(part))
            os.replace(part, self.directory / f"{key}-{index}.bin")
        except Exception as e:  # a full disk, say: this start goes on with the graph in memory
            log.warning("compiled layer not saved (%s: %s)", type(e).__name__, e)
            part.unlink(missing_ok=True)
