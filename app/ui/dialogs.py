"""Modal dialogs: yes/no confirmation, and help built from the bindings active beneath it."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen, Screen
from textual.widgets import Button, Label, Static


class ConfirmScreen(ModalScreen[bool | str]):
    """Asks one question; y = yes; n, escape or enter (Cancel has the focus) = no: the safe answer is
    the default. `other=(key, label)` adds a third answer, dismissed with `key`.

    Question and labels are plain text: "[y]" or a layer range "[0,9)" must not be read as markup."""

    BINDINGS = [
        Binding("y", "answer(True)", "Yes", id="confirm.yes"),
        Binding("n,escape", "answer(False)", "No", id="confirm.no"),
    ]

    def __init__(self, question: str, yes: str = "Yes", no: str = "Cancel", other: tuple[str, str] | None = None):
        super().__init__()
        self.question, self.yes, self.no, self.other = question, yes, no, other

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label(Text(self.question), id="question")
            with Horizontal(id="buttons"):
                yield Button(Text(f"{self.yes} [y]"), variant="error", id="yes")
                if self.other:
                    yield Button(Text(f"{self.other[1]} [{self.other[0]}]"), variant="warning", id="other")
                yield Button(Text(f"{self.no} [n]"), variant="primary", id="no")

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(self.other[0] if event.button.id == "other" else event.button.id == "yes")

    def on_key(self, event) -> None:
        if self.other and event.key == self.other[0]:
            event.stop()
            self.dismiss(self.other[0])

    def action_answer(self, value: bool) -> None:
        self.dismiss(value)


def binding_rows(app, screen: Screen) -> list[tuple[str, str]]:
    """(key, description) of every binding active on `screen`, after any keymap remapping."""
    rows, seen = [], set()

    # This screen's and the console's keys first, then Textual's app keys, then the focused widget's.
    def rank(a) -> tuple[bool, bool]:
        ours = isinstance(a.node, Screen) or (a.binding.id or "").startswith("hydra.")
        return (not ours, not isinstance(a.node, App))

    actives = sorted(screen.active_bindings.values(), key=rank)
    for active in actives:
        b = active.binding
        if not b.description or (b.description, b.action) in seen:
            continue
        seen.add((b.description, b.action))
        rows.append((app.get_key_display(b), b.description if active.enabled else f"{b.description} (disabled)"))
    return rows


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,q,question_mark", "dismiss", "Close", id="help.close")]

    def __init__(self, beneath: Screen):
        super().__init__()
        self.beneath = beneath
        self.rows: list[tuple[str, str]] = []

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help"):
            yield Static(f"Keys · {self.beneath.__class__.__name__.removesuffix('Screen').lower()}", classes="title")
            self.rows = binding_rows(self.app, self.beneath)
            table = Table(box=None, header_style="bold", pad_edge=False)
            table.add_column("key", no_wrap=True)
            table.add_column("action")
            for key, desc in self.rows:
                table.add_row(key, desc)
            yield Static(table)
            yield Static(
                "States: ● ready  ◐ starting  ▲ degraded  ↻ backoff  ⟳ crash-loop  ⧗ port-busy  "
                "✖ crashed/unreachable  ◌ stopping  ○ stopped",
                classes="hint",
            )
            yield Static("↑ ↓ PgUp PgDn scroll · esc closes", classes="hint")

    def on_mount(self) -> None:
        self.query_one("#help", VerticalScroll).focus()  # the arrow keys scroll it
