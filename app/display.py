"""Plain functions that turn supervisor state and /status documents into text.

No Textual here: the UI styles what these return (a `tone` per value: ok / warn / error / busy /
muted), and tests check them without a terminal. Every state carries a symbol and a word, so
nothing depends on colour (NO_COLOR, colour-blind users, a monochrome SSH terminal).
"""

from __future__ import annotations

import dataclasses
import json

from ..contracts.status import READY_STAGE, Pool, Status
from .config import Alerts
from .launch import connect_host
from .memory_text import MemoryRow, memory_rows
from .records import State, Worker, describe_exit
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


def state_text(w: Worker, now: float) -> tuple[str, str]:
    """("● ready", "ok"); backoff shows the seconds left until the next try."""
    symbol, tone = STATE_LOOK[w.state]
    word = w.state.value
    if w.state in (State.BACKOFF, State.CRASH_LOOP) and w.backoff_until is not None and not w.running:
        word = f"{word} {max(0.0, w.backoff_until - now):.0f}s"
    elif w.state == State.STARTING and w.status:
        word = f"starting {w.status.startup_stage}/{READY_STAGE}"
    elif w.state == State.READY and w.status and w.status.sleeping:  # --sleep-idle-seconds: a request wakes it
        word = "ready, asleep"
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


def draft_slots_text(status: Status | None) -> str:
    """Adaptive drafting per slot: the k each slot's last step drafted (0: plain decode) and its
    estimated acceptance at each draft position; "" when the head does not adapt k."""
    spec = status.speculative if status else None
    if spec is None or not spec.adaptive or not spec.slots:
        return ""
    parts = [
        f"s{s.slot} k={s.k}" + (f" ({' '.join(fmt_pct(a) for a in s.acceptance)})" if s.acceptance else "")
        for s in spec.slots
    ]
    return "draft k " + " · ".join(parts)


def step_text(history) -> str:
    """Where the head's steps went between its last two /status answers (`Worker.history`): "step
    14.2 ms · schedule 1.1 · forward 11.8 · read 0.9 · emit 0.4", an average step's milliseconds by
    phase (schedule: drafting included; read: waiting for the device); "" when no step ran."""
    ms = history[-1][1].throughput.step_ms_since(history[-2][1].throughput) if len(history) > 1 else None
    if ms is None:
        return ""
    return f"step {sum(ms.values()):.1f} ms · " + " · ".join(f"{k} {v:.1f}" for k, v in ms.items())


def pool_text(status: Status | None) -> str:
    """The merged RPC port as it is used: compute sessions (the pipeline's hops), the control pool
    (console ops: CONFIGURE, INFO, PROBE; never the API's requests), and sockets open but idle; on a
    peer, the head's sessions and its pool (`port_text`)."""
    pool = status.pool if status else None
    if pool is None:
        return "RPC —"
    if status.role == "peer" and pool.size:  # its pool serves the clients other than the head's session
        return f"RPC {pool.compute} compute · {port_text(pool)}"
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
    """A peer's merged port as the original system showed it: sessions busy / pool size · queued ·
    dropped (what a flood fills; the head's own sessions are served beside the pool). A peer that
    runs no pool: the head's sessions on it and what it dropped."""
    if not pool.size:
        return f"port {pool.compute} compute · {pool.dropped} dropped"
    return f"pool {pool.busy}/{pool.size} · {pool.queued} queued · {pool.dropped} dropped"


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
        peak = p.rtt_peak_ms
        if peak is not None and p.rtt_ms is not None and peak > p.rtt_ms and peak >= alerts.rtt_ms:
            rtt_s += f" (max {peak:.1f})"  # a spike since the last poll: the last round trip was normal again
        if tone == "ok" and peak is not None and peak >= alerts.rtt_ms:
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
        if p.state == "up" and p.rtt_peak_ms is not None and p.rtt_peak_ms >= alerts.rtt_ms:
            out[f"rtt:{p.addr}"] = f"peer {p.addr} RTT {p.rtt_peak_ms:.1f} ms (alert at {alerts.rtt_ms:g} ms)"
    for w in sup.workers.values():
        if w.crash_restarts >= alerts.restarts:
            out[f"restarts:{w.name}"] = (
                f"{w.name} restarted {w.crash_restarts} times after crashes (alert at {alerts.restarts})"
            )
        if w.state == State.CRASH_LOOP:
            out[f"crash-loop:{w.name}"] = f"{w.name} is in a crash loop: {w.last_err or 'no log line'}"
    return out


def snapshot(sup: Supervisor, incidents: list = (), open_incidents: list = (), plan: dict | None = None) -> dict:
    """The `--once --json` document: one entry per worker, /status included as reported, the
    recent incidents and the open ones (triage.Incident) the caller passes, and the split plan
    against the cards (split_fit.CardPlan.to_json) when given."""
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
        "plan": plan,
    }


def snapshot_json(sup: Supervisor, incidents: list = (), open_incidents: list = (), plan: dict | None = None) -> str:
    return json.dumps(snapshot(sup, incidents, open_incidents, plan), indent=2, sort_keys=False)
