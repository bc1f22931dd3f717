"""One exchange on a peer's socket at a time, and the host work a caller runs inside one."""

from __future__ import annotations

import threading
import time


class ExchangeLock:
    """One exchange on a peer's socket at a time. The thread holding it that comes back for it (work
    run between a frame and its reply calling into the same peer) gets an error, not a deadlock."""

    def __init__(self):
        self._lock, self._owner = threading.Lock(), None

    def acquire(self, blocking: bool = True) -> bool:
        if self._owner == threading.get_ident():
            raise RuntimeError(
                "a peer's exchange re-entered from inside it: work run between a frame and its "
                "reply must not call the pipeline"
            )
        if not self._lock.acquire(blocking):
            return False
        self._owner = threading.get_ident()
        return True

    def release(self) -> None:
        self._owner = None
        self._lock.release()

    __enter__ = acquire

    def __exit__(self, *exc) -> None:
        self.release()


def run_meanwhile(fn) -> tuple[BaseException | None, float]:
    """`fn()` (if any), run between a frame and its reply: (what it raised instead of raising it,
    seconds it took)."""
    t0 = time.perf_counter()
    try:
        if fn is not None:
            fn()
    except BaseException as e:  # noqa: BLE001 — re-raised by the caller once its reply is read
        return e, time.perf_counter() - t0
    return None, time.perf_counter() - t0
