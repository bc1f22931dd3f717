"""Plain functions that turn supervisor state and /status documents into text.

No Textual here: the UI styles what these return (a `tone` per value: ok / warn / error / busy /
muted), and tests check them without a terminal. Every state carries a symbol and a word, so
nothing depends on colour (NO_COLOR, colour-blind users, a monochrome SSH terminal).
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from dataclasses import dataclass

import psutil

from ..contracts.errors import UserError
from ..contracts.footprint import compute_dtype, weight_form
from ..contracts.status import READY_STAGE, Pool, Status
from .config import Alerts
from .launch import connect_host
from .records import Event, State, Worker, describe_exit
from .supervisor import Supervisor

STATE_LOOK: dict[State, tuple[str, str]] = {  # state -> (symbol, tone)
    State.READY: ("●", "ok"),
    State.STARTING: ("◐", "busy"),
    State.DEGRADED: ("▲", "warn"),
    State.BACKOFF: ("↻", "warn"),
    State.CRASHED: ("✖", "error"),
    State.CRASH_LOOP: ("⟳", "error"),
    State.PORT_BUSY: ("⧗", "warn"),
    State.STOPPING: ("◌", "busy"),
    State.STOPPED: ("○", "muted"),
    State.UNREACHABLE: ("✖", "error"),
}

# Log lines worth a highlight: (label, pattern). First match wins.
FAILURE_PATTERNS: list[tuple[str, re.Pattern]] = [
    (label, re.compile(rx, re.IGNORECASE))
    for label, rx in [
        ("traceback", r"^Traceback \(most recent call last\)"),
        ("out of memory", r"CUDA out of memory|OutOfMemoryError|\bout of memory\b|Cannot allocate memory"),
        ("port in use", r"Address already in use|EADDRINUSE"),
        ("connection refused", r"Connection refused|ECONNREFUSED"),
        ("fingerprint mismatch", r"fingerprint mismatch|model mismatch|shape mismatch"),
        ("timeout", r"timed out|TimeoutError"),
        ("error", r"^\w*(Error|Exception)\b|\berror:"),
    ]
]


def state_text(w: Worker, now: float) -> tuple[str, str]:
    """("● ready", "ok"); backoff shows the seconds left until the next try."""
    symbol, tone = STATE_LOOK[w.state]
    word = w.state.value
    if w.state in (State.BACKOFF, State.CRASH_LOOP) and w.backoff_until is not None and not w.running:
        word = f"{word} {max(0.0, w.backoff_until - now):.0f}s"
    elif w.state == State.STARTING and w.status:
        word = f"starting {w.status.startup_stage}/{READY_STAGE}"
    return f"{symbol} {word}", tone


def fmt_duration(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    s = int(max(0, seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "—"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


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


def fmt_rate(tok_s: float | None) -> str:
    if tok_s is None:
        return "—"
    if tok_s >= 1000:
        return f"{tok_s / 1000:.1f}k tok/s"
    return f"{tok_s:.1f} tok/s"


def fmt_layers(layers) -> str:
    if not layers or len(layers) != 2:
        return "—"
    return f"[{layers[0]},{layers[1]})"


def fmt_pct(x: float | None) -> str:
    return "—" if x is None else f"{x * 100:.0f}%"


def bar(used: float | None, total: float | None, width: int = 20) -> str:
    """`█████░░░░░` filled in proportion; cells are glyphs, not colours."""
    if not total or used is None or width < 1:
        return "░" * max(width, 0)
    frac = min(max(used / total, 0.0), 1.0)
    full = round(frac * width)
    return "█" * full + "░" * (width - full)


def worker_layers(w: Worker, sup: Supervisor) -> list | None:
    """This worker's layer range: its own /status stage, else the head's view of the pipeline."""
    for s in w.status.stages if w.status else []:
        if s.role == w.role and s.layers:
            if w.role == "head" or _addr_port(s.addr) == w.spec.rpc:
                return list(s.layers)
    ranges = sup.stage_ranges()
    if ranges:
        idx = list(sup.workers).index(w.name)
        if idx < len(ranges):
            return list(ranges[idx][1])
    return None


def _addr_port(addr) -> int | None:
    try:
        return int(str(addr).rsplit(":", 1)[1])
    except (IndexError, ValueError):
        return None


def worker_devices(w: Worker) -> str:
    devs = w.status.devices if w.status else []
    names = [f"{d.kind}:{d.index}" if d.kind == "cuda" else d.kind for d in devs]
    return ",".join(names) if names else w.spec.device


WORKER_COLUMNS = ("worker", "role", "host", "device", "layers", "state", "pid", "uptime", "rst", "exit")
NARROW_COLUMNS = tuple(c for c in WORKER_COLUMNS if c != "role")  # 80 columns: the name says the role


def worker_row(w: Worker, sup: Supervisor, now: float) -> tuple[list[str], str]:
    """One worker-table row (cells as in WORKER_COLUMNS) and the tone of its state cell."""
    state, tone = state_text(w, now)
    pid = w.shown_pid()
    row = [
        w.name,
        worker_role(w),
        w.spec.host,
        worker_devices(w),
        fmt_layers(worker_layers(w, sup)),
        state,
        str(pid) if pid else "—",
        fmt_duration(w.uptime(now)),
        str(w.restarts),
        exit_text(w),
    ]
    return row, tone


def worker_role(w: Worker) -> str:
    """The role the worker reports (a head started with --role prefill says "prefill"), else the profile's."""
    reported = w.status.role if w.status is not None else "?"
    return reported if reported != "?" else w.role


