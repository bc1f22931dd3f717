"""Plain functions that turn the workers' memory into rows and text: machine totals per device,
each worker's RSS and GPU memory, free room per device, and how a worker holds its stage. No Textual here."""

from __future__ import annotations

from dataclasses import dataclass

import psutil

from ..contracts.footprint import compute_dtype, weight_form
from .config import Alerts
from .supervisor import Supervisor

_FORM_TEXT = {
    "quantized": "weights as in the GGUF",
    "int8": "weights int8 + bf16 prefill copy",
    "dense": "weights at {dtype}",
}
_KV_AUTO = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}


def memory_form(m) -> str:
    """How a worker holds its stage (a split_plan.WorkerMemory), as the split editor's note says it."""
    dtype = compute_dtype(m.dtype)
    k, v = (_KV_AUTO[dtype] if kind == "auto" else kind for kind in m.kv_types)
    return f"({m.device}): {_FORM_TEXT[weight_form(m.device, m.dtype, m.gpu_weights)].format(dtype=dtype)}, KV {k}/{v}"


def memory_forms(names: list[str], memory: list) -> str:
    """`memory_form` of each worker, workers that hold their stage alike named together."""
    groups: dict[str, list[str]] = {}
    for name, m in zip(names, memory):
        groups.setdefault(memory_form(m), []).append(name)
    return "; ".join(f"{', '.join(who)} {form}" for form, who in groups.items())


@dataclass(frozen=True)
class MemoryRow:
    label: str  # "head cuda:0 NVIDIA H200" / "peer1 RAM"
    used: int | None
    total: int | None
    note: str  # extra text, e.g. "cpu 12%"
    tone: str


def memory_rows(sup: Supervisor, alerts: Alerts) -> list[MemoryRow]:
    """Machine totals once per device (labelled "machine", or the host when workers run on several),
    noting the workers on it; then each worker's own process: its RSS (psutil on the pid this
    console started, else what the worker reports) and its GPU memory (NVML's per-process reading)."""
    rows: list[MemoryRow] = []
    hosts = {w.spec.host for w in sup.workers.values()}
    devices: dict[tuple, tuple] = {}  # (host, kind, index) -> (device, names of the workers on it)
    for w in sup.workers.values():
        for d in w.status.devices if w.status else []:
            devices.setdefault((w.spec.host, d.kind, d.index), (d, []))[1].append(w.name)
    for (host, kind, index), (d, names) in devices.items():
        where = "machine" if len(hosts) == 1 else host
        label = f"{where} {kind}:{index}" if kind == "cuda" else f"{where} RAM"
        util = f"util {d.util:.0f}% " if d.util is not None and kind == "cuda" else ""
        rows.append(
            MemoryRow(
                label,
                d.memory_used,
                d.memory_total,
                f"{util}({', '.join(names)})",
                _mem_tone(d.memory_used, d.memory_total, alerts),
            )
        )
    for w in sup.workers.values():
        st = w.status
        proc = st.process if st else None
        rss = w.rss if w.rss is not None else (proc.rss if proc else None)
        if rss is not None:
            ram = next((d.memory_total for d in st.devices if d.kind == "cpu"), None) if st else None
            ram = ram or (psutil.virtual_memory().total if w.spec.is_local else None)
            cpu = f"cpu {w.cpu_pct:.0f}%" if w.cpu_pct is not None else ""
            rows.append(MemoryRow(f"{w.name} RSS", rss, ram, cpu, _mem_tone(rss, ram, alerts)))
        if proc is not None and proc.gpu_memory is not None:
            gpu = next((d for d in st.devices if d.kind == "cuda"), None)
            total = gpu.memory_total if gpu else None
            note = "per process" if proc.gpu_source == "nvml" else "torch reserved"
            rows.append(
                MemoryRow(f"{w.name} GPU", proc.gpu_memory, total, note, _mem_tone(proc.gpu_memory, total, alerts))
            )
    return rows


def device_free(sup: Supervisor, name: str) -> tuple[int | None, bool]:
    """Free memory of worker `name`'s roomiest device, and whether another worker reports the same
    device (same host, kind, index): then the one figure is shared, not each worker's to fill."""
    w = sup.worker(name)
    devs = [
        d for d in (w.status.devices if w.status else []) if d.memory_total is not None and d.memory_used is not None
    ]
    if not devs:
        return None, False
    d = max(devs, key=lambda d: d.memory_total - d.memory_used)
    shared = any(
        o is not w
        and o.spec.host == w.spec.host
        and o.status
        and any((x.kind, x.index) == (d.kind, d.index) for x in o.status.devices)
        for o in sup.workers.values()
    )
    return d.memory_total - d.memory_used, shared


def _mem_tone(used, total, alerts: Alerts) -> str:
    if not total or used is None:
        return "muted"
    return "warn" if used / total * 100 >= alerts.vram_pct else "ok"
