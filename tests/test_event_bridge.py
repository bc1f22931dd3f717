"""Events from the engine's thread into asyncio: in order, per queue, one wake-up per burst."""

from __future__ import annotations

import asyncio
import threading

import pytest

from hydra_console.engine.event_bridge import LoopMailbox

pytestmark = pytest.mark.unit


def test_a_burst_arrives_in_order_with_one_wake_up():
    async def main():
        loop = asyncio.get_running_loop()
        box = LoopMailbox.of(loop)
        assert LoopMailbox.of(loop) is box  # one per loop
        wakeups = []
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: (wakeups.append(a), real(*a))
        queues = [asyncio.Queue(), asyncio.Queue()]

        def engine_step(first: int):  # a step's events, posted while the loop is busy elsewhere
            for n in range(first, first + 50):
                box.post(queues[n % 2], n)

        for first in (0, 50):
            thread = threading.Thread(target=engine_step, args=(first,))
            thread.start()
            thread.join()  # the loop did not run meanwhile: the whole burst waits for one drain
            await asyncio.sleep(0)
        got = [[q.get_nowait() for _ in range(q.qsize())] for q in queues]
        assert got == [list(range(0, 100, 2)), list(range(1, 100, 2))]
        assert len(wakeups) == 2  # one per burst, not one per event

    asyncio.run(main())


def test_posts_after_the_loop_closed_are_dropped_quietly():
    loop = asyncio.new_event_loop()
    box = LoopMailbox.of(loop)
    loop.close()
    box.post(asyncio.Queue(), "late")  # the engine thread must not fail on it
