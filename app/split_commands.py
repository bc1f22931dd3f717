"""The supervisor's split commands: a live re-split (or a restart of the head with --split), the
split advisor's probe, the refusal of a split some card cannot hold, and following the split the
head reports, whoever applied it."""

from __future__ import annotations

import asyncio

from ..contracts.split import counts_of, split_arg
from . import split_control
from .records import SupervisorError


class SplitCommands:
    """`Supervisor`'s split commands: they use its `head`, `workers`, `plans`, `split`,
    `split_changes`, `emit` and `restart_worker`."""

    def stage_ranges(self) -> list[tuple[str, tuple[int, int]]] | None:
        """Layer ranges the head reports in /status, pipeline order."""
        return split_control.stage_ranges(self.head.status)

    async def apply_split(self, counts: list[int]) -> str:
        """Re-split live through the head's CONFIGURE op; else restart the head with --split.

        Peers take no split flag (the head assigns their layers when it connects), so a restart
        of the head is the whole rolling restart. Returns "live" or "restart".
        """
        if self.readonly:
            raise SupervisorError("read-only console: it applies no split")
        if len(counts) != len(self.workers):
            raise SupervisorError(f"split {split_arg(counts)} has {len(counts)} stages for {len(self.workers)} workers")
        await self.refuse_misfit(counts)
        head = self.head
        reason = await split_control.configure(head.spec, counts, self.identity, self.token)
        if reason is None:
            self._set_split(counts)
            self.emit(head.name, "split", f"live re-split to {split_arg(counts)}")
            return "live"
        if not head.managed:
            raise SupervisorError(
                f"live re-split refused ({reason}) and {head.name} is attached, so it cannot be restarted"
            )
        self._set_split(counts)
        self.emit(
            head.name, "split", f"live re-split unavailable ({reason}); restarting with --split {split_arg(counts)}"
        )
        await self.restart_worker(head.name)
        return "restart"

    async def refuse_misfit(self, counts: list[int] | None) -> None:
        """A split some card cannot hold is refused before anything loads, naming each stage's need
        and its card's size (split_fit.py); a model the console cannot read is the worker's to report."""
        workers = [(w.spec, w.status) for w in self.workers.values()]
        if why := await asyncio.to_thread(self.plans.refusal, workers, counts):
            self.emit(self.head.name, "refused", why)
            raise SupervisorError(why)

    def _set_split(self, counts: list[int]) -> None:
        self.profile.split = self.split = list(counts)
        self.split_changes += 1

    async def probe_split(self, tokens: int = 32, reps: int = 3) -> dict:
        """The split advisor's measurement: the head's PROBE (every stage times its own layers, the
        head times each hop and a whole step). Requests pause for its length."""
        if self.readonly:
            raise SupervisorError("read-only console: it runs no probe")
        head = self.head
        meta = await split_control.probe(head.spec, tokens, reps, self.token)
        self.emit(head.name, "probe", f"split probe: one decode step {meta.get('step_ms', 0):.1f} ms")
        return meta

    def _note_split(self) -> None:
        """Follow the split the head runs, whoever applied it: a restart of the head relaunches it."""
        ranges = self.stage_ranges()
        if ranges is None or self.head.probe_split_changes != self.split_changes:
            return
        key = tuple(r for _, r in ranges)
        if len(key) == len(self.workers):
            self.split = counts_of(list(key))
        if self._last_ranges is not None and key != self._last_ranges:
            by = self.head.status.split_by
            self.emit(self.head.name, "split", split_control.ranges_text(key, by))
        self._last_ranges = key
