"""Incident triage: advice that names the setting to change, each peer's RTT over the last polls
(its spikes stand up), and a timeline that puts restarts, crash loops, peers down/up, RTT spikes,
pool drops, a full queue or context, acceptance collapse and latency spikes in one order (rules:
app/triage.py)."""

from __future__ import annotations

import time

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Header, Static

from .. import log_text, rtt_text, triage

SHOWN = 500  # newest incidents rendered (the log keeps days of them; `hydra-console incidents` prints all)
INCIDENT_TONES = {
    "crash": "error",
    "crash-loop": "error",
    "down": "error",
    "peer-down": "error",
    "up": "ok",
    "peer-up": "ok",
    "restart": "warn",
    "split": "busy",
}


def advice(app) -> list[triage.Advice]:
    """What to change now: judged on the head's recent polls and this console's events."""
    sup = app.supervisor
    return triage.advise(list(sup.head.history), list(sup.events), sup.profile.alerts)


class TriageScreen(Screen):
    BINDINGS = [Binding("escape", "app.pop_screen", "Back", id="triage.back")]

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static(id="triage-advice")
        yield Static(id="triage-rtt")
        with VerticalScroll(id="triage-scroll"):
            yield Static(id="triage-timeline")
        yield Footer()

    def on_mount(self) -> None:
        self.refresh_view()
        self.query_one("#triage-scroll", VerticalScroll).focus()

    def refresh_view(self) -> None:
        app = self.app
        now_advice, incidents = advice(app), app.incidents.since(0)
        strip = Text()
        for i, a in enumerate(now_advice):
            strip.append(("\n" if i else "") + f"⚑ {a.message}", style=app.tone_style("warn"))
        self.query_one("#triage-advice", Static).update(
            strip if now_advice else Text("⚑ nothing to change now", style="dim")
        )
        rtt = self.query_one("#triage-rtt", Static)
        peers = list(app.supervisor.head.rtt_hist.items())
        rtt.display = bool(peers)
        chart, cells = Text("Peer RTT (worst per poll)", style="bold"), rtt_text.chart_cells(self.size.width)
        for addr, hist in peers:
            line, tone = rtt_text.rtt_chart(hist, app.supervisor.profile.alerts.rtt_ms, cells)
            chart.append(f"\n{addr}\n  ")
            chart.append(line, style=app.tone_style(tone))
        rtt.update(chart)
        since = f" since {time.strftime('%Y-%m-%d %H:%M', time.localtime(incidents[0].ts))}" if incidents else ""
        older = len(incidents) - SHOWN
        more = f" (the newest {SHOWN}; hydra-console incidents --since prints all)" if older > 0 else ""
        timeline = Text(f"Timeline · {len(incidents)} incidents{since}{more}\n", style="bold")
        for inc in incidents[-SHOWN:]:
            tone = INCIDENT_TONES.get(inc.kind, "warn")
            timeline.append(log_text.incident_line(inc) + "\n", style=app.tone_style(tone))
        self.query_one("#triage-timeline", Static).update(timeline)
