"""Resolve the `--device` / `--dtype` flags into torch objects, with one clear error for bad values."""

from __future__ import annotations

import functools
import threading

import torch

from ..contracts.fit import StageFit
from .errors import UserError

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "f32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "f16": torch.float16,
}


def resolve_device(name: str | torch.device | None = "auto") -> torch.device:
    """ "auto" picks the first CUDA device when there is one, else the CPU."""
    if isinstance(name, torch.device):
        return name
    if name in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError):
        raise UserError(f"unknown device {name!r} (use cpu, cuda, cuda:N or auto)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device {name!r} requested but this torch has no usable CUDA device")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise UserError(f"device {name!r} does not exist ({torch.cuda.device_count()} CUDA devices)")
    if dev.type not in ("cpu", "cuda"):
        raise UserError(f"unsupported device type {dev.type!r} (use cpu or cuda)")
    return dev


def resolve_dtype(name: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """ "auto" is bfloat16 everywhere: on CPU it pairs with int8 weights (see model.Stage)."""
    if isinstance(name, torch.dtype):
        return name
    if name in (None, "", "auto"):
        return torch.bfloat16
    try:
        return _DTYPES[name.lower()]
    except KeyError:
        raise UserError(f"unknown dtype {name!r} (use auto, float32, bfloat16 or float16)") from None


def host_buffer(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An empty host tensor that stages a transfer to or from `device`: page-locked for CUDA, where
    copying megabytes from pageable memory runs several times slower (measured on an H200: a
    512-token prefill's 4 MiB hidden states took ~1.5 ms per pageable copy)."""
    return torch.empty(shape, dtype=dtype, pin_memory=torch.device(device).type == "cuda")


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without waiting for the device's queue: through page-locked memory
    to CUDA (a copy from pageable memory synchronises the stream: it would wait for a step in
    flight); on the CPU, or already on a GPU (a caller's device tensors), it is returned as it is."""
    if torch.device(device).type != "cuda" or t.device.type != "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


class Staging:
    """Host bytes to a GPU through two reused page-locked buffers (a load's weights, slice by slice):
    the host fills one from the file while the device copies the other and works on what it holds.
    From pageable memory every copy first waits for the device's queue (to_device's note), so reading,
    copying and repacking took turns. Off CUDA the bytes are moved as they are."""

    def __init__(self, device: torch.device, nbytes: int, count: int = 2):
        self.device, self.nbytes, self.count = torch.device(device), nbytes, count
        self._buffers: list[tuple[torch.Tensor, torch.cuda.Event]] = []
        self._next = 0
        self._lock = threading.Lock()  # a buffer is filled and queued by one thread at a time

    def to_device(self, data: torch.Tensor) -> torch.Tensor:
        """uint8 host bytes (a slice of a file's mmap) as a new tensor on the device, queued."""
        if self.device.type != "cuda" or data.numel() > self.nbytes:
            return to_device(data, self.device) if self.device.type == "cuda" else data.to(self.device)
        with self._lock:
            if not self._buffers:
                self._buffers = [
                    (torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=True), torch.cuda.Event())
                    for _ in range(self.count)
                ]
            buffer, copied = self._buffers[self._next]
            self._next = (self._next + 1) % self.count
            copied.synchronize()  # the buffer's last copy to the device has finished (never recorded: at once)
            part = buffer[: data.numel()]
            part.copy_(data.reshape(-1))
            out = torch.empty(data.numel(), dtype=torch.uint8, device=self.device)
            out.copy_(part, non_blocking=True)
            copied.record()
            return out


@functools.cache
def load_staging(device: torch.device, nbytes: int) -> Staging:
    """One `Staging` per device and slice size for the process's loads (2 x `nbytes` of page-locked memory)."""
    return Staging(device, nbytes)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """`t` on the host, waiting for the device: staged through page-locked memory from CUDA;
    a CPU tensor is returned as it is."""
    if t.device.type != "cuda":
        return t.detach()
    out = host_buffer(t.shape, t.dtype, t.device)
    out.copy_(t.detach(), non_blocking=True)
    torch.cuda.current_stream(t.device).synchronize()
    return out


def fit_here(name: str, layers: tuple[int, int], need: int, headroom: int, device: torch.device, *, mtp=False):
    """A stage of `need` bytes against what is free on `device` now (contracts/fit.py), checked
    before anything of it is allocated."""
    source = f"free on {device}" if device.type == "cuda" else "available RAM"
    return StageFit(name, layers, need, free_bytes(device), headroom, source, mtp)


def free_bytes(device: torch.device) -> int:
    """Memory a new allocation on `device` can take now: the GPU's free memory, or the host's available RAM."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import psutil

    return psutil.virtual_memory().available
