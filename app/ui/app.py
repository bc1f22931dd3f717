"""The Textual app: observes the supervisor and sends it commands; owns no process logic."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Callable, Iterable

from textual import work
from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.screen import Screen

from ...contracts.default_model import default_model_path
from ...contracts.errors import UserError
from ...contracts.split import split_arg
from ...themes import THEMES
from .. import display
from ..config import resolve_profile_path, save_profile
from ..incidents import IncidentLog
from ..records import SupervisorError
from ..split_plan import ModelShape
from ..supervisor import Supervisor
from .alerts import AlertsScreen
from .dashboard import DashboardScreen
from .detail import WorkerDetailScreen
from .dialogs import ConfirmScreen, HelpScreen
from .logs import LogsScreen
from .palette import system_commands
from .split_editor import SplitEditorScreen
from .triage import TriageScreen


def binding_ids() -> set[str]:
    """Every id a profile's [keys] table may remap."""
    classes = (
        HydraConsole,
        DashboardScreen,
        LogsScreen,
        SplitEditorScreen,
        WorkerDetailScreen,
        ConfirmScreen,
        HelpScreen,
        AlertsScreen,
    )
    return {b.id for cls in classes for b in cls.BINDINGS if isinstance(b, Binding) and b.id}


REFRESH_RATES = (0.5, 1.0, 2.0, 5.0)  # `r` cycles through these (and the profile's poll_s): slower saves a slow link


