"""Events from the engine's thread into the API's asyncio loop, one wake-up per burst.

`loop.call_soon_threadsafe` costs the calling thread ~9 µs (a write to the loop's self-pipe, and
the GIL handed over to the woken loop), and the engine thread made one call per streamed token: at
64 streams, over half a millisecond of every step. A step's events come in a burst, so they are
appended to one deque per loop, and only the first of a burst schedules the loop's drain.

Each consumer reads an `Inbox`: `asyncio.wait_for(queue.get(), t)` made a task, a future and a
timer per awaited event (at 64 streams, about a tenth of the API thread's time per token).
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections import deque
from typing import Any

_mailboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopMailbox] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


class Inbox:
    """One consumer's items, in the loop: `put_nowait` (the mailbox's drain, in the loop) and `get`
    (the consumer), with a timeout that costs one timer and no task."""

    def __init__(self):
        self._items: deque[Any] = deque()
        self._waiter: asyncio.Future | None = None

    def put_nowait(self, item: Any) -> None:
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def pending(self) -> bool:
        """Whether an item is there to take without waiting."""
        return bool(self._items)

    async def get(self, timeout: float, empty: Any = None) -> Any:
        """The next item, or `empty` when none came within `timeout` seconds."""
        if not self._items:
            loop = asyncio.get_running_loop()
            self._waiter = loop.create_future()
            timer = loop.call_later(timeout, _wake, self._waiter)
            try:
                await self._waiter
            finally:
                timer.cancel()
                self._waiter = None
        return self._items.popleft() if self._items else empty


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


class LoopMailbox:
    """(inbox, item) pairs posted from any thread, put in their inboxes (anything with `put_nowait`:
    an `Inbox`, an asyncio queue) in the loop, in order."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._items: deque[tuple[Inbox | asyncio.Queue, Any]] = deque()
        self._lock = threading.Lock()
        self._scheduled = False

    @staticmethod
    def of(loop: asyncio.AbstractEventLoop) -> LoopMailbox:
        """The loop's one mailbox."""
        with _lock:
            box = _mailboxes.get(loop)
            if box is None:
                box = _mailboxes[loop] = LoopMailbox(loop)
            return box

    def post(self, queue: Inbox | asyncio.Queue, item: Any) -> None:
        with self._lock:
            self._items.append((queue, item))
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop has closed (the server is stopping): nobody reads these
            pass

    def _drain(self) -> None:
        with self._lock:
            items, self._items = self._items, deque()
            self._scheduled = False
        for queue, item in items:
            queue.put_nowait(item)
