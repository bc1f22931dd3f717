"""Events from the engine's thread into the API's asyncio loop, one wake-up per burst.

`loop.call_soon_threadsafe` costs the calling thread ~9 µs (a write to the loop's self-pipe, and
the GIL handed over to the woken loop), and the engine thread made one call per streamed token: at
64 streams, over half a millisecond of every step. A step's events come in a burst, so they are
appended to one deque per loop, and only the first of a burst schedules the loop's drain.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections import deque
from typing import Any

_mailboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopMailbox] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


class LoopMailbox:
    """(queue, item) pairs posted from any thread, put on their asyncio queues in the loop, in order."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._items: deque[tuple[asyncio.Queue, Any]] = deque()
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

    def post(self, queue: asyncio.Queue, item: Any) -> None:
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
