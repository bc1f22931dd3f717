"""`--sleep-idle-seconds N` (llama-server's sleeping on idle): after N seconds in which nothing held
the head awake, its model is freed (`sleep`); the next request loads it again (`wake`) before it runs.

What holds the head awake: every HTTP request but the observation routes (http/wake.py), the control
ops that need the model (rpc/service.py), and the engine's own work (`busy`: a PREFILL or a
request still in the engine). The idle clock starts when the last of them ends. Sleeping and waking
happen under one lock, so a request that comes while the model goes waits for it to come back, and
one that comes while it loads waits for the load, as llama-server's queue does.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Callable

log = logging.getLogger("hydra.sleep")

CHECK_S = 1.0  # how often the idle clock is read (llama-server's queue: every second)


class IdleSleep:
    def __init__(self, seconds: float, sleep: Callable[[], None], wake: Callable[[], None], busy: Callable[[], bool]):
        self.seconds = seconds
        self._sleep, self._wake, self._busy = sleep, wake, busy
        self.sleeping = False
        self._holders = 0
        self._last = time.monotonic()
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="hydra-idle-sleep", daemon=True)

    def start(self) -> IdleSleep:
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout=10)

    def hold(self) -> None:
        """The model loaded for the caller's work (woken first if asleep; a failed load raises and
        the head stays asleep, the next request tries again); `release` when it ends."""
        with self._cond:
            if self.sleeping:
                t0 = time.perf_counter()
                self._wake()
                self.sleeping = False
                log.info("awake: the model is loaded again in %.1f s", time.perf_counter() - t0)
            self._holders += 1

    def release(self) -> None:
        with self._cond:
            self._holders -= 1
            self._last = time.monotonic()

    @contextlib.contextmanager
    def held(self):
        self.hold()
        try:
            yield
        finally:
            self.release()

    def _run(self) -> None:
        with self._cond:
            while not self._stopping:
                now = time.monotonic()
                if self.sleeping:
                    pass
                elif self._holders or self._busy():
                    self._last = now
                elif now - self._last >= self.seconds:
                    log.info("idle for %g s: freeing the model until the next request", self.seconds)
                    try:
                        self._sleep()
                    except Exception:  # whatever it freed, the next request builds the model again
                        log.exception("freeing the model failed midway")
                    self.sleeping = True
                self._cond.wait(CHECK_S)
