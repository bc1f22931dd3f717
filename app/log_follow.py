"""Following the workers' log files into ring buffers (per worker and merged), with the console's
own lines (`CONSOLE_MARK`) written into a worker's file where an adopting console reads them too."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from typing import Callable

from .records import LogLine, Worker

log = logging.getLogger("hydra.console.supervisor")
FOLLOW_S = 0.2  # how often the log files are read
CONSOLE_MARK = "[hydra-console]"  # the console's own lines in a worker's log file


class LogFollower:
    """`merged`: every worker's lines in arrival order; each worker's own ring is `Worker.log`.
    `task` runs a follow loop (the supervisor's, so its shutdown cancels them)."""

    def __init__(self, clock: Callable[[], float], merged_lines: int, task: Callable[..., asyncio.Task]):
        self.clock, self._task = clock, task
        self.merged: deque[LogLine] = deque(maxlen=merged_lines)
        self._seq = itertools.count()

    def mark(self, w: Worker, text: str) -> None:
        """A line of the console's own in the worker's log file (where an adopting console reads it too)."""
        text = f"{CONSOLE_MARK} {time.strftime('%Y-%m-%dT%H:%M:%S')} {text}"
        if w.logfile is None:
            self.add(w, text)
            return
        try:
            w.logfile.append(text)
        except OSError as e:
            log.warning("log file %s: %s", w.log_path, e)
        self.follow(w)

    def follow(self, w: Worker) -> None:
        if w.logfile is not None and w._follow is None:
            w._follow = self._task(self._follow_loop(w))

    async def _follow_loop(self, w: Worker) -> None:
        while w.logfile is not None:
            self.read(w)
            await asyncio.sleep(FOLLOW_S)

    def read(self, w: Worker) -> None:
        for text in w.logfile.read_new() if w.logfile else []:
            self.add(w, text)

    def add(self, w: Worker, text: str) -> None:
        line = LogLine(next(self._seq), self.clock(), w.name, text)
        w.log.append(line)
        self.merged.append(line)
        if text.strip() and not text.startswith(CONSOLE_MARK):
            w.last_err = text.strip()
