"""Alert history: every incident the profile's [alerts] thresholds raised in this session, newest last."""

from __future__ import annotations

import time

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static


class AlertsScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,q,A", "dismiss", "Close", id="alerts.close")]

    def compose(self) -> ComposeResult:
        history = self.app.alert_history
        lines = [f"{time.strftime('%H:%M:%S', time.localtime(ts))} {message}" for ts, message in history]
        with VerticalScroll(id="help"):
            yield Static(f"Alerts · {len(history)} this session", classes="title")
            yield Static(Text("\n".join(lines) or "none so far"))
            yield Static("thresholds: the profile's [alerts] table · esc closes", classes="hint", markup=False)

    def on_mount(self) -> None:
        self.query_one("#help", VerticalScroll).focus()
