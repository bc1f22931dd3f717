"""SIGTERM's drain of the head's API (the console's restart and stop send it; so do init systems).

uvicorn, told to exit, would close the port and give running requests `timeout_graceful_shutdown`
before cancelling their tasks: a 500 and a traceback for a request still generating, a cut
connection for a stream. Instead, before uvicorn's own shutdown (`http/worker.py`'s server runs
`Drain.run`):

1. new API requests get 503 "the server is shutting down" + Retry-After (the gate; a request past
   the gate whose generation starts now ends as in 3), /health turns 503 with that reason;
2. generations in flight run on for `--drain-grace` seconds (a second SIGTERM or SIGINT cuts it short);
3. those still running then end as a peer gone away ends them: `ShuttingDown` (an `Unavailable`),
   a 503 in OpenAI's shape for a plain request, an error event and the end of the stream for a
   streamed one; one log line each (the gate's), no traceback;

then uvicorn closes the port and the connections, and the head stops its engine. The grace and the
rest fit well inside the console's 10 s between SIGTERM and SIGKILL.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from typing import TYPE_CHECKING, Protocol

from ..errors import Unavailable
from .errors import APIError

if TYPE_CHECKING:
    from ..status import StatusDocument

log = logging.getLogger("hydra.http")

SHUTTING_DOWN = "the server is shutting down"
RETRY_AFTER_S = 5  # a restarted head answers again after its load: a few seconds for a small model
POLL_S = 0.05


class ShuttingDown(Unavailable):
    """A generation the head's stop ended (HTTP 503: a retry, once the head is back, may succeed)."""

    retry_after = RETRY_AFTER_S

    def __init__(self, message: str = SHUTTING_DOWN):
        super().__init__(message)


class Run(Protocol):
    """What the drain follows of a request's generations (streaming.Run)."""

    @property
    def live(self) -> bool: ...

    def abort(self, error: BaseException) -> None: ...


class Drain:
    """The head's API requests in flight, and whether it still admits new ones."""

    def __init__(self, grace_s: float, status: StatusDocument | None = None):
        self.grace_s, self.status = grace_s, status
        self.closing = False
        self._hurried = False
        self._runs: weakref.WeakSet[Run] = weakref.WeakSet()

    def refusal(self) -> APIError:
        return APIError(503, SHUTTING_DOWN, "unavailable_error", retry_after=RETRY_AFTER_S)

    def admit(self, run: Run) -> bool:
        """`run` is about to start its generation: followed, or False once draining (the run then
        ends at once with `ShuttingDown`)."""
        if self.closing:
            return False
        self._runs.add(run)
        return True

    def live(self) -> list[Run]:
        return [r for r in list(self._runs) if r.live]

    def hurry(self) -> None:
        """A second stop signal: end the grace now (only sets a flag: called from a signal handler)."""
        self._hurried = True

    async def run(self) -> None:
        """Refuse new requests, let those in flight run on for the grace, then end the rest."""
        self.closing = True
        if self.status is not None:
            self.status.stopping = SHUTTING_DOWN
        live = self.live()
        if not live:
            return
        log.warning("stopping: %d request(s) in flight, up to %g s to finish (--drain-grace)", len(live), self.grace_s)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.grace_s
        while live and not self._hurried and loop.time() < deadline:
            await asyncio.sleep(POLL_S)
            live = self.live()
        if live:
            log.warning("stopping: %d request(s) still running end with 503 %r", len(live), SHUTTING_DOWN)
            for r in live:
                r.abort(ShuttingDown())
