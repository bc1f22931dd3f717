"""Dashboard: worker table, per-device memory, throughput sparklines, pool/peers and their RTT, event timeline."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Header, Label, Sparkline, Static

from .. import display, log_text, memory_text, rtt_text
from . import triage
from .wrapped_log import WrappedLog

SPARK_SAMPLES = 60  # the sparklines show the last minute at 1 Hz


class DashboardScreen(Screen):
    BINDINGS = [Binding("o", "sort_next", "Sort", id="dash.sort")]

    def __init__(self):
        super().__init__()
        self._columns: tuple[str, ...] = ()  # worker-table columns now shown
        self._width = 0  # screen width of the last refresh
        self.sort_column: str | None = None  # None: profile order
        self.sort_reverse = False

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
            yield Static(id="advice")
            events = WrappedLog(self.replay_events, id="events", max_lines=500, min_width=20)
            events.border_title = "Events"
            yield events
        yield Footer()

    def on_mount(self) -> None:
        self.replay_events()
        self.refresh_view()

    def replay_events(self) -> None:
        log = self.query_one("#events", WrappedLog)
        log.clear()
        for ev in self.app.supervisor.events:
            self.add_event(ev, log)

    @property
    def selected_worker(self) -> str | None:
        table = self.query_one("#workers", DataTable)
        if table.row_count == 0:
            return None
        row_key, _ = table.coordinate_to_cell_key(table.cursor_coordinate)
        return row_key.value

    def add_event(self, ev, log: WrappedLog | None = None) -> None:
        log = log or self.query_one("#events", WrappedLog)
        tone = log_text.EVENT_TONES.get(ev.kind)
        log.write_line(Text(log_text.event_line(ev), style=self.app.tone_style(tone) if tone else ""))

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        self.app.action_detail(event.row_key.value)

    def on_data_table_header_selected(self, event: DataTable.HeaderSelected) -> None:
        """Click a header to sort by it; click it again to reverse."""
        column = str(event.column_key.value)
        self.sort_reverse = not self.sort_reverse if column == self.sort_column else False
        self.sort_column = column
        self.refresh_view()

    def action_sort_next(self) -> None:
        """`o`: sort by the next column shown (after the last one: back to profile order)."""
        order = [None, *self._columns]
        self.sort_column = (
            order[(order.index(self.sort_column) + 1) % len(order)] if self.sort_column in order else None
        )
        self.sort_reverse = False
        self.refresh_view()

    def on_resize(self) -> None:
        # Also sent when the screen comes back from logs/detail: redraw only if the width really changed.
        if self.size.width != self._width:
            self.refresh_view()

    def _table(self) -> DataTable:
        """The worker table, its columns chosen for the width (it is rebuilt when that changes)."""
        table = self.query_one("#workers", DataTable)
        columns = display.NARROW_COLUMNS if self.size.width < 100 else display.WORKER_COLUMNS
        if columns != self._columns:
            selected = self.selected_worker if self._columns else None
            table.clear(columns=True)
            for col in columns:
                table.add_column(col, key=col)
            names = list(self.app.supervisor.workers)
            for name in names:
                table.add_row(*([""] * len(columns)), key=name)
            if selected in names:
                table.move_cursor(row=names.index(selected))
            self._columns = columns
        return table

    def refresh_view(self) -> None:
        app = self.app
        sup = app.supervisor
        now = sup.clock()
        self._width = self.size.width
        table = self._table()
        for w in sup.workers.values():
            cells, tone = display.worker_row(w, sup, now)
            for col, value in zip(display.WORKER_COLUMNS, cells):
                if col not in self._columns:
                    continue
                cell = Text(value, style=app.tone_style(tone)) if col == "state" else value
                if col == "rst" and w.crash_restarts >= sup.profile.alerts.restarts:  # the operator's R is no alert
                    cell = Text(f"{value} ⚠", style=app.tone_style("warn"))
                table.update_cell(w.name, col, cell, update_width=True)

        self._sort(table, now)

        rows = memory_text.memory_rows(sup, sup.profile.alerts)
        width = 8 if self.size.width < 100 else 20
        memory = Text()
        for i, row in enumerate(rows):
            if i:
                memory.append("\n")
            memory.append(display.memory_line(row, width), style=app.tone_style(row.tone))
        self.query_one("#memory", Static).update(memory if rows else Text("no device data yet", style="dim"))

        thr = display.throughput(sup)
        for name in ("prefill", "decode"):
            hist = thr[f"{name}_hist"][-SPARK_SAMPLES:]
            self.query_one(f"#{name}-label", Label).update(display.rate_label(name, thr[name], hist))
            # A leading 0 anchors the scale at zero, so a steady rate reads as a level, not as empty.
            self.query_one(f"#{name}", Sparkline).data = [0.0, *hist] if hist else []

        status = sup.head.status
        info = Text()
        info.append(display.requests_text(status))
        info.append(f"\n{display.acceptance_text(status)}")
        if slots := display.draft_slots_text(status):
            info.append(f"\n{slots}")
        if step := display.step_text(sup.head.history):
            info.append(f"\n{step}")
        info.append(f"\n{display.pool_text(status)}")
        peers = status.peers if status else []
        cells = rtt_text.chart_cells(self.size.width)
        for p, (line, tone) in zip(peers, display.peer_lines(status, sup.profile.alerts, display.peer_pools(sup))):
            info.append("\npeer ")
            info.append(line, style=app.tone_style(tone))
            chart, tone = rtt_text.rtt_chart(sup.head.rtt_hist.get(p.addr, ()), sup.profile.alerts.rtt_ms, cells)
            info.append("\n     rtt ")
            info.append(chart, style=app.tone_style(tone))
        self.query_one("#info", Static).update(info)

        # The advisor strip: the first thing to change, when there is one (i: all, with the timeline).
        advice = triage.advice(app)
        strip = self.query_one("#advice", Static)
        strip.display = bool(advice)
        if advice:
            more = f" (+{len(advice) - 1} · i)" if len(advice) > 1 else " (i)"
            strip.update(Text(f"⚑ {advice[0].message}{more}", style=app.tone_style("warn")))

    def _sort(self, table: DataTable, now: float) -> None:
        title = "Workers" + (
            "" if all(w.managed for w in self.app.supervisor.workers.values()) else " (attached ones are monitor only)"
        )
        if self.sort_column in self._columns:
            sup, column, selected = self.app.supervisor, self.sort_column, self.selected_worker
            table.sort(
                "worker",
                key=lambda name: display.sort_key(sup.workers[str(name)], column, sup, now),
                reverse=self.sort_reverse,
            )
            if selected:
                table.move_cursor(row=table.get_row_index(selected))
            title += f" · by {column} {'▼' if self.sort_reverse else '▲'}"
        table.border_title = title
