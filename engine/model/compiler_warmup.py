"""torch.compile's one-time costs, paid on a thread while a worker reads its weights.

A compiled start pays, once per process and before its first graph: importing dynamo and inductor
and the first compile's set-up (on this project's CPU VM 1.6 + 2.4 + ~4 s; on the H100 the compiled
starts' "model loaded -> stage built" took 11-16 s against 4.2 s without compiling, docs/PERF.md
session 25). A thread compiling a one-line function on the same device meanwhile takes out of the
start what the load spends outside Python (file reads, copies); the Python parts of both take turns
on the GIL (docs/PERF.md, session 26). `wait` is called before every CUDA graph capture (`graphs.capture`): a capture must not see
another thread's kernels, and the real compiles then find everything imported and set up.
"""

from __future__ import annotations

import logging
import threading

import torch

log = logging.getLogger("hydra.compile")

_thread: threading.Thread | None = None


def _probe(x: torch.Tensor) -> torch.Tensor:
    return x * 2 + 1


def _run(device: torch.device) -> None:
    try:
        torch.compile(_probe, dynamic=False)(torch.ones(8, device=device))
    except Exception as e:  # the real compiles will fail with the reason, in their own place
        log.debug("compiler warm-up failed: %s", e)


def start(device: torch.device) -> None:
    """Begin the warm-up for `device` (once per process; a CUDA device only: nothing else compiles)."""
    global _thread
    if _thread is None and device.type == "cuda":
        _thread = threading.Thread(target=_run, args=(device,), name="compiler-warm-up", daemon=True)
        _thread.start()


def wait() -> None:
    """Until the warm-up (if any) has ended."""
    if _thread is not None:
        _thread.join()
