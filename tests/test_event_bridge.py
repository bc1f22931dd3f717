"""Events from the engine's thread into asyncio: in order, per inbox, one wake-up per burst, one write per burst."""

from __future__ import annotations

import asyncio
import threading

import pytest

from hydra_console.engine.http.event_bridge import Inbox, LoopMailbox
from hydra_console.engine.http.streaming import bursts

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


def test_an_inbox_gives_what_was_put_and_times_out_empty():
    async def main():
        box = Inbox()
        assert not box.pending()
        t = asyncio.get_running_loop().time()
        assert await box.get(0.05, empty="none") == "none"
        assert asyncio.get_running_loop().time() - t >= 0.04
        asyncio.get_running_loop().call_later(0.01, box.put_nowait, "a")
        assert await box.get(5) == "a"  # woken by the put, not the timeout
        box.put_nowait("b"), box.put_nowait("c")
        assert box.pending()
        assert [await box.get(5), await box.get(5)] == ["b", "c"]
        assert not box.pending()

    asyncio.run(main())


def test_a_stream_behind_its_events_writes_them_in_one_burst():
    async def main():
        box = Inbox()

        async def parts():  # one SSE event per inbox item, as the routes' generators
            while (item := await box.get(0.05)) is not None:
                yield f"data: {item}\n\n".encode()
            yield b"data: [DONE]\n\n"

        for n in range(3):  # a step's events arrived before the stream read any
            box.put_nowait(n)
        writes = []
        async for chunk in bursts(parts(), box.pending):
            writes.append(chunk)
            if len(writes) == 1:
                box.put_nowait(3)  # the next step's, after the first write
        assert writes[0] == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
        assert b"".join(writes) == b"".join(f"data: {n}\n\n".encode() for n in range(4)) + b"data: [DONE]\n\n"

    asyncio.run(main())
