"""A generation seen from asyncio and written back: `Run` (the engine requests of one HTTP request,
their events in one inbox, fair admission, a client that leaves cancels them), `bursts` and SSE
framing (`sse`, `named_sse`), `single_reply` (one request run to its end), and how a failed
generation is answered (`generation_error`, `stream_error`, `check_finish`)."""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import StreamingResponse

from ..errors import Overloaded, Unavailable, describe
from .drain import ShuttingDown
from .errors import APIError
from .event_bridge import Inbox, LoopMailbox
from .gate import record_of

if TYPE_CHECKING:  # the engine's modules bring torch: imported when the model loads, after the port is up
    from ..serving.sequence import Event
    from ..serving.sequence import Request as EngineRequest
    from ..text.tool_calls import ToolFormat
    from .handle import Head

DISCONNECT_POLL_S = 0.25


def usage_of(finals: list[Event]) -> dict | None:
    """One usage for all choices: the prompt once, every choice's completion tokens."""
    usages = [ev.usage for ev in finals if ev.usage]
    if not usages:
        return None
    completion = sum(u["completion_tokens"] for u in usages)
    return {**usages[0], "completion_tokens": completion, "total_tokens": usages[0]["prompt_tokens"] + completion}


def engine_share(n_slots: int) -> int:
    """Engine requests one HTTP request keeps in the engine at once (its choices, its embedding
    inputs): all slots but one, so another client always finds a slot within one of its turns, and
    one request never fills the queue."""
    return max(1, n_slots - 1)


class Run:
    """The engine requests of one HTTP request (one per choice) seen from asyncio: their events
    arrive in one inbox through the loop's `LoopMailbox`, tagged with the choice index. `streamed`:
    the response is an event stream, whose writes notice a client that left (starlette listens for
    it beside the stream, or a write fails): the disconnect poll then runs only while no events come.

    Fair admission: at most `engine_share` choices are in the engine at once; the rest are held here
    and submitted one as each of the request's own choices finishes (a full queue then holds it
    back until there is room: the request was admitted, it is not refused midway)."""

    def __init__(self, head: Head, http: Request, reqs: list[EngineRequest], streamed: bool = False):
        if head.cfg.role == "prefill":
            raise APIError(
                400, "this worker only prefills for decode heads (--role prefill): send requests to a decode head"
            )
        self.head, self.http, self.reqs, self.streamed = head, http, reqs, streamed
        self.record = record_of(http)
        self.inbox = Inbox()
        self.done: set[int] = set()  # choices whose final event the consumer has had
        self.ended = False  # aborted, or its consumer stopped reading
        self.mailbox = mailbox = LoopMailbox.of(asyncio.get_running_loop())
        for i, req in enumerate(reqs):
            req.sink = lambda ev, i=i: mailbox.post(self.inbox, (i, ev))
        share = engine_share(head.engine.n_slots)
        self.held = list(reqs[share:])
        if not head.drain.admit(self):  # SIGTERM's drain has begun: ended before it starts, as a 503
            self.abort(ShuttingDown())  # (not raised: a stream may build its Run after its headers went out)
            return
        try:
            head.engine.submit_together(reqs[:share])
        except Exception:  # a full queue refuses the whole request, not some of its choices
            self.ended = True
            self._cancel()
            raise

    def _submit_held(self, n: int) -> None:
        """Up to `n` held choices into the engine; those a full queue refuses stay held (retried at
        the next poll)."""
        while n > 0 and self.held:
            try:
                self.head.engine.submit(self.held[0])
            except Overloaded:
                return
            self.held.pop(0)
            n -= 1

    def _in_engine(self, finished: int) -> int:
        return len(self.reqs) - len(self.held) - finished

    def _cancel(self) -> None:
        for req in self.reqs:
            self.head.engine.cancel(req)

    @property
    def live(self) -> bool:
        """Some choice still generating for a consumer (what SIGTERM's drain waits for)."""
        return not self.ended and len(self.done) < len(self.reqs)

    def abort(self, error: BaseException) -> None:
        """End every unfinished choice now (in the loop): the consumer reads a final event with
        `error` for each, as if the engine had failed it, after the engine's events already posted
        (through the same mailbox: a choice whose own final was on its way keeps it); the engine's
        later events for them are dropped (`done`), their requests cancelled."""
        from ..serving.sequence import Event

        self.ended = True
        self.held.clear()
        for i in range(len(self.reqs)):
            if i not in self.done:
                self.mailbox.post(self.inbox, (i, Event(finish_reason="error", error=error)))
        self._cancel()

    async def events(self) -> AsyncIterator[tuple[int, Event]]:
        """(choice index, event) until every choice has finished; a client that goes away cancels
        them (their slots are freed at once)."""
        loop = asyncio.get_running_loop()
        checked = loop.time()
        finals: list[Event] = []
        try:
            while len(finals) < len(self.reqs):
                if self.held:  # one in for each choice that finished (or was refused by a full queue)
                    self._submit_held(engine_share(self.head.engine.n_slots) - self._in_engine(len(finals)))
                i, ev = await self.inbox.get(DISCONNECT_POLL_S, empty=(0, None))
                # checked while events flow too: a non-streamed request's client may leave mid-generation
                if ev is None or (not self.streamed and loop.time() - checked >= DISCONNECT_POLL_S):
                    checked = loop.time()
                    if await self.http.is_disconnected():
                        return
                if ev is None or i in self.done:  # in `done`: an aborted choice's own late events
                    continue
                if ev.finish_reason is not None:
                    self.done.add(i)
                    finals.append(ev)
                    if self.record is not None:
                        self.record.usage(usage_of(finals))
                        if ev.error is not None:  # a stream has sent its 200 already: the log says why it ended
                            self.record.reason = describe(ev.error)
                yield i, ev
        finally:
            self.ended = True
            self._cancel()

    def response(self, parts: AsyncIterator[bytes]) -> StreamingResponse:
        """The event stream of `parts` (this run's SSE events), written once per burst."""
        return StreamingResponse(bursts(parts, self.inbox.pending), media_type="text/event-stream")