def pd_lines(status: Status | None) -> list[str]:
    """Prefill/decode disaggregation: totals, then each recent request's transfer or fallback."""
    pd = status.pd if status else None
    if pd is None:
        return []
    if pd.prefill_worker is None:  # a prefill worker
        return [f"served {pd.served} prefills · {fmt_bytes(pd.served_bytes)}"]
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(pd.fallback_reasons.items()))
    rate = f" · {pd.bytes / pd.seconds / 1e9:.2f} GB/s" if pd.seconds > 0 else ""
    out = [
        f"prefill worker {pd.prefill_worker} (≥ {pd.threshold} tokens) · {pd.transfers} transfers · "
        f"{fmt_bytes(pd.bytes)}{rate} · fallbacks {pd.fallbacks}" + (f" ({reasons})" if reasons else "")
    ]
    for t in pd.recent[-4:]:
        what = f"fallback: {t.fallback}" if t.fallback else f"{fmt_bytes(t.bytes)} in {t.ms:.0f} ms"
        out.append(f"request {t.request}: {t.tokens} tokens · {what}")
    return out


def exit_text(w: Worker, width: int = 48) -> str:
    """The last exit; for a crash loop or a busy port also its cause (its last log line), so the row names it."""
    code = describe_exit(w.last_exit)
    if w.state in (State.CRASH_LOOP, State.PORT_BUSY) and w.last_err:
        cause = w.last_err if len(w.last_err) <= width else w.last_err[: width - 1] + "…"
        return f"{code}: {cause}"
    return code


STATE_WORST_FIRST = [
    State.CRASH_LOOP, State.CRASHED, State.UNREACHABLE, State.PORT_BUSY, State.BACKOFF, State.DEGRADED,
    State.STARTING, State.STOPPING, State.READY, State.STOPPED,
]  # fmt: skip
STATE_ORDER = {s: i for i, s in enumerate(STATE_WORST_FIRST)}


def sort_key(w: Worker, column: str, sup: Supervisor, now: float) -> tuple:
    """The worker table sorts by what a column means (numbers as numbers, states worst first);
    a worker without a value sorts last, the name breaks ties."""
    value = {
        "worker": lambda: w.name,
        "role": lambda: w.role,
        "host": lambda: w.spec.host,
        "device": lambda: worker_devices(w),
        "layers": lambda: (worker_layers(w, sup) or [None])[0],
        "state": lambda: STATE_ORDER[w.state],
        "pid": w.shown_pid,
        "uptime": lambda: w.uptime(now),
        "rst": lambda: w.restarts,
        "exit": lambda: w.last_exit,
    }[column]()
    return (value is None, value if value is not None else 0, w.name)


def rate_label(name: str, now: float | None, hist: list[float]) -> str:
    """ "decode 187.5 tok/s · max 190 · avg 150": the sparkline's scale in words, over the samples it shows."""
    if not hist:
        return f"{name} {fmt_rate(now)}"
    return f"{name} {fmt_rate(now)} · max {_short(max(hist))} · avg {_short(sum(hist) / len(hist))}"


def _short(x: float) -> str:
    return f"{x / 1000:.1f}k" if x >= 1000 else f"{x:.0f}"


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


def memory_line(row: MemoryRow, width: int = 16) -> str:
    used = f"{fmt_bytes(row.used)}/{fmt_bytes(row.total)}"
    tail = f" {row.note}" if row.note else ""
    alert = " ⚠" if row.tone == "warn" else ""  # the warning reads without colour too
    return f"{row.label:<14} {bar(row.used, row.total, width)} {used}{alert}{tail}"


def throughput(sup: Supervisor) -> dict:
    """Head throughput now + the sparkline histories."""
    thr = sup.head.status.throughput if sup.head.status else None
    return {
        "prefill": thr.prefill_tok_s if thr else None,
        "decode": thr.decode_tok_s if thr else None,
        "prefill_hist": list(sup.head.prefill_hist),
        "decode_hist": list(sup.head.decode_hist),
    }


