"""The incident log: what triage finds (app/triage.py), kept for hours instead of the last polls.

It records incidents as they happen (the supervisor's events, and the changes between two polls of
each worker's /status), so memory holds incidents, not polls: at most `MAX_KEPT`. With a path (a
JSON-lines file beside the profile's run file) it loads the incidents of earlier consoles (last
night's, seen by the console started after the page) and appends its own, dropping those older
than `keep_s` and, past `max_bytes`, the older half of the file. Only a console that runs the
workers writes; one that watches (attached, read-only) reads the file and keeps its own in memory,
so two consoles do not record one incident twice.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from dataclasses import asdict
from pathlib import Path
from typing import Callable

from ..contracts.status import Status
from .config import Alerts, atomic_write
from .triage import Incident, event_incident, status_incidents

log = logging.getLogger("hydra.console.incidents")
MAX_KEPT = 10_000  # incidents in memory
KEEP_S = 7 * 86400
MAX_BYTES = 50 << 20


def incidents_path(sup) -> Path:
    """Beside the profile's run file: every console of the profile finds it."""
    return sup.state_path.with_suffix(".incidents.jsonl")


class IncidentLog:
    def __init__(
        self,
        alerts: Alerts,
        path: Path | None = None,
        *,
        writes: bool = True,
        keep_s: float = KEEP_S,
        max_bytes: int = MAX_BYTES,
        clock: Callable[[], float] = time.time,
    ):
        self.alerts, self.path, self.writes = alerts, path, writes and path is not None
        self.keep_s, self.max_bytes, self.clock = keep_s, max_bytes, clock
        self.incidents: deque[Incident] = deque(maxlen=MAX_KEPT)
        self._last: dict[str, Status] = {}  # each worker's previous /status
        self.load()

    def load(self) -> None:
        """The file's incidents from the last `keep_s` (a torn or foreign line is skipped)."""
        if self.path is None:
            return
        cutoff = self.clock() - self.keep_s
        try:
            with open(self.path, encoding="utf-8") as f:
                for line in f:
                    try:
                        inc = Incident(**json.loads(line))
                    except (ValueError, TypeError):
                        continue
                    if inc.ts >= cutoff:
                        self.incidents.append(inc)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("incident log %s: %s", self.path, e)

    def follow(self, sup) -> Callable[[], None]:
        """Record `sup`'s incidents from now on; returns the unsubscribe."""
        stops = [
            sup.subscribe(lambda ev: self.add([i] if (i := event_incident(ev)) else [])),
            sup.subscribe_status(self._on_status),
        ]
        return lambda: [stop() for stop in stops]

    def _on_status(self, worker: str, ts: float, status: Status) -> None:
        prev = self._last.get(worker)
        self._last[worker] = status
        if prev is not None:
            self.add(status_incidents(prev, status, ts, self.alerts, subject=worker))

    def add(self, incidents: list[Incident]) -> None:
        if not incidents:
            return
        self.incidents.extend(incidents)
        if not self.writes:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as f:
                for inc in incidents:
                    f.write(json.dumps(asdict(inc)) + "\n")
            if self.path.stat().st_size > self.max_bytes:
                self._compact()
        except OSError as e:
            log.warning("incident log %s: %s", self.path, e)

    def _compact(self) -> None:
        """Keep the newer half of what is kept, within keep_s (rewritten whole: readers see old or new)."""
        cutoff = self.clock() - self.keep_s
        kept = [i for i in self.incidents if i.ts >= cutoff]
        kept = kept[len(kept) // 2 :]
        self.incidents = deque(kept, maxlen=MAX_KEPT)
        atomic_write(self.path, "".join(json.dumps(asdict(i)) + "\n" for i in kept))

    def since(self, ts: float) -> list[Incident]:
        return sorted((i for i in self.incidents if i.ts >= ts), key=lambda i: i.ts)
