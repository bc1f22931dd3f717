"""The `/status` document (schema in docs/ARCHITECTURE.md) and the device probe behind it.

`StatusDocument` holds what the worker knows about itself; sections it does not own (the RPC
address, pool occupancy, peers) come from providers added with `add_provider(fn)`: each returns
a dict of top-level keys merged over the defaults at every request.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable

from .. import __version__

STARTUP_STAGES = {1: "alive", 2: "model loaded", 3: "RPC active", 4: "ready"}


class _Nvml:
    """NVML, initialised once; unavailable (no driver, no GPU) means None forever."""

    _lock = threading.Lock()
    _handle = None
    _tried = False

    @classmethod
    def module(cls):
        with cls._lock:
            if not cls._tried:
                cls._tried = True
                try:
                    import pynvml

                    pynvml.nvmlInit()
                    cls._handle = pynvml
                except Exception:  # no library, no driver or no device: fall back to torch / psutil
                    cls._handle = None
            return cls._handle


def devices() -> list[dict]:
    """GPUs with memory used/total (NVML, else torch.cuda), else the host's RAM as one cpu device."""
    nvml = _Nvml.module()
    if nvml is not None:
        try:
            out = []
            for i in range(nvml.nvmlDeviceGetCount()):
                h = nvml.nvmlDeviceGetHandleByIndex(i)
                mem = nvml.nvmlDeviceGetMemoryInfo(h)
                util = nvml.nvmlDeviceGetUtilizationRates(h).gpu
                name = nvml.nvmlDeviceGetName(h)
                out.append({"index": i, "kind": "cuda", "name": name.decode() if isinstance(name, bytes) else name,
                            "memory_used": int(mem.used), "memory_total": int(mem.total), "util": util})  # fmt: skip
            if out:
                return out
        except Exception:  # a device vanished or NVML broke mid-way: the next probe is torch
            pass
    import torch

    if torch.cuda.is_available():
        out = []
        for i in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(i)
            out.append({"index": i, "kind": "cuda", "name": torch.cuda.get_device_name(i),
                        "memory_used": int(total - free), "memory_total": int(total), "util": None})  # fmt: skip
        return out
    import psutil

    vm = psutil.virtual_memory()
    return [{"index": 0, "kind": "cpu", "name": f"CPU ({os.cpu_count()} cores)",
             "memory_used": int(vm.total - vm.available), "memory_total": int(vm.total), "util": psutil.cpu_percent()}]  # fmt: skip


def _stage_entry(stage, role: str, addr: str | None, fallback_state: str) -> dict:
    layers = getattr(stage, "layer_range", None)
    return {
        "role": role,
        "addr": getattr(stage, "addr", addr),
        "layers": list(layers) if layers is not None else None,
        "device": str(getattr(stage, "device", "cpu")),
        "state": getattr(stage, "state", fallback_state),
    }


class StatusDocument:
    """What one worker reports at /status. The owner sets `startup_stage`, `model`, `pipeline`,
    `engine` as they come up; everything is read at request time."""

    def __init__(self, role: str, host: str, port: int):
        self.role = role
        self.http = {"host": host, "port": port}
        self.t0 = time.monotonic()
        self.startup_stage = 1
        self.degraded = False
        self.model: dict | None = None
        self.pipeline = None
        self.engine = None
        self._providers: list[Callable[[], dict]] = []

    def add_provider(self, fn: Callable[[], dict]) -> None:
        """`fn()` → dict of top-level keys (e.g. "rpc", "pool", "peers") merged into every document."""
        self._providers.append(fn)

    @property
    def state(self) -> str:
        if self.startup_stage < 4:
            return "starting"
        return "degraded" if self.degraded else "ok"

    def stages(self) -> list[dict]:
        if self.pipeline is None:
            return []
        out = [_stage_entry(self.pipeline.head, self.role, None, "ok")]
        out += [_stage_entry(r, "peer", None, "ok") for r in self.pipeline.remotes]
        return out

    def to_dict(self) -> dict:
        engine = self.engine
        doc = {
            "role": self.role,
            "pid": os.getpid(),
            "version": __version__,
            "uptime_s": round(time.monotonic() - self.t0, 3),
            "state": self.state,
            "startup_stage": self.startup_stage,
            "http": self.http,
            "rpc": None,
            "model": self.model,
            "stages": self.stages(),
            "devices": devices(),
            "throughput": throughput(engine),
            "speculative": speculative(engine),
            "pool": None,
            "peers": [],
            "slots": engine.slot_info() if engine is not None else [],
        }
        for provider in self._providers:
            doc.update(provider())
        return doc


def throughput(engine) -> dict:
    if engine is None:
        return {"prefill_tok_s": 0.0, "decode_tok_s": 0.0, "prefill_tokens_total": 0, "decode_tokens_total": 0}
    prefill, decode = engine.stats.rates()
    return {
        "prefill_tok_s": round(prefill, 2),
        "decode_tok_s": round(decode, 2),
        "prefill_tokens_total": engine.stats.prompt_tokens,
        "decode_tokens_total": engine.stats.predicted_tokens,
    }


def speculative(engine) -> dict:
    spec = getattr(engine, "spec_stats", None)
    if spec is not None:
        return spec.snapshot(getattr(engine, "spec_config", None))
    return {"type": "off", "draft_max": 0, "drafts": 0, "draft_tokens": 0, "accepted": 0,
            "acceptance": None, "mean_accepted_len": None, "recent_acceptance": None}  # fmt: skip
