"""Logs: one worker or all merged, follow/pause, `/` regex filter, `!` invert, `a` the head's access
log only (one line per API request), failures highlighted."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import Footer, Header, Input, Label

from .. import log_text
from .wrapped_log import WrappedLog

SHOWN = 2000  # lines re-rendered when the view changes


class LogsScreen(Screen):
    BINDINGS = [
        Binding("escape", "app.pop_screen", "Back", id="logs.back"),
        Binding("w", "next_source", "Worker", id="logs.worker"),
        Binding("f", "toggle_follow", "Follow", id="logs.follow"),
        Binding("exclamation_mark", "toggle_invert", "Invert", id="logs.invert"),
        Binding("c", "clear_filter", "Clear filter", id="logs.clear"),
        Binding("a", "toggle_requests", "Requests only", id="logs.requests"),
    ]

    def __init__(self, worker: str | None = None, pattern: str = ""):
        super().__init__()
        self.source = worker  # None = merged
        self.pattern_text = pattern
        self.invert = False
        self.follow = True
        self.requests_only = False  # only the access log's lines (log_text.ACCESS_LINE)
        self._last_seq = -1

    def compose(self) -> ComposeResult:
        yield Header()
        yield Label(id="logbar")
        filt = Input(placeholder="regex filter (enter to apply, esc to leave)", id="filter", value=self.pattern_text)
        filt.display = bool(self.pattern_text)
        yield filt
        yield WrappedLog(self.rerender, id="log", max_lines=SHOWN * 2, min_width=40)
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#log", WrappedLog).focus()
        self.set_interval(0.25, self.append_new)

    def _lines(self):
        sup = self.app.supervisor
        return sup.merged_log if self.source is None else sup.worker(self.source).log

    def _bar(self) -> None:
        bar = Text()
        for name in ["all", *self.app.supervisor.workers]:
            current = name == (self.source or "all")
            bar.append(f"[{name}]" if current else f" {name} ", style="bold reverse" if current else "")
            bar.append(" ")
        bar.append(f" · {'following' if self.follow else 'paused'}")
        if self.requests_only:
            bar.append("  requests only")
        if self.pattern_text:
            bar.append(f"  filter {'!' if self.invert else ''}/{self.pattern_text}/")
        self.query_one("#logbar", Label).update(bar)

    def _write(self, log: WrappedLog, line) -> None:
        text = log_text.log_line_text(line, with_worker=self.source is None)
        label = log_text.failure_label(line.text)
        # Only known failures stand out: workers log everything to stderr, so the stream says little.
        if label:
            log.write_line(Text(f"{text}  ◀ {label}", style=f"bold {self.app.tone_style('error')}"))
        else:
            log.write_line(Text(text))

    def rerender(self) -> None:
        self._bar()
        log = self.query_one("#log", WrappedLog)
        log.clear()
        lines = list(self._lines())
        self._last_seq = lines[-1].seq if lines else self._last_seq
        for line in self._visible(lines)[-SHOWN:]:
            self._write(log, line)

    def append_new(self) -> None:
        if not self.follow:
            return
        new = [ln for ln in list(self._lines())[-SHOWN:] if ln.seq > self._last_seq]
        if not new:
            return
        self._last_seq = new[-1].seq
        log = self.query_one("#log", WrappedLog)
        for line in self._visible(new):
            self._write(log, line)

    def _visible(self, lines) -> list:
        if self.requests_only:
            lines = log_text.filter_lines(lines, log_text.ACCESS_LINE)
        return log_text.filter_lines(lines, log_text.compile_filter(self.pattern_text), self.invert)

    def action_focus_filter(self) -> None:
        filt = self.query_one("#filter", Input)
        filt.display = True
        filt.focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.pattern_text = event.value
        self.query_one("#log", WrappedLog).focus()
        self.query_one("#filter", Input).display = bool(self.pattern_text)
        self.rerender()

    def on_key(self, event) -> None:
        filt = self.query_one("#filter", Input)
        if event.key == "escape" and filt.has_focus:
            event.stop()
            filt.value = self.pattern_text
            filt.display = bool(self.pattern_text)
            self.query_one("#log", WrappedLog).focus()

    def action_next_source(self) -> None:
        names = [None, *self.app.supervisor.workers]
        self.source = names[(names.index(self.source) + 1) % len(names)]
        self.rerender()

    def action_toggle_follow(self) -> None:
        self.follow = not self.follow
        self.query_one("#log", WrappedLog).auto_scroll = self.follow
        self.rerender()

    def action_toggle_invert(self) -> None:
        self.invert = not self.invert
        self.rerender()

    def action_toggle_requests(self) -> None:
        self.requests_only = not self.requests_only
        self.rerender()

    def action_clear_filter(self) -> None:
        self.pattern_text = ""
        self.invert = False
        filt = self.query_one("#filter", Input)
        filt.value, filt.display = "", False
        self.rerender()
