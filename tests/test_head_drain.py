"""SIGTERM drains a real head process (the console's restart and stop send it): in-flight requests
either finish or end cleanly with a 503 in OpenAI's shape (streamed: an error event, then the end of
the stream), never a 500, a cut connection or a traceback in the head's log; then the head exits,
well before the console's SIGKILL (10 s after the SIGTERM).

In process, the parts: `Run.abort` (each unfinished choice ends once, the engine's late events
dropped), the grace, a generation begun while draining, the gate's refusal.

Nothing here depends on the machine's speed: the generations are long enough to still run when the
grace ends on any machine (or, on a slow one, to still wait for their slot), and every client may
see either a complete answer or a clean refusal."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import threading
import time
from types import SimpleNamespace

import httpx
import openai
import pytest
from fastapi import FastAPI
from rpc_workers import head, running, wait_for
from starlette.testclient import TestClient

from hydra_console.engine.http.drain import Drain, ShuttingDown
from hydra_console.engine.http.gate import Gate
from hydra_console.engine.http.streaming import Run
from hydra_console.engine.serving.sequence import Event
from hydra_console.engine.serving.sequence import Request as EngineRequest

N_CTX, N_SLOTS = 4096, 2
GRACE_S = 1.0
MAX_TOKENS = N_CTX - 64  # with ignore_eos: thousands of tokens, still decoding when the grace ends
# Wide enough that those thousands take many seconds: the tiniest model decoded them in ~2 s, and on
# a loaded box two streams could end before the openai client's chat was in (CI saw 4 of 5 there).
SLOW_MODEL = dict(n_ctx=N_CTX, n_layers=8, n_embd=256, n_ff=1024)
CONSOLE_KILL_S = 10.0  # app/supervisor.py: SIGKILL this long after the SIGTERM


def _stream(url: str, out: dict, max_tokens: int = MAX_TOKENS) -> None:
    """A streamed completion: out["status"], out["id"] (x-request-id), out["events"] (the data
    lines, "[DONE]" included), out["exc"] when the connection failed mid-stream."""
    body = {"prompt": "once upon a time", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            out["status"], out["id"] = r.status_code, r.headers.get("x-request-id")
            out["events"] = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    data = line[6:]
                    out["events"].append(data if data == "[DONE]" else json.loads(data))
    except httpx.HTTPError as e:
        out["exc"] = repr(e)


def _plain(url: str, out: dict) -> None:
    body = {"prompt": "once upon a time", "max_tokens": MAX_TOKENS, "ignore_eos": True}
    try:
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        out["status"], out["id"], out["headers"] = r.status_code, r.headers.get("x-request-id"), r.headers
        out["body"] = r.text
    except httpx.HTTPError as e:
        out["exc"] = repr(e)


def _openai_chat(url: str, out: dict) -> None:
    """A streamed chat through the openai client: out["outcome"] "complete" (finish_reason length)
    or "refused" (the stream's error event, or a 503), else out["exc"]."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    try:
        stream = client.chat.completions.create(
            model="any",
            messages=[{"role": "user", "content": "once upon a time"}],
            max_tokens=N_CTX // 2,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        finish = None
        for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason is not None:
                finish = chunk.choices[0].finish_reason
        out["outcome"] = "complete" if finish == "length" else f"finish {finish}"
    except openai.APIStatusError as e:
        out["outcome"] = "refused" if e.status_code == 503 and "shutting down" in str(e) else f"{e!r}"
    except openai.APIError as e:  # an error event in the stream (openai's client raises it)
        out["outcome"] = "refused" if "shutting down" in e.message else f"{e!r}"
    except Exception as e:
        out["exc"] = repr(e)


def _check_plain(out: dict) -> str:
    """ "complete" or "refused" (a clean 503); anything else fails."""
    assert "exc" not in out, out
    if out["status"] == 200:
        choice = json.loads(out["body"])["choices"][0]
        assert choice["finish_reason"] == "length", out
        return "complete"
    assert out["status"] == 503, out
    err = json.loads(out["body"])["error"]
    assert "shutting down" in err["message"] and err["type"] == "unavailable_error", err
    assert out["headers"].get("retry-after"), out["headers"]
    return "refused"


def _check_stream(out: dict) -> str:
    assert "exc" not in out, out
    if out["status"] == 503:  # refused before it began
        return "refused"
    assert out["status"] == 200, out
    events = out["events"]
    assert events and events[-1] == "[DONE]", events[-3:]  # the stream ended cleanly
    last = events[-2]
    if "error" in last:
        assert "shutting down" in last["error"]["message"] and last["error"]["code"] == "503", last
        return "refused"
    assert last["choices"][0]["finish_reason"] == "length", last
    return "complete"


@pytest.mark.integration
def test_sigterm_drains_in_flight_requests(tiny_model, tmp_path):
    model = tiny_model("llama", **SLOW_MODEL)
    w = head(model, tmp_path, (), "--dtype", "float32", "--drain-grace", str(GRACE_S), parallel=N_SLOTS, ctx=N_CTX)
    with running(w):
        # two streams and two plain requests, and a streamed chat through the openai client: two
        # take the slots, three wait in the queue
        streams, plains, chat = [{} for _ in range(2)], [{} for _ in range(2)], {}
        threads = [threading.Thread(target=_stream, args=(w.url, o)) for o in streams]
        for t in threads:
            t.start()
        # The streams first, until one has tokens: started together, the plain requests could take
        # both slots first on a loaded box, and the streams would wait their 4,032 tokens out.
        wait_for(lambda: any(len(o.get("events", ())) > 2 for o in streams), 120, "a streamed token")
        rest = [threading.Thread(target=_plain, args=(w.url, o)) for o in plains]
        rest.append(threading.Thread(target=_openai_chat, args=(w.url, chat)))
        for t in rest:
            t.start()
        threads += rest
        # mid-generation: a stream has tokens, and all five are in the engine (running or queued)
        wait_for(lambda: _in_engine(w.url) == 5, 120, "five requests in the engine")
        t0 = time.monotonic()
        os.killpg(w.proc.pid, signal.SIGTERM)
        late: dict = {}
        _plain(w.url, late)  # sent after the SIGTERM: refused (or, once the port is closed, not connected)
        w.proc.wait(timeout=CONSOLE_KILL_S + 20)
        exited_s = time.monotonic() - t0
        for t in threads:
            t.join(timeout=60)
            assert not t.is_alive()

    outcomes = [_check_stream(o) for o in streams] + [_check_plain(o) for o in plains]
    assert chat.get("outcome") in ("complete", "refused"), chat
    assert "refused" in outcomes, outcomes  # thousands of tokens cannot all finish within the grace
    if "exc" not in late:
        assert late["status"] == 503 and _check_plain(late) == "refused", late
    assert exited_s < CONSOLE_KILL_S, f"the head took {exited_s:.1f} s to exit after SIGTERM"
    log = w.log_path.read_text(errors="replace")
    assert "Traceback" not in log, log[-4000:]
    assert "Exception in ASGI application" not in log, log[-4000:]
    for o in [*streams, *plains]:  # one log line per request, saying how it ended
        lines = [line for line in log.splitlines() if o["id"] in line]
        assert len(lines) == 1, (o["id"], lines)


def _stopping(url: str) -> bool:
    """/health says the drain has begun, or the head is gone already."""
    try:
        r = httpx.get(f"{url}/health", timeout=10)
    except httpx.HTTPError:
        return True
    return r.status_code == 503 and r.json().get("reason") == "the server is shutting down"


def _in_engine(url: str) -> int:
    r = httpx.get(f"{url}/status", timeout=10).json()["requests"]
    return r["slots_busy"] + r["queued"]


@pytest.mark.integration
def test_drain_lets_short_generations_finish_and_a_second_sigterm_ends_it(tiny_model, tmp_path):
    """A long grace: a short generation in flight at the SIGTERM finishes; a second SIGTERM ends the
    grace at once, and the long one still running ends cleanly."""
    model = tiny_model("llama", n_ctx=N_CTX)
    w = head(model, tmp_path, (), "--dtype", "float32", "--drain-grace", "600", parallel=N_SLOTS, ctx=N_CTX)
    with running(w):
        short, long = {}, {}
        threads = [
            threading.Thread(target=_stream, args=(w.url, short, 64)),
            threading.Thread(target=_stream, args=(w.url, long)),
        ]
        for t in threads:
            t.start()
        wait_for(lambda: all(len(o.get("events", ())) > 1 for o in (short, long)), 60, "both streams' tokens")
        os.killpg(w.proc.pid, signal.SIGTERM)
        threads[0].join(timeout=120)  # 64 tokens: well within the grace
        assert _check_stream(short) == "complete"
        # the drain has begun (two signals at once would reach Python's handler as one)
        wait_for(lambda: _stopping(w.url), 60, "/health to say the head is shutting down")
        t0 = time.monotonic()
        with contextlib.suppress(ProcessLookupError):  # the long one may have finished too: the head is gone
            os.killpg(w.proc.pid, signal.SIGTERM)
        w.proc.wait(timeout=CONSOLE_KILL_S + 20)
        exited_s = time.monotonic() - t0
        threads[1].join(timeout=60)
    assert _check_stream(long) in ("complete", "refused")
    assert exited_s < CONSOLE_KILL_S, f"the head took {exited_s:.1f} s to exit after the second SIGTERM"
    log = w.log_path.read_text(errors="replace")
    assert "Traceback" not in log, log[-4000:]


# ---- in process: the drain's parts --------------------------------------------------------------


class _Engine:
    n_slots = 4

    def __init__(self):
        self.submitted, self.cancelled = [], []

    def submit(self, req):
        self.submitted.append(req)

    def submit_together(self, reqs):
        self.submitted.extend(reqs)

    def cancel(self, req):
        self.cancelled.append(req)


class _Http:
    scope: dict = {}

    async def is_disconnected(self) -> bool:
        return False


def _head(grace_s: float = 0.0):
    return SimpleNamespace(cfg=SimpleNamespace(role="head"), engine=_Engine(), drain=Drain(grace_s))


async def _read(run: Run) -> list[tuple[int, str, str | None, BaseException | None]]:
    return [(i, ev.text, ev.finish_reason, ev.error) async for i, ev in run.events()]


@pytest.mark.unit
def test_abort_ends_each_unfinished_choice_once_and_drops_the_engines_late_events():
    async def main():
        h = _head()
        reqs = [EngineRequest(prompt=[1]), EngineRequest(prompt=[1])]
        run = Run(h, _Http(), reqs)
        assert h.engine.submitted == reqs and run.live
        reqs[0].sink(Event(text="a"))
        reqs[1].sink(Event(text="b", finish_reason="length"))
        reader = asyncio.ensure_future(_read(run))
        await asyncio.sleep(0.01)
        await h.drain.run()  # grace 0: the run is aborted
        assert not run.live and h.drain.closing
        reqs[0].sink(Event(text="late"))  # what the engine still sends before the cancel takes effect
        reqs[0].sink(Event(finish_reason="cancelled"))
        seen = await asyncio.wait_for(reader, 5)
        assert [(i, t, f) for i, t, f, _ in seen] == [(0, "a", None), (1, "b", "length"), (0, "", "error")]
        assert isinstance(seen[-1][3], ShuttingDown) and str(seen[-1][3]) == "the server is shutting down"
        assert set(map(id, h.engine.cancelled)) >= set(map(id, reqs))

    asyncio.run(main())


@pytest.mark.unit
def test_a_final_on_its_way_when_the_run_is_aborted_is_kept():
    async def main():
        h = _head()
        reqs = [EngineRequest(prompt=[1]), EngineRequest(prompt=[1])]
        run = Run(h, _Http(), reqs)
        reqs[1].sink(Event(text="b", finish_reason="length"))  # posted, not yet in the run's inbox
        run.abort(ShuttingDown())
        seen = await asyncio.wait_for(_read(run), 5)
        assert sorted((i, f) for i, _, f, _ in seen) == [(0, "error"), (1, "length")]

    asyncio.run(main())


@pytest.mark.unit
def test_drain_waits_for_a_run_that_finishes_within_the_grace():
    async def main():
        h = _head(grace_s=30.0)
        req = EngineRequest(prompt=[1])
        run = Run(h, _Http(), [req])
        reader = asyncio.ensure_future(_read(run))
        draining = asyncio.ensure_future(h.drain.run())
        await asyncio.sleep(0.2)
        assert not draining.done()  # the run is still live: the drain waits
        req.sink(Event(text="done", finish_reason="stop"))
        await asyncio.wait_for(draining, 5)
        assert [(t, f) for _, t, f, _ in await reader] == [("done", "stop")]

    asyncio.run(main())


@pytest.mark.unit
def test_a_run_started_while_draining_ends_at_once_without_the_engine():
    async def main():
        h = _head()
        await h.drain.run()
        reqs = [EngineRequest(prompt=[1]), EngineRequest(prompt=[1])]
        seen = await asyncio.wait_for(_read(Run(h, _Http(), reqs)), 5)
        assert h.engine.submitted == []
        assert sorted((i, f) for i, _, f, _ in seen) == [(0, "error"), (1, "error")]
        assert all(isinstance(e, ShuttingDown) for *_, e in seen)

    asyncio.run(main())


@pytest.mark.unit
def test_the_gate_refuses_new_requests_while_draining():
    app = FastAPI()

    @app.post("/v1/echo")
    async def echo():
        return {"ok": True}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    drain = Drain(5.0)
    app.add_middleware(Gate, api_key=None, max_body=1024, drain=drain)
    c = TestClient(app)
    assert c.post("/v1/echo").status_code == 200
    drain.closing = True
    r = c.post("/v1/echo")
    assert r.status_code == 503 and r.headers["retry-after"] == "5"
    assert r.json()["error"]["message"] == "the server is shutting down"
    assert c.get("/health").status_code == 200  # public paths are not the gate's to refuse