async def bursts(parts: AsyncIterator[bytes], pending: Callable[[], bool]) -> AsyncIterator[bytes]:
    """`parts` joined while `pending()` (more events already waiting): each write costs the ASGI
    middleware chain and a send, so a stream that falls behind catches up in fewer writes."""
    held: list[bytes] = []
    async for part in parts:
        held.append(part)
        if not pending():
            yield b"".join(held)
            held.clear()
    if held:
        yield b"".join(held)


def generation_error(ev: Event) -> APIError:
    """A failed generation by the type of its exception: a peer gone away (retry once it is back) is
    503, anything else 500."""
    message = f"generation failed: {describe(ev.error)}"
    if isinstance(ev.error, Unavailable):
        return APIError(503, message, "unavailable_error", retry_after=ev.error.retry_after)
    return APIError(500, message, "server_error")


def stream_error(ev: Event) -> dict:
    e = generation_error(ev)
    return {"error": {"message": describe(ev.error), "type": e.type, "param": None, "code": str(e.status)}}


async def single_reply(head: Head, http: Request, req: EngineRequest, calls: ToolFormat | None):
    """One request run to its end, not streamed: (content, tool calls, final event), None when the
    client left; a generation error raises (check_finish)."""
    from ..text.tool_calls import reply_parts

    text, final = [], None
    async for _, ev in Run(head, http, [req]).events():
        text.append(ev.text)
        if ev.finish_reason is not None:
            final = ev
    if final is None:
        return None
    check_finish(final)
    return (*reply_parts(calls, "".join(text)), final)


def check_finish(ev: Event) -> None:
    if ev.finish_reason == "error":
        raise generation_error(ev)


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def named_sse(kind: str, data: dict) -> bytes:
    """An SSE event named by its type, as Anthropic's and OpenAI's Responses streams send them."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n".encode()