def acceptance_text(status: Status | None) -> str:
    spec = status.speculative if status else None
    if spec is None or spec.type == "off":
        return "spec off"
    mean_s = "—" if spec.mean_accepted_len is None else f"{spec.mean_accepted_len:.2f}"
    # The original system's headline: its drafter is the model's own MTP head.
    head = "MTP acceptance" if spec.type == "mtp" else f"spec {spec.type}: accept"
    return f"{head} {fmt_pct(spec.acceptance)} · mean len {mean_s} · drafts {spec.drafts}"


def pool_text(status: Status | None) -> str:
    """The merged RPC port as it is used: compute sessions (the pipeline's hops), the control pool
    (console ops: CONFIGURE, INFO, PROBE; never the API's requests), and sockets open but idle."""
    pool = status.pool if status else None
    if pool is None:
        return "RPC —"
    control = (
        f" · control pool {pool.busy}/{pool.size} busy, {pool.queued} queued, {pool.dropped} dropped"
        if pool.size
        else ""
    )
    return f"RPC {pool.compute} compute{control} · {pool.idle} idle sockets"


def slots_text(status: Status | None) -> str:
    """Request slots of the head: how many decode now."""
    slots = status.slots if status else []
    if not slots:
        return "slots —"
    return f"slots {sum(1 for s in slots if s.state == 'processing')}/{len(slots)} busy"


def _ms(x: float | None) -> str:
    return "—" if x is None else f"{x:.0f}"


def requests_text(status: Status | None) -> str:
    """The head's requests: slots, queue, rate, p50/p99 time to first token and inter-token latency."""
    r = status.requests if status else None
    if r is None:
        return slots_text(status)
    queue = f"queue {r.queued}" + (f"/{r.queue_max}" if r.queue_max is not None else "")
    return (
        f"slots {r.slots_busy}/{r.slots_total} · {queue} · {r.requests_per_s:.2f} req/s · p50/p99 "
        f"TTFT {_ms(r.ttft_p50_ms)}/{_ms(r.ttft_p99_ms)} · ITL {_ms(r.itl_p50_ms)}/{_ms(r.itl_p99_ms)} ms"
    )


def peer_pools(sup: Supervisor) -> dict[str, Pool]:
    """Each peer's merged RPC port as the peer's own /status reports it, by the address the head dials."""
    return {
        f"{connect_host(w.spec.host)}:{w.spec.rpc}": w.status.pool
        for w in list(sup.workers.values())[1:]
        if w.status is not None and w.status.pool is not None
    }


def port_text(pool: Pool) -> str:
    """A peer's merged port: the pipeline's sessions on it and, where it runs a pool, sessions busy /
    pool size, queued / queue max and dropped (the original system's headline: what a flood fills)."""
    occupancy = f" {pool.busy}/{pool.size} busy, {pool.queued}/{pool.queue_max} queued," if pool.size else ""
    return f"port {pool.compute} compute ·{occupancy} {pool.dropped} dropped"


def peer_lines(status: Status | None, alerts: Alerts, pools: dict[str, Pool] | None = None) -> list[tuple[str, str]]:
    """("127.0.0.1:8091 ● up 0.3 ms [9,18)", tone) per peer the head drives; "· cuda-ipc" when the
    hidden states stay on a GPU the head and peer share; its port's pool when `pools` (`peer_pools`)
    has it (warn once it dropped)."""
    out = []
    for p in status.peers if status else []:
        symbol, tone = {"up": ("●", "ok"), "connecting": ("◐", "busy"), "down": ("✖", "error")}.get(
            p.state, ("?", "muted")
        )
        rtt_s = "—" if p.rtt_ms is None else f"{p.rtt_ms:.1f} ms"
        if tone == "ok" and p.rtt_ms is not None and p.rtt_ms >= alerts.rtt_ms:
            tone, rtt_s = "warn", f"{rtt_s} ⚠"
        ipc = " · cuda-ipc" if p.transport == "cuda-ipc" else ""
        pool = (pools or {}).get(p.addr)
        if pool is not None and pool.dropped and tone == "ok":
            tone = "warn"
        port = f" · {port_text(pool)}" if pool is not None else ""
        out.append((f"{p.addr} {symbol} {p.state} rtt {rtt_s} {fmt_layers(p.layers)}{ipc}{port}", tone))
    return out


