"""Split editor: move stage boundaries from the keyboard, see per-stage memory and each card
(`f`: the split that fits them), apply (refused when a card cannot hold its stage), undo, save;
and the split advisor: measure every stage (`m`), see the fastest split with predicted decode tok/s,
apply it (`P`), then see predicted against achieved."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import Footer, Header, Static

from ...contracts.split import counts_of, even_split, move_boundary, ranges, split_arg
from .. import display, memory_text
from ..records import SupervisorError
from ..split_advisor import MIN_GAIN, Advice, advise
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
        Binding("m", "measure", "Advisor: measure", id="split.measure"),
        Binding("P", "apply_proposal", "Apply proposal", id="split.propose"),
        # Shown where it helps: the note names it when the draft does not fit.
        Binding("f", "fit", "Fit the cards", show=False, id="split.fit"),
    ]

    def __init__(self, shape: ModelShape | None):
        super().__init__()
        self.shape = shape
        self.boundary = 0
        self.undo_stack: list[list[int]] = []
        self.applied = self._current_counts()  # what runs: the head's /status, whoever applied it
        self.counts = list(self.applied) if self.applied else []
        self.saved: list[int] | None = None  # written to the profile file by `w` (which applies nothing)
        self.advice: Advice | None = None  # the advisor's last reading
        self.advice_note = "m: measure every stage's layers and propose the fastest split"
        self.promised: tuple[list[int], float] | None = None  # an applied proposal and its predicted tok/s

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
        yield Static(id="split-advice")
        yield Static(id="split-verdict")
        yield Footer()

    def on_mount(self) -> None:
        self.render_plan()
        self.render_advice()

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
            self.query_one("#split-table", Static).update(
                "No layer count yet: waiting for the head's /status or the model file."
            )
            return
        planner = self._planner() if self.shape else None
        memory = planner.memory if planner else []
        estimates = self.shape.estimate(self.counts, sup.profile.ctx, sup.profile.parallel, memory) if planner else None
        plan = planner.plan(self.counts) if planner else None
        table = Table(box=None, expand=False, pad_edge=False, header_style="bold")
        cards = plan is not None and planner.known  # the cards' line only where a card's size is known
        numbers = ("n", "weights", "KV", "work", "total", "free")
        for col in ("", "worker", "layers", *numbers):
            table.add_column(col, no_wrap=True, justify="right" if col in numbers else "left")
        names = list(sup.workers)
        for i, (a, b) in enumerate(ranges(self.counts)):
            marker = "▶" if i in (self.boundary, self.boundary + 1) else " "
            est = estimates[i] if estimates else None
            fit = plan.stages[i] if plan else None
            free, shared = memory_text.device_free(sup, names[i])
            # A running worker's context is in the device's used memory already: the new stage's bytes must
            # fit (⚠); and the whole stage, with the headroom, its card (✗: refused).
            over = bool(est and free is not None and est.total - est.runtime_bytes > free)
            misfit = bool(fit and fit.fits is False)
            table.add_row(
                marker,
                names[i],
                f"[{a},{b})",
                str(b - a),
                display.fmt_bytes(est.weight_bytes) if est else "—",
                display.fmt_bytes(est.kv_bytes) if est else "—",
                display.fmt_bytes(est.work_bytes + est.runtime_bytes) if est and est.runtime_bytes else "—",
                Text(
                    display.fmt_bytes(est.total) + (" ✗" if misfit else " ⚠" if over else ""),
                    style=self.app.tone_style("error" if misfit else "warn") if misfit or over else "",
                )
                if est
                else "—",
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
            + f"\nestimates for {sup.profile.parallel} slots × {sup.profile.ctx} tokens: {memory_text.memory_forms(names, memory)}"
            + (
                "\nwork: a GPU worker's prefill scratch, CUDA graphs and cuBLAS workspaces, and its CUDA context and kernels"
                if any(m.device == "cuda" for m in memory)
                else ""
            )
            + (f"\n{self._cards_line(plan, planner.headroom)}" if cards else "")
            + (f"\n{plan.refusal}: a applies nothing" if plan and plan.refusal else "")
            + (", f takes the split that fits" if plan and plan.refusal and plan.proposal else "")
        )

    def render_advice(self) -> None:
        advice, box, verdict = (
            self.advice,
            self.query_one("#split-advice", Static),
            self.query_one("#split-verdict", Static),
        )
        if advice is None:
            box.update(self.advice_note)
            verdict.update("")
            return
        names = list(self.app.supervisor.workers)
        table = Table(
            box=None,
            expand=False,
            pad_edge=False,
            header_style="bold",
            title_justify="left",
            title="split advisor · one decode step = every stage's layers + hops, in sequence",
        )
        for col in ("stage", "device", "layers", "ms/layer", "prefill ms/layer", "hop ms", "memory for layers"):
            table.add_column(col, no_wrap=True, justify="left" if col in ("stage", "device", "layers") else "right")
        for i, st in enumerate(advice.stages):
            dec, pre = st.mean_ms("decode"), st.mean_ms("prefill")
            table.add_row(
                names[i] if i < len(names) else st.name,
                st.device,
                display.fmt_layers(st.layers),
                f"{dec:.2f}" if dec is not None else "—",
                f"{pre:.2f}" if pre is not None else "—",
                f"{st.hop_ms:.2f}" if i else "—",
                display.fmt_bytes(st.budget_bytes) if st.budget_bytes is not None else "—",
            )
        cur, best = advice.current, advice.best
        lines = [
            f"running {split_arg(cur.counts)}: predicted {cur.step_ms:.1f} ms/token = {cur.tok_s:.1f} tok/s"
            + (
                f" (measured {advice.measured_step_ms:.1f} ms = {advice.measured_tok_s:.1f} tok/s)"
                if advice.measured_step_ms
                else ""
            )
        ]
        if advice.proposal:
            lines.append(
                f"proposal {split_arg(best.counts)}: predicted {best.step_ms:.1f} ms/token = {best.tok_s:.1f} tok/s"
                f"  ({cur.step_ms / best.step_ms:.2f}x)  ·  P applies it live"
            )
        else:
            lines.append(
                f"the running split is within {MIN_GAIN:.0%} of the best ({split_arg(best.counts)}, {best.tok_s:.1f} tok/s): keep it"
            )
        if self.promised:
            counts, tok_s = self.promised
            got = (
                f"{advice.measured_tok_s:.1f} tok/s achieved"
                if advice.measured_tok_s and cur.counts == counts
                else "measuring…"
            )
            lines.append(f"applied {split_arg(counts)}: {tok_s:.1f} tok/s predicted, {got}")
        box.update(table)
        verdict.update("\n".join(lines))

    @work(exclusive=True, group="advisor")
    async def action_measure(self) -> None:
        if self.app.refused("the split probe"):
            return
        self.advice_note = "measuring every stage's layers… (requests pause for the probe)"
        self.render_advice()
        try:
            planner = self._planner() if self.shape else None
            self.advice = advise(
                await self.app.supervisor.probe_split(),
                fits=planner.fits_for(self.applied or self.counts) if planner and planner.known else None,
            )
        except (SupervisorError, ValueError) as e:
            self.advice, self.advice_note = None, f"advisor: {e}"
        if self.is_mounted:
            self.render_advice()

    def action_apply_proposal(self) -> None:
        if self.advice is None or not self.advice.proposal:
            self.notify(
                "no proposal: press m to measure first"
                if self.advice is None
                else "the running split is already the best"
            )
            return
        self.app.confirm_apply_split(list(self.advice.proposal), on_done=self._proposal_applied)

    def _proposal_applied(self, counts: list[int]) -> None:
        self.promised = (counts, self.advice.best.tok_s)
        self._applied(counts)
        self.action_measure()

    def _planner(self):
        """The cards of this profile's workers (split_fit.Planner), on the model the editor shows."""
        sup = self.app.supervisor
        sup.plans.shape = sup.plans.shape or self.shape
        return sup.plans.planner([(w.spec, w.status) for w in sup.workers.values()], require_card=False)

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

    @staticmethod
    def _cards_line(plan, headroom: int) -> str:
        """Each known card against its stage's total: "head 15.4 of 16.0 GiB ✓"."""
        cards = [
            f"{s.name} {display.fmt_bytes(s.need)} of {display.fmt_bytes(s.capacity)} {'✓' if s.fits else '✗'}"
            for s in plan.stages
            if s.capacity is not None
        ]
        return f"cards, each keeping {display.fmt_bytes(headroom)} free: " + " · ".join(cards)

    def action_fit(self) -> None:
        """The draft becomes the split that fits every card (fewest layers moved); `a` applies it."""
        planner = self._planner() if self.shape else None
        plan = planner.plan(self.counts) if planner and self.counts else None
        if plan is None or not planner.known:
            self.notify("no card sizes known: set card_gb per worker in the profile", severity="warning")
        elif plan.fits:
            self.notify(f"split {split_arg(self.counts)} fits every card")
        elif plan.proposal is None:
            self.notify(plan.refusal, severity="error", markup=False)
        else:
            self._change(list(plan.proposal))

    def action_apply(self) -> None:
        if not self.counts:
            return
        planner = self._planner() if self.shape else None
        why = planner.plan(self.counts).refusal if planner else None
        if why:  # refused before anything loads (the supervisor checks again for every other way in)
            self.notify(why, severity="error", markup=False)
            return
        self.app.confirm_apply_split(list(self.counts), on_done=self._applied)

    def _applied(self, counts: list[int]) -> None:
        if counts != self.counts:  # the advisor's proposal: the draft becomes what now runs
            self.undo_stack.append(self.counts)
            self.counts = list(counts)
        self.applied = list(counts)
        if self.is_mounted:
            self.render_plan()

    def action_save(self) -> None:
        if self.counts and self.app.save_split(list(self.counts)):
            self.saved = list(self.counts)
            self.render_plan()
