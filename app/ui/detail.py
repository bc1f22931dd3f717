"""Worker detail: how it was launched, what its /health and /status say, its events and last log lines."""

from __future__ import annotations

import shlex

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Header, Static

from .. import display, log_text

LOG_TAIL = 15


class WorkerDetailScreen(Screen):
    BINDINGS = [Binding("escape", "app.pop_screen", "Back", id="detail.back")]

    def __init__(self, worker: str):
        super().__init__()
        self.worker_name = worker

    @property
    def selected_worker(self) -> str:
        return self.worker_name

    def compose(self) -> ComposeResult:
        yield Header()
        with VerticalScroll():
            yield Static(id="detail-info")
            yield Static(id="detail-events")
            yield Static(id="detail-log")
        yield Footer()

    def on_mount(self) -> None:
        self.refresh_view()

    def refresh_view(self) -> None:
        app = self.app
        sup = app.supervisor
        w = sup.worker(self.worker_name)
        now = sup.clock()
        st = w.status
        state, tone = display.state_text(w, now)
        t = Table(box=None, show_header=False, pad_edge=False)
        t.add_column(style="bold", no_wrap=True)
        t.add_column()
        model = st.model if st else None
        rows = [
            ("worker", f"{w.name} ({w.role}, {'started by this console' if w.managed else 'attached, monitor only'})"),
            ("state", Text(state, style=app.tone_style(tone))),
            ("pid", str(w.shown_pid() or "—")),
            ("uptime", display.fmt_duration(w.uptime(now))),
            (
                "restarts",
                f"{w.restarts} ({w.crash_restarts} automatic) · last exit {display.describe_exit(w.last_exit)}",
            ),
            ("http", w.spec.url),
            ("rpc", f"{w.spec.rpc_host or w.spec.host}:{w.spec.rpc}"),
            ("layers", display.fmt_layers(display.worker_layers(w, sup))),
            ("model", f"{model.name} ({model.arch}, {model.n_layers} layers)" if model else "—"),
            (
                "health",
                f"{w.probe.health_state or 'no answer'} (stage {w.probe.health.startup_stage if w.probe.health else '—'})"
                if w.probe
                else "not polled yet",
            ),
        ]
        if w.probe and w.probe.error:
            rows.append(("last error", Text(w.probe.error, style=app.tone_style("error"))))
        if w.rss is not None:
            rows.append(("process", f"rss {display.fmt_bytes(w.rss)} · cpu {w.cpu_pct or 0:.0f}%"))
        for d in st.devices if st else []:
            rows.append(
                (
                    f"device {d.index}",
                    f"{d.kind} {d.name} · {display.fmt_bytes(d.memory_used)}/{display.fmt_bytes(d.memory_total)}",
                )
            )
        stages = [f"{s.role} {display.fmt_layers(s.layers)} {s.device}".rstrip() for s in (st.stages if st else [])]
        if stages:
            rows.append(("stages", " · ".join(stages)))
        if st and (st.requests or st.slots):
            rows.append(("requests", display.requests_text(st)))
        if st and st.pool:
            rows.append(("rpc port", display.pool_text(st)))
        for i, line in enumerate(display.pd_lines(st)):
            rows.append(("P/D" if i == 0 else "", line))
        # The argv the process really runs; what a (re)start would launch only when it differs.
        if w.argv:
            rows.append(("command", shlex.join(w.argv)))
        if w.managed:
            upcoming = sup.command_for(w.name)
            if upcoming != w.argv:
                rows.append(("next start", shlex.join(upcoming)))
            rows.append(("log file", str(w.log_path)))
        for k, v in rows:
            t.add_row(k, v)
        self.query_one("#detail-info", Static).update(t)

        evs = [log_text.event_line(e) for e in sup.events if e.worker == w.name][-8:]
        self.query_one("#detail-events", Static).update(Text("Events\n" + ("\n".join(evs) or "none")))
        lines = [log_text.log_line_text(ln, with_worker=False) for ln in list(w.log)[-LOG_TAIL:]]
        self.query_one("#detail-log", Static).update(Text("Log (l for all)\n" + ("\n".join(lines) or "empty")))