class HydraConsole(App):
    CSS_PATH = "console.tcss"
    TITLE = "hydra-console"
    BINDINGS = [
        Binding("q", "request_quit", "Quit", id="hydra.quit"),
        Binding("question_mark", "help", "Help", id="hydra.help"),
        Binding("s", "split_editor", "Split", id="hydra.split"),
        Binding("R", "restart_selected", "Restart", id="hydra.restart"),
        Binding("l", "logs", "Logs", id="hydra.logs"),
        Binding("slash", "filter", "Filter", id="hydra.filter"),
        Binding("t", "cycle_theme", "Theme", show=False, id="hydra.theme"),
        Binding("p", "toggle_pause", "Pause", id="hydra.pause"),
        Binding("r", "next_refresh_rate", "Refresh rate", show=False, id="hydra.rate"),
        Binding("A", "alerts", "Alerts", show=False, id="hydra.alerts"),
        Binding("i", "triage", "Triage", show=False, id="hydra.triage"),
        # Declared here (Textual then adds none of its own) so that the palette key is remappable too.
        Binding("ctrl+p", "command_palette", "palette", show=False, priority=True, id="hydra.palette"),
    ]

    def __init__(
        self,
        supervisor: Supervisor,
        *,
        readonly: bool = False,
        theme: str = "hydra-dark",
        profile_path: Path | None = None,
        model_shape: ModelShape | None = None,
        load_model_shape: bool = True,
        incidents: IncidentLog | None = None,
    ):
        # NO_COLOR (Textual reads it here too): no colour codes at all. Textual's own answer for a
        # theme of RGB colours is a greyscale, sent as colour codes; with ANSI colours it drops them.
        super().__init__(ansi_color=True if os.environ.get("NO_COLOR") is not None else None)
        self.supervisor = supervisor
        # The triage timeline; the entry point passes the profile's file, else it lives in memory.
        self.incidents = incidents or IncidentLog(supervisor.profile.alerts)
        self.readonly = readonly or supervisor.readonly
        self.profile_path = profile_path
        self.model_shape = model_shape
        self._load_model_shape = load_model_shape and model_shape is None
        self._initial_theme = theme
        self._unsubscribe: Callable[[], None] | None = None
        self.paused = False  # the view holds still to be read; supervision goes on
        self.refresh_s = supervisor.settings.poll_s
        self._refresh_timer = None
        self.alert_history: list[tuple[float, str]] = []
        self._alerting: set[str] = set()  # incidents active now (each raised once)
        self.dashboard = DashboardScreen()
        for t in THEMES.values():
            self.register_theme(t)

    # ---- lifecycle -------------------------------------------------------------------------

    def on_mount(self) -> None:
        self.theme = self._initial_theme
        p = self.supervisor.profile
        self._show_mode()
        if p.keys:
            unknown = sorted(set(p.keys) - binding_ids())
            if unknown:
                self.notify(
                    f"profile [keys]: unknown binding id {', '.join(unknown)} "
                    f"(known: {', '.join(sorted(binding_ids()))})",
                    severity="warning",
                    timeout=15,
                    markup=False,
                )
            self.set_keymap(p.keys)
        self.push_screen(self.dashboard)
        self._unsubscribe = self.supervisor.subscribe(self._on_supervisor_event)
        self._unfollow_incidents = self.incidents.follow(self.supervisor)
        self._refresh_timer = self.set_interval(self.refresh_s, self._tick)
        self._start_supervisor()
        self._on_signals()
        if self._load_model_shape:
            self._load_shape()

    def _on_signals(self) -> None:
        """Serving outlives the terminal: a dropped SSH session (SIGHUP) detaches, leaving every worker
        and the run file for the next console to adopt. A kill (SIGTERM) stops what this console runs."""
        loop = asyncio.get_running_loop()
        for sig, stop in ((signal.SIGHUP, False), (signal.SIGTERM, True)):
            try:
                loop.add_signal_handler(sig, self._stop_and_exit, stop, sig == signal.SIGHUP)
            except (NotImplementedError, RuntimeError, ValueError):  # not the main thread (tests), or no such signal
                pass

    def on_unmount(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGHUP, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        if self._unsubscribe:
            self._unsubscribe()
            self._unsubscribe = None
            self._unfollow_incidents()

    @work(exclusive=False, group="supervisor")
    async def _start_supervisor(self) -> None:
        try:
            await self.supervisor.start()
        except SupervisorError as e:
            self.notify(str(e), severity="error")

    @work(thread=True, group="model")
    def _load_shape(self) -> None:
        try:
            path = self.supervisor.profile.model or default_model_path()
            self.model_shape = ModelShape.from_gguf(path)
        except Exception as e:  # the editor still works without estimates; say why they are missing
            try:
                self.call_from_thread(self.notify, f"no memory estimates: {e}", severity="warning")
            except RuntimeError:  # the app quit while the file was being read
                pass

    def _show_mode(self) -> None:
        self.sub_title = " · ".join(
            [
                f"profile {self.supervisor.profile.name}",
                *(["READ-ONLY"] if self.readonly else []),
                *([f"workers run by console pid {self.supervisor.owner}"] if self.supervisor.owner else []),
                *(["PAUSED (p)"] if self.paused else []),
                f"refresh {self.refresh_s:g} s",
            ]
        )

    def action_toggle_pause(self) -> None:
        self.paused = not self.paused
        self._show_mode()
        if not self.paused and self.dashboard.is_mounted:
            self.dashboard.replay_events()  # what happened while paused
            self.refresh_view()

    def action_next_refresh_rate(self) -> None:
        rates = sorted({*REFRESH_RATES, self.supervisor.settings.poll_s})
        self.refresh_s = next((r for r in rates if r > self.refresh_s), rates[0])
        self._refresh_timer.stop()
        self._refresh_timer = self.set_interval(self.refresh_s, self._tick)
        self._show_mode()

    def _tick(self) -> None:
        self.check_alerts()
        self.refresh_view()

    def check_alerts(self) -> None:
        """A toast and a bell once per incident (also while paused), and a line in the history (`A`)."""
        if not self.is_running:
            return
        active = display.active_alerts(self.supervisor, self.supervisor.profile.alerts)
        for key in active.keys() - self._alerting:
            self.alert_history.append((self.supervisor.clock(), active[key]))
            self.notify(active[key], title="alert", severity="warning", timeout=10, markup=False)
            self.bell()
        self._alerting = set(active)

    def action_triage(self) -> None:
        if not isinstance(self.screen, TriageScreen):
            self.push_screen(TriageScreen())

    def action_alerts(self) -> None:
        if not isinstance(self.screen, AlertsScreen):
            self.push_screen(AlertsScreen())

    def _on_supervisor_event(self, ev) -> None:
        # The supervisor outlives the app by a moment at shutdown: never touch a dead UI.
        if not self.is_running or not self.dashboard.is_mounted or self.paused:
            return
        self.dashboard.add_event(ev)
        self.refresh_view()

    def refresh_view(self) -> None:
        if not self.is_running or self.paused:
            return
        for screen in {self.dashboard, self.screen}:
            if screen.is_mounted and hasattr(screen, "refresh_view"):
                screen.refresh_view()

    def tone_style(self, tone: str | None) -> str:
        t = self.current_theme
        colour = {"ok": t.success, "warn": t.warning, "error": t.error, "busy": t.primary}.get(tone or "")
        return "dim" if tone == "muted" else (colour or "")

    # ---- actions -----------------------------------------------------------------------------

    def refused(self, what: str) -> bool:
        """A read-only console starts, stops and applies nothing; a refused key says so."""
        if self.readonly:
            self.notify(f"read-only console: {what} is disabled", severity="warning")
        return self.readonly

    def _selected(self) -> str | None:
        for screen in (self.screen, self.dashboard):
            name = getattr(screen, "selected_worker", None)
            if name:
                return name
        return None

    def action_request_quit(self) -> None:
        running = self.supervisor.running_managed()
        if not running:
            self._stop_and_exit(False)
            return
        names = ", ".join(f"{w.name} (pid {w.pid or '—'})" for w in running)
        self.push_screen(
            ConfirmScreen(
                f"Quit. Stop the workers this console runs: {names}? Or detach and leave them "
                "running: the next console of this profile adopts them.",
                yes="Stop all and quit",
                other=("d", "Detach"),
            ),
            lambda answer: self._stop_and_exit(answer is True) if answer else None,
        )

    async def action_quit(self) -> None:
        """Textual's own quit (ctrl+q, palette) asks too: workers must not be orphaned silently."""
        self.action_request_quit()

    @work(exclusive=True, group="quit")
    async def _stop_and_exit(self, stop_workers: bool, hangup: bool = False) -> None:
        if stop_workers:
            self.notify("stopping workers…")
        await self.supervisor.shutdown(stop_workers=stop_workers)
        if hangup:
            # The terminal is gone: Textual's restore would wait forever on writes nobody reads.
            os._exit(0)
        self.exit()

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen(self.screen))

    def action_split_editor(self) -> None:
        if not isinstance(self.screen, SplitEditorScreen):
            self.push_screen(SplitEditorScreen(self.model_shape))

    def action_logs(self, worker: str | None = None) -> None:
        if isinstance(self.screen, LogsScreen):
            return
        if worker is None and isinstance(self.screen, WorkerDetailScreen):
            worker = self.screen.worker_name
        self.push_screen(LogsScreen(worker))

    def action_filter(self) -> None:
        if not isinstance(self.screen, LogsScreen):
            self.push_screen(LogsScreen())
        self.call_after_refresh(self.screen.action_focus_filter)

    def action_detail(self, worker: str | None = None) -> None:
        worker = worker or self._selected()
        if worker:
            self.push_screen(WorkerDetailScreen(worker))

    def action_cycle_theme(self) -> None:
        names = list(THEMES)
        self.theme = names[(names.index(self.theme) + 1) % len(names)] if self.theme in names else names[0]
        self.refresh_view()

    def action_restart_selected(self) -> None:
        name = self._selected()
        if name:
            self.action_restart_worker(name)

    def action_restart_worker(self, name: str) -> None:
        if self.refused("restart"):
            return
        w = self.supervisor.worker(name)
        if not w.managed:
            self.notify(f"{name} is attached (monitor only): this console cannot restart it", severity="warning")
            return
        pid = f"pid {w.pid}" if w.running else "not running"
        self.push_screen(
            ConfirmScreen(
                f"Restart {name} ({pid})? SIGTERM, SIGKILL after {self.supervisor.settings.grace_s:g} s, then start again.",
                yes="Restart",
            ),
            lambda ok: self._run_command(self.supervisor.restart_worker(name), f"{name} restarted") if ok else None,
        )

    def action_stop_worker(self, name: str) -> None:
        if self.refused("stop"):
            return
        w = self.supervisor.worker(name)
        self.push_screen(
            ConfirmScreen(f"Stop {name} (pid {w.pid or '—'})? It will not be restarted.", yes="Stop"),
            lambda ok: self._run_command(self.supervisor.stop_worker(name), f"{name} stopped") if ok else None,
        )

    def action_start_worker(self, name: str) -> None:
        if self.refused("start"):
            return
        self._run_command(self.supervisor.start_worker(name), f"{name} starting")

    @work(group="commands")
    async def _run_command(self, coro, done: str) -> None:
        try:
            await coro
        except SupervisorError as e:
            self.notify(str(e), severity="error")
            return
        if self.is_running:
            self.notify(done)

    def confirm_apply_split(self, counts: list[int], on_done: Callable[[list[int]], None]) -> None:
        if self.refused("applying a split"):
            return
        head = self.supervisor.head
        fallback = (
            f"if unavailable, {head.name} (pid {head.pid or '—'}) restarts with --split."
            if head.managed
            else f"{head.name} is attached: if that is unavailable, this console cannot restart it."
        )
        self.push_screen(
            ConfirmScreen(
                f"Apply split {split_arg(counts)}? Live through {head.name}'s CONFIGURE; {fallback}", yes="Apply"
            ),
            lambda ok: self._apply_split(counts, on_done) if ok else None,
        )

    @work(exclusive=True, group="split")
    async def _apply_split(self, counts: list[int], on_done: Callable[[list[int]], None]) -> None:
        self.notify(f"applying split {split_arg(counts)}…")
        try:
            how = await self.supervisor.apply_split(counts)
        except SupervisorError as e:
            self.notify(str(e), severity="error")
            return
        if self.is_running:
            on_done(counts)
            self.notify(f"split {split_arg(counts)} applied ({'live' if how == 'live' else 'by restarting the head'})")

    def save_split(self, counts: list[int]) -> bool:
        """Write `counts` to the profile file only: what runs (and what a restart launches) stays."""
        profile = self.supervisor.profile
        try:
            profile.split = counts
        except ValueError as e:
            self.notify(str(e), severity="error")
            return False
        running = self.supervisor.split
        return self.action_save_profile(
            f"split {split_arg(counts)} saved, not applied"
            + (f" (running {split_arg(running)})" if running and running != counts else "")
        )

    def action_save_profile(self, what: str = "profile saved") -> bool:
        profile = self.supervisor.profile
        path = self.profile_path or resolve_profile_path(profile.name)
        try:
            save_profile(profile, path)
        except UserError as e:
            self.notify(str(e), severity="error")
            return False
        self.profile_path = path
        self.notify(f"{what}: {path}", markup=False)
        return True

    def action_set_theme(self, name: str) -> None:
        self.theme = name
        self.refresh_view()

    # ---- command palette ---------------------------------------------------------------------

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        yield from system_commands(self, screen)
