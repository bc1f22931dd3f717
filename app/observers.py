"""Who hears of the supervisor's events and polled /status replies (the UI, the incident log).
An observer's bug never stops supervision: it is logged, and the others still hear."""

from __future__ import annotations

import logging
from typing import Callable

from ..contracts.status import Status
from .records import Event

log = logging.getLogger("hydra.console.supervisor")


class Observers:
    def __init__(self):
        self._events: list[Callable[[Event], None]] = []
        self._statuses: list[Callable[[str, float, Status], None]] = []

    def on_event(self, fn: Callable[[Event], None]) -> Callable[[], None]:
        """`fn(event)` for every event; returns the call that unsubscribes it."""
        return self._add(self._events, fn)

    def on_status(self, fn: Callable[[str, float, Status], None]) -> Callable[[], None]:
        """`fn(worker, time, status)` for every /status polled; returns the call that unsubscribes it."""
        return self._add(self._statuses, fn)

    def event(self, ev: Event) -> None:
        for fn in list(self._events):
            try:
                fn(ev)
            except Exception:  # an observer's bug must not stop supervision
                log.exception("event listener failed on %s", ev)

    def status(self, name: str, ts: float, status: Status) -> None:
        for fn in list(self._statuses):
            try:
                fn(name, ts, status)
            except Exception:  # an observer's bug must not stop supervision
                log.exception("status listener failed on %s", name)

    @staticmethod
    def _add(listeners: list, fn) -> Callable[[], None]:
        listeners.append(fn)
        return lambda: listeners.remove(fn) if fn in listeners else None
