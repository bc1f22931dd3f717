"""Dashboard: worker table, per-device memory, throughput sparklines, pool/peers, event timeline."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Header, Label, RichLog, Sparkline, Static

from .. import display


class DashboardScreen(Screen):
    def compose(self) -> ComposeResult:
        yield Header()
        with Vertical(id="dash"):
            table = DataTable(id="workers", cursor_type="row", zebra_stripes=False)
            table.border_title = "Workers"
            yield table
            memory = Static(id="memory")
            memory.border_title = "Memory"
            yield memory
            with Horizontal(id="rates"):
                yield Label("prefill —", id="prefill-label", classes="rate-label")
                yield Sparkline([], id="prefill", summary_function=max)
                yield Label("decode —", id="decode-label", classes="rate-label")
                yield Sparkline([], id="decode", summary_function=max)
            yield Static(id="info")
            events = RichLog(id="events", max_lines=500, wrap=False, min_width=20)
            events.border_title = "Events"
            yield events
        yield Footer()

    def on_mount(self) -> None:
        table = self.query_one("#workers", DataTable)
        for col in display.WORKER_COLUMNS:
            table.add_column(col, key=col)
        for w in self.app.supervisor.workers.values():
            table.add_row(*([""] * len(display.WORKER_COLUMNS)), key=w.name)
        log = self.query_one("#events", RichLog)
        for ev in self.app.supervisor.events:
            self.add_event(ev, log)
        self.refresh_view()

    @property
    def selected_worker(self) -> str | None:
        table = self.query_one("#workers", DataTable)
        if table.row_count == 0:
            return None
        row_key, _ = table.coordinate_to_cell_key(table.cursor_coordinate)
        return row_key.value

    def add_event(self, ev, log: RichLog | None = None) -> None:
        log = log or self.query_one("#events", RichLog)
        tone = display.EVENT_TONES.get(ev.kind)
        log.write(Text(display.event_line(ev), style=self.app.tone_style(tone) if tone else ""))

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        self.app.action_detail(event.row_key.value)

    def refresh_view(self) -> None:
        app = self.app
        sup = app.supervisor
        now = sup.clock()
        table = self.query_one("#workers", DataTable)
        for w in sup.workers.values():
            cells, tone = display.worker_row(w, sup, now)
            for col, value in zip(display.WORKER_COLUMNS, cells):
                cell = Text(value, style=app.tone_style(tone)) if col == "state" else value
                if col == "rst" and w.restarts >= sup.profile.alerts.restarts:
                    cell = Text(value, style=app.tone_style("warn"))
                table.update_cell(w.name, col, cell, update_width=True)

        rows = display.memory_rows(sup, sup.profile.alerts)
        width = 8 if self.size.width < 100 else 20
        memory = Text()
        for i, row in enumerate(rows):
            if i:
                memory.append("\n")
            memory.append(display.memory_line(row, width), style=app.tone_style(row.tone))
        self.query_one("#memory", Static).update(memory if rows else Text("no device data yet", style="dim"))

        thr = display.throughput(sup)
        self.query_one("#prefill-label", Label).update(f"prefill {display.fmt_rate(thr['prefill'])}")
        self.query_one("#decode-label", Label).update(f"decode {display.fmt_rate(thr['decode'])}")
        # A leading 0 anchors the scale at zero, so a steady rate reads as a level, not as empty.
        self.query_one("#prefill", Sparkline).data = [0.0, *thr["prefill_hist"][-60:]] if thr["prefill_hist"] else []
        self.query_one("#decode", Sparkline).data = [0.0, *thr["decode_hist"][-60:]] if thr["decode_hist"] else []

        status = sup.head.status
        info = Text()
        info.append(display.acceptance_text(status))
        info.append("  ·  ")
        info.append(display.pool_text(status))
        for line, tone in display.peer_lines(status, sup.profile.alerts):
            info.append("\npeer ")
            info.append(line, style=app.tone_style(tone))
        self.query_one("#info", Static).update(info)