def active_alerts(sup: Supervisor, alerts: Alerts) -> dict[str, str]:
    """The profile's [alerts] thresholds crossed now: {incident key: message}. A key that stays
    active is one incident (one toast); once it clears, its next crossing is a new one."""
    out: dict[str, str] = {}
    for row in memory_rows(sup, alerts):
        if row.tone == "warn":
            out[f"memory:{row.label}"] = (
                f"{row.label} memory {row.used / row.total * 100:.0f}% (alert at {alerts.vram_pct:g}%)"
            )
    for p in sup.head.status.peers if sup.head.status else []:
        if p.state == "up" and p.rtt_ms is not None and p.rtt_ms >= alerts.rtt_ms:
            out[f"rtt:{p.addr}"] = f"peer {p.addr} RTT {p.rtt_ms:.1f} ms (alert at {alerts.rtt_ms:g} ms)"
    for w in sup.workers.values():
        if w.crash_restarts >= alerts.restarts:
            out[f"restarts:{w.name}"] = (
                f"{w.name} restarted {w.crash_restarts} times after crashes (alert at {alerts.restarts})"
            )
        if w.state == State.CRASH_LOOP:
            out[f"crash-loop:{w.name}"] = f"{w.name} is in a crash loop: {w.last_err or 'no log line'}"
    return out


def incident_line(inc) -> str:
    """One incident of the timeline (a triage.Incident); dated, as the timeline spans days."""
    return f"{time.strftime('%m-%d %H:%M:%S', time.localtime(inc.ts))} {inc.kind:<19} {inc.subject}: {inc.message}"


def parse_since(text: str) -> float:
    """ "90s", "30m", "2h", "7d" -> seconds (`hydra-console incidents --since`)."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    try:
        return float(text[:-1]) * units[text[-1]]
    except (KeyError, IndexError, ValueError):
        raise UserError(f"--since {text!r}: expected a number and s, m, h or d, e.g. 2h") from None


def event_line(ev: Event) -> str:
    who = f"{ev.worker}: " if ev.worker else ""
    return f"{time.strftime('%H:%M:%S', time.localtime(ev.ts))} {ev.kind:<11} {who}{ev.message}"


EVENT_TONES = {
    "ready": "ok",
    "crashed": "error",
    "crash-loop": "error",
    "adopted": "busy",
    "attached": "busy",
    "killed": "error",
    "error": "error",
    "unreachable": "error",
    "degraded": "warn",
    "restarted": "warn",
    "split": "busy",
}


def failure_label(text: str) -> str | None:
    for label, rx in FAILURE_PATTERNS:
        if rx.search(text):
            return label
    return None


def compile_filter(pattern: str) -> re.Pattern | None:
    """The `/` filter: a regex, or the literal text when it is not a valid regex."""
    if not pattern:
        return None
    try:
        return re.compile(pattern, re.IGNORECASE)
    except re.error:
        return re.compile(re.escape(pattern), re.IGNORECASE)


# The head's access log (engine/http_gate.py): "<12-hex id> POST /v1/completions 200 in=12 out=40 812ms".
ACCESS_LINE = re.compile(r"\b[0-9a-f]{12} [A-Z]+ /\S* \d{3}\b")


def filter_lines(lines, pattern: re.Pattern | None, invert: bool = False) -> list:
    if pattern is None:
        return list(lines)
    return [ln for ln in lines if bool(pattern.search(ln.text)) != invert]


def log_line_text(line, with_worker: bool) -> str:
    ts = time.strftime("%H:%M:%S", time.localtime(line.ts))
    who = f"{line.worker:<6} " if with_worker else ""
    return f"{ts} {who}{line.text}"


def snapshot(sup: Supervisor, incidents: list = (), open_incidents: list = ()) -> dict:
    """The `--once --json` document: one entry per worker, /status included as reported, the
    recent incidents and the open ones (triage.Incident) the caller passes."""
    now = sup.clock()
    out = []
    for w in sup.workers.values():
        p = w.probe
        out.append(
            {
                "name": w.name,
                "role": w.role,
                "url": w.spec.url,
                "state": w.state.value,
                "reachable": bool(p and p.reachable),
                "error": p.error if p else None,
                "pid": w.shown_pid(),
                "uptime_s": w.uptime(now),
                "layers": worker_layers(w, sup),
                "health": p.health.to_json() if p and p.health else None,
                "status": p.status.to_json() if p and p.status else None,
            }
        )
    return {
        "profile": sup.profile.name,
        "time": now,
        "workers": out,
        "incidents": [dataclasses.asdict(i) for i in incidents],
        "open_incidents": [dataclasses.asdict(i) for i in open_incidents],
    }


def snapshot_json(sup: Supervisor, incidents: list = (), open_incidents: list = ()) -> str:
    return json.dumps(snapshot(sup, incidents, open_incidents), indent=2, sort_keys=False)
