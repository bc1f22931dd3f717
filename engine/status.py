"""A worker's `/health` and `/status` (types in contracts.status) and the device probe behind them.

`StatusDocument` holds what the worker knows about itself; sections it does not own (the RPC
address, pool occupancy, peers) come from providers added with `add_provider(fn)`: each returns
{field: value} set over the defaults at every request.
"""

from __future__ import annotations

import dataclasses
import os
import resource
import sys
import threading
import time
from typing import Callable

from .. import __version__
from ..contracts.status import (
    READY_STAGE,
    STARTUP_STAGES,
    WARMING_STAGE,
    Address,
    DeviceInfo,
    Health,
    ModelInfo,
    ProcessInfo,
    Requests,
    SlotInfo,
    Speculative,
    StageInfo,
    Status,
    Throughput,
)


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


def devices() -> list[DeviceInfo]:
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
                out.append(
                    DeviceInfo(
                        i,
                        "cuda",
                        name.decode() if isinstance(name, bytes) else name,
                        int(mem.used),
                        int(mem.total),
                        util,
                    )
                )
            if out:
                return out
        except Exception:  # a device vanished or NVML broke mid-way: the next probe is torch
            pass
    import torch

    if torch.cuda.is_available():
        out = []
        for i in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(i)
            out.append(DeviceInfo(i, "cuda", torch.cuda.get_device_name(i), int(total - free), int(total)))
        return out
    import psutil

    vm = psutil.virtual_memory()
    return [
        DeviceInfo(
            0, "cpu", f"CPU ({os.cpu_count()} cores)", int(vm.total - vm.available), int(vm.total), psutil.cpu_percent()
        )
    ]


def process_info() -> ProcessInfo:
    """This process's RSS and GPU memory: NVML's per-process accounting where it sees our pid (not
    inside a PID namespace it does not share), else what torch's allocator has reserved."""
    import psutil

    rss = psutil.Process().memory_info().rss
    # Linux reports KiB, and updates the high-water mark lazily: it is at least what is resident now.
    peaks = {"peak_rss": max(rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)}
    torch = sys.modules.get("torch")  # never imported just for this (a peer before LOAD_STAGE has no CUDA context)
    cuda = torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized()
    if cuda:
        peaks["peak_device_bytes"] = sum(torch.cuda.max_memory_reserved(i) for i in range(torch.cuda.device_count()))
        peaks["device_reserved"] = sum(torch.cuda.memory_reserved(i) for i in range(torch.cuda.device_count()))
        peaks["device_allocated"] = sum(torch.cuda.memory_allocated(i) for i in range(torch.cuda.device_count()))
    nvml, pid = _Nvml.module(), os.getpid()
    if nvml is not None:
        try:
            seen, used = False, 0
            for i in range(nvml.nvmlDeviceGetCount()):
                for p in nvml.nvmlDeviceGetComputeRunningProcesses(nvml.nvmlDeviceGetHandleByIndex(i)):
                    if p.pid == pid:
                        seen, used = True, used + (p.usedGpuMemory or 0)
            if seen:
                return ProcessInfo(rss, used, "nvml", **peaks)
        except Exception:  # NVML without per-process support: torch's view below
            pass
    if cuda:
        return ProcessInfo(rss, peaks["device_reserved"], "torch", **peaks)
    return ProcessInfo(rss, **peaks)


