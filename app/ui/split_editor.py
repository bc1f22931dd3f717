"""Split editor: move stage boundaries from the keyboard, see per-stage memory, apply, undo, save."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import Footer, Header, Static

from .. import display
from ...contracts.split import counts_of, even_split, move_boundary, ranges, split_arg
from ..split_plan import ModelShape


class SplitEditorScreen(Screen):
    BINDINGS = [
        Binding("escape", "app.pop_screen", "Back", id="split.back"),
        Binding("up", "select(-1)", "Prev boundary", show=False, id="split.prev"),
        Binding("down", "select(1)", "Next boundary", show=False, id="split.next"),
        Binding("left", "move(-1)", "◀ layer", id="split.left"),
        Binding("right", "move(1)", "layer ▶", id="split.right"),
        Binding("u", "undo", "Undo", id="split.undo"),
        Binding("e", "even", "Even", id="split.even"),
        Binding("a", "apply", "Apply", id="split.apply"),
        Binding("w", "save", "Save to profile", id="split.save"),
    ]

    def __init__(self, shape: ModelShape | None):
        super().__init__()
        self.shape = shape
        self.boundary = 0
        self.undo_stack: list[list[int]] = []
        self.applied = self._current_counts()  # what runs: the head's /status, whoever applied it
        self.counts = list(self.applied) if self.applied else []
        self.saved: list[int] | None = None  # written to the profile file by `w` (which applies nothing)

    def _live_counts(self) -> list[int] | None:
        sup = self.app.supervisor
        live = sup.stage_ranges()
        return counts_of([r for _, r in live]) if live and len(live) == len(sup.workers) else None

    def _current_counts(self) -> list[int] | None:
        sup = self.app.supervisor
        live = self._live_counts()
        if live:
            return live
        if sup.split:
            return list(sup.split)
        if self.shape:
            return even_split(self.shape.n_layers, len(sup.workers))
        return None

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static(id="split-table")
        yield Static(id="split-note")
        yield Footer()

    def on_mount(self) -> None:
        self.render_plan()

    def refresh_view(self) -> None:
        """Follow the running split: another console may apply one, or a restart change it."""
        live = self._live_counts()
        if live and live != self.applied:
            self.applied = live
            if not self.counts:
                self.counts = list(live)
            self.render_plan()

    def render_plan(self) -> None:
        sup = self.app.supervisor
        note = self.query_one("#split-note", Static)
        if not self.counts:
            self.query_one("#split-table", Static).update("No layer count yet: waiting for the head's /status or the model file.")
            return
        estimates = self.shape.estimate(self.counts, sup.profile.ctx, sup.profile.parallel, self._dtype()) if self.shape else None
        table = Table(box=None, expand=False, pad_edge=False, header_style="bold")
        for col in ("", "worker", "layers", "n", "weights", "KV", "total", "device free"):
            table.add_column(col, no_wrap=True, justify="right" if col in ("n", "weights", "KV", "total", "device free") else "left")
        names = list(sup.workers)
        for i, (a, b) in enumerate(ranges(self.counts)):
            marker = "▶" if i in (self.boundary, self.boundary + 1) else " "
            est = estimates[i] if estimates else None
            free, shared = display.device_free(sup, names[i])
            over = bool(est and free is not None and est.total > free)
            table.add_row(
                marker, names[i], f"[{a},{b})", str(b - a),
                display.fmt_bytes(est.weight_bytes) if est else "—",
                display.fmt_bytes(est.kv_bytes) if est else "—",
                Text(display.fmt_bytes(est.total) + (" ⚠" if over else ""), style=self.app.tone_style("warn") if over else "")
                if est else "—",
                display.fmt_bytes(free) + (" shared" if shared else "") if free is not None else "—",
            )
        self.query_one("#split-table", Static).update(table)
        changed = self.counts != self.applied
        left, right = names[self.boundary], names[self.boundary + 1]
        glyphs = "█▒▓░"  # one texture per stage, so the map reads without colour
        layer_map = "│".join(glyphs[i % len(glyphs)] * n for i, n in enumerate(self.counts))
        if not changed:
            by = sup.head.status.split_by if sup.head.status else None
            state = "  (applied" + (f" by {by})" if by else ")")
        else:
            running = f"running {split_arg(self.applied)}" if self.applied else "nothing running"
            state = f"  ({'saved, not applied' if self.counts == self.saved else 'draft'}; {running})"
        note.update(
            f"layers {layer_map}\n"
            f"boundary {left} | {right}  ·  split {split_arg(self.counts)}{state}"
            + f"\nestimates at {self._dtype()}: weights dequantized, KV for {sup.profile.parallel} slots"
            f" × {sup.profile.ctx} tokens (CPU int8 weights take about half)"
        )

    def _dtype(self) -> str:
        """The head's --dtype if its profile entry passes one, else the engine's auto (bfloat16)."""
        args = self.app.supervisor.profile.head.args
        return args[args.index("--dtype") + 1] if "--dtype" in args[:-1] else "bfloat16"

    def action_select(self, step: int) -> None:
        if len(self.counts) > 1:
            self.boundary = (self.boundary + step) % (len(self.counts) - 1)
            self.render_plan()

    def _change(self, counts: list[int]) -> None:
        if counts != self.counts:
            self.undo_stack.append(self.counts)
            self.counts = counts
        self.render_plan()

    def action_move(self, delta: int) -> None:
        if len(self.counts) > 1:
            self._change(move_boundary(self.counts, self.boundary, delta))

    def action_even(self) -> None:
        if self.counts:
            self._change(even_split(sum(self.counts), len(self.counts)))

    def action_undo(self) -> None:
        if self.undo_stack:
            self.counts = self.undo_stack.pop()
            self.render_plan()

    def action_apply(self) -> None:
        if self.counts:
            self.app.confirm_apply_split(list(self.counts), on_done=self._applied)

    def _applied(self, counts: list[int]) -> None:
        self.applied = counts
        if self.is_mounted:
            self.render_plan()

    def action_save(self) -> None:
        if self.counts and self.app.save_split(list(self.counts)):
            self.saved = list(self.counts)
            self.render_plan()
