"""The command palette's entries: the app's actions, then those of the screen it opens over
(the logs, the split editor), then each worker's detail, logs and commands."""

from __future__ import annotations

from functools import partial
from typing import Iterable

from textual.app import App, SystemCommand
from textual.screen import Screen

from ...themes import THEMES
from .logs import LogsScreen
from .split_editor import SplitEditorScreen


def system_commands(app: App, screen: Screen) -> Iterable[SystemCommand]:
    """The console's own entries (`HydraConsole.get_system_commands` adds them to Textual's)."""
    yield SystemCommand("Help", "Keys of this screen", app.action_help)
    yield SystemCommand("Alerts", "Every alert of this session", app.action_alerts)
    yield SystemCommand("Triage", "Incident timeline and what to change", app.action_triage)
    yield SystemCommand("Split editor", "Move layer boundaries, preview memory, apply", app.action_split_editor)
    yield SystemCommand("Logs: all workers", "Merged log of every worker", partial(app.action_logs, None))
    yield SystemCommand("Log filter", "Open the logs with the regex filter focused", app.action_filter)
    yield SystemCommand("Save profile", "Write the profile (split included) to its TOML file", app.action_save_profile)
    for name in THEMES:
        yield SystemCommand(f"Theme: {name}", "Switch colours", partial(app.action_set_theme, name))
    if isinstance(screen, LogsScreen):
        yield SystemCommand("Logs: follow / pause", "Toggle following new lines", screen.action_toggle_follow)
        yield SystemCommand("Logs: invert filter", "Show the lines that do not match", screen.action_toggle_invert)
        yield SystemCommand("Logs: next worker", "Cycle merged / each worker", screen.action_next_source)
        yield SystemCommand("Logs: clear filter", "Show every line", screen.action_clear_filter)
        yield SystemCommand(
            "Logs: requests only",
            "Only the head's access log: one line per API request",
            screen.action_toggle_requests,
        )
    if isinstance(screen, SplitEditorScreen):
        yield SystemCommand("Split: undo", "Undo the last boundary move", screen.action_undo)
        yield SystemCommand("Split: even", "Spread the layers evenly", screen.action_even)
        yield SystemCommand("Split: save to profile", "Write this split to the profile", screen.action_save)
        if not app.readonly:
            yield SystemCommand("Split: apply", "Apply live (or by restarting the head)", screen.action_apply)
            yield SystemCommand(
                "Split advisor: measure",
                "Time every stage's layers, propose the fastest split",
                screen.action_measure,
            )
            yield SystemCommand(
                "Split advisor: apply proposal", "Apply the advisor's split live", screen.action_apply_proposal
            )
    for w in app.supervisor.workers.values():
        yield SystemCommand(f"Detail: {w.name}", f"{w.role} at {w.spec.url}", partial(app.action_detail, w.name))
        yield SystemCommand(f"Logs: {w.name}", f"Log of {w.name}", partial(app.action_logs, w.name))
        if w.managed and not app.readonly:
            yield SystemCommand(
                f"Restart {w.name}",
                "Stop (SIGTERM, then SIGKILL) and start again",
                partial(app.action_restart_worker, w.name),
            )
            yield SystemCommand(f"Stop {w.name}", "Stop without restarting", partial(app.action_stop_worker, w.name))
            yield SystemCommand(f"Start {w.name}", "Start if stopped", partial(app.action_start_worker, w.name))
