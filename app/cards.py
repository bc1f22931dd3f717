"""Each worker's card for the split plan: whether its stage lives on a GPU, and that card's size.

Where the size comes from, first found: the profile's `card_gb` (a remote peer's card, or any the
operator names); a running worker's own GPU as its /status reports it; a worker of this machine not
started yet, through NVML. Otherwise it is unknown, and the plan refuses nothing for it. NVML may be
absent (no package, no driver, no GPU): then only the first two apply.
"""

from __future__ import annotations

import functools

from ..contracts.fit import GIB
from .config import WorkerSpec


@functools.cache
def nvml_totals() -> dict[int, int]:
    """Memory of each local GPU by index; {} where NVML cannot be read. Read once per process."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no package, no driver library, no GPU: NVML's errors are not one type
        return {}
    try:
        return {
            i: int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i)).total)
            for i in range(pynvml.nvmlDeviceGetCount())
        }
    except Exception:
        return {}
    finally:
        pynvml.nvmlShutdown()


def card_index(device: str) -> int:
    """The GPU index a `device` setting uses: "cuda:1" is 1; "cuda" and "auto" take the first."""
    _, _, index = device.partition(":")
    return int(index) if index.isdigit() else 0


def _status_gpu(spec: WorkerSpec, status):
    gpus = [d for d in (status.devices if status else []) if d.kind == "cuda" and d.memory_total]
    return next((d for d in gpus if d.index == card_index(spec.device)), gpus[0] if gpus else None)


def on_gpu(spec: WorkerSpec, status, totals: dict[int, int]) -> bool:
    """Whether the worker holds its stage on a GPU: `--device cuda…`; with `auto`, when its /status
    lists one, its profile names a card, or (not started, this machine) NVML finds one."""
    if spec.device != "auto":
        return spec.device.startswith("cuda")
    if status is not None and status.devices:
        return _status_gpu(spec, status) is not None
    return spec.card_gb is not None or (spec.is_local and bool(totals))


def card_capacity(spec: WorkerSpec, status, totals: dict[int, int]) -> tuple[int | None, str]:
    """(bytes of the worker's card, where that number comes from); (None, "") when unknown."""
    if spec.card_gb is not None:
        return int(spec.card_gb * GIB), "card_gb"
    gpu = _status_gpu(spec, status)
    if gpu is not None:
        return int(gpu.memory_total), "status"
    if status is not None and status.devices:  # it runs, on no GPU
        return None, ""
    if spec.is_local and spec.device != "cpu" and card_index(spec.device) in totals:
        return totals[card_index(spec.device)], "nvml"
    return None, ""