class StatusDocument:
    """What one worker reports at /health and /status. The owner sets `startup_stage`, `model`,
    `pipeline`, `engine` as they come up; everything is read at request time."""

    def __init__(self, role: str, host: str, port: int, config: dict | None = None):
        self.role = role
        self.http = Address(host, port)
        self.config = config
        self.t0 = time.monotonic()
        import psutil

        self._process_start = psutil.Process().create_time()  # wall clock, as time.time()
        self.startup_s: dict[str, float] = {}
        self.startup_stage = 1
        self.degraded: str | None = None  # degraded but serving: why (the owner sets it)
        self.error: str | None = None  # why loading failed
        self.stopping: str | None = None  # set by SIGTERM's drain (http/drain.py): /health is 503 with it
        self.model: ModelInfo | None = None
        self.pipeline = None
        self.engine = None
        self.sleeping = False  # the head's model freed (--sleep-idle-seconds): the owner sets it
        self._providers: list[Callable[[], dict]] = []

    @property
    def startup_stage(self) -> int:
        return self._startup_stage

    @startup_stage.setter
    def startup_stage(self, stage: int) -> None:
        self._startup_stage = stage
        self.mark(STARTUP_STAGES[stage])

    def mark(self, phase: str) -> None:
        """`startup_s[phase]`: seconds from the process's start to now (a stage, or a phase of the load between two)."""
        self.startup_s[phase] = round(time.time() - self._process_start, 3)

    def add_provider(self, fn: Callable[[], dict]) -> None:
        """`fn()` -> {Status field: value} (e.g. "rpc", "pool", "peers") set on every document."""
        self._providers.append(fn)

    def unavailable(self) -> str | None:
        """Why requests cannot be served now though loading is done, read at request time."""
        if self.stopping is not None:
            return self.stopping
        return self.pipeline.unavailable() if self.pipeline is not None else None

    @property
    def state(self) -> str:
        if self.startup_stage < READY_STAGE:
            return "warming" if self.startup_stage == WARMING_STAGE else "starting"
        return "degraded" if self.degraded or self.unavailable() else "ok"

    def health(self) -> Health:
        ready = self.startup_stage >= READY_STAGE
        down = self.unavailable() if ready else None
        return Health(
            self.state,
            self.startup_stage,
            self.model is not None,
            self.model.name if self.model else None,
            self.startup_stage >= 3,
            self.error,
            serving=ready and down is None,
            reason=down or self.degraded,
        )

    def stages(self) -> list[StageInfo]:
        return self.pipeline.stages() if self.pipeline is not None else []

    def document(self) -> Status:
        engine = self.engine
        doc = Status(
            role=self.role,
            pid=os.getpid(),
            version=__version__,
            uptime_s=round(time.monotonic() - self.t0, 3),
            state=self.state,
            sleeping=self.sleeping,
            startup_stage=self.startup_stage,
            startup_s=dict(self.startup_s),
            http=self.http,
            model=self.model,
            stages=self.stages(),
            devices=devices(),
            process=process_info(),
            throughput=throughput(engine),
            speculative=speculative(engine),
            slots=[SlotInfo(**s) for s in engine.slot_info()] if engine is not None else [],
            requests=requests(engine),
            config=self.config,
        )
        for provider in self._providers:
            doc = dataclasses.replace(doc, **provider())
        return doc


def throughput(engine) -> Throughput:
    if engine is None:
        return Throughput()
    st = engine.stats
    prefill, decode = st.rates()
    with st.lock:
        phases = {name: round(seconds, 4) for name, seconds in st.phase_s.items()}
        prompt_phases = {name: round(seconds, 4) for name, seconds in st.prompt_phase_s.items()}
        prompt_steps = st.prompt_steps
    return Throughput(
        round(prefill, 2),
        round(decode, 2),
        st.prompt_tokens,
        st.predicted_tokens,
        st.steps,
        phases,
        prompt_steps,
        prompt_phases,
    )


def requests(engine) -> Requests | None:
    if engine is None:
        return None
    st = engine.stats
    return Requests(
        slots_busy=engine.n_processing,
        slots_total=engine.n_slots,
        queued=engine.n_deferred,
        queue_max=engine.max_queue,
        requests_total=st.requests_total,
        rejected_total=st.requests_rejected,
        **st.latency(),
    )


def speculative(engine) -> Speculative:
    spec = getattr(engine, "spec_stats", None)
    if spec is None:
        return Speculative()
    return spec.snapshot(engine.spec_config, engine.spec.drafter_kv_bytes, engine.spec.adaptive.snapshot())
