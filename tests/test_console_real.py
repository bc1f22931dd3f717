"""The console driving REAL `hydra-engine serve` + `hydra-engine peer` workers on a tiny synthetic model."""

from __future__ import annotations

import importlib.util
import re
import threading

import httpx
import pytest
from consoles import all_ready, until
from rpc_workers import HTTP, free_ports

from hydra_console.app.config import Profile, SupervisorSettings, WorkerSpec
from hydra_console.app.log_text import ACCESS_LINE
from hydra_console.app.records import State
from hydra_console.app.split_plan import ModelShape
from hydra_console.app.supervisor import Supervisor
from hydra_console.app.ui.app import HydraConsole
from hydra_console.app.ui.dialogs import ConfirmScreen
from hydra_console.app.ui.split_editor import SplitEditorScreen

ENGINE_MISSING = [
    m
    for m in ("hydra_console.engine.http.api", "hydra_console.engine.workers.peer")
    if importlib.util.find_spec(m) is None
]
pytestmark = pytest.mark.skipif(bool(ENGINE_MISSING), reason=f"engine workers not built yet: {ENGINE_MISSING} missing")


def real_profile(model) -> Profile:
    # Both pairs from one call: two calls could hand the peer the head's RPC port (P + 1).
    head, peer = free_ports(2, pairs=True)
    return Profile(
        name="real",
        model=str(model),
        ctx=128,
        parallel=2,
        head=WorkerSpec(name="head", port=head, device="cpu"),
        peers=[WorkerSpec(name="peer1", port=peer, device="cpu")],
        supervisor=SupervisorSettings(poll_s=0.25, grace_s=10),
    )


def status(w) -> dict:
    return HTTP.get(f"{w.spec.url}/status", timeout=15).json()


async def test_real_workers_ready_then_restart_peer_changes_pid(tiny_model, tmp_path):
    sup = Supervisor(real_profile(tiny_model("llama", n_layers=4)), log_dir=tmp_path)
    app = HydraConsole(sup, load_model_shape=False)
    try:
        async with app.run_test(size=(80, 24)) as pilot:
            await until(pilot, lambda: all_ready(sup), timeout=120)
            # A peer says degraded until its head loads its layers: at its start that is waiting, no incident.
            seen = sorted((e.worker, e.kind) for e in sup.events)
            assert seen == [("head", "ready"), ("head", "started"), ("peer1", "ready"), ("peer1", "started")], seen
            peer = sup.workers["peer1"]
            old = peer.pid
            assert status(peer)["pid"] == old and status(sup.head)["role"] == "head"
            await pilot.press("down", "R")
            assert isinstance(app.screen, ConfirmScreen) and f"peer1 (pid {old})" in app.screen.question
            await pilot.press("y")
            await until(pilot, lambda: peer.pid != old and peer.state == State.READY, timeout=120)
            assert status(peer)["pid"] == peer.pid != old
            await pilot.press("q")
            assert isinstance(app.screen, ConfirmScreen)
            await pilot.press("y")
            await until(pilot, lambda: not sup.running_managed(), timeout=30)
    finally:
        await sup.shutdown()  # whatever failed: no worker outlives the test
    assert all(w.state == State.STOPPED for w in sup.workers.values())


async def test_real_split_change_shows_in_status(tiny_model, tmp_path):
    model = tiny_model("llama", n_layers=4)
    sup = Supervisor(real_profile(model), log_dir=tmp_path)
    app = HydraConsole(sup, model_shape=ModelShape.from_gguf(model))
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: all_ready(sup) and sup.stage_ranges() is not None, timeout=120)
        assert [s["layers"] for s in status(sup.head)["stages"]] == [[0, 2], [2, 4]]
        await pilot.press("s")
        assert isinstance(app.screen, SplitEditorScreen) and app.screen.counts == [2, 2]
        await pilot.press("right", "a")
        assert isinstance(app.screen, ConfirmScreen) and "3/1" in app.screen.question
        head_pid = sup.head.pid
        await pilot.press("y")
        await until(pilot, lambda: [s["layers"] for s in status(sup.head)["stages"]] == [[0, 3], [3, 4]], timeout=60)
        peer_stages = status(sup.workers["peer1"])["stages"]
        assert [s["layers"] for s in peer_stages] == [[3, 4]]
        # Whether it went live (CONFIGURE) or by restart, the event timeline says so.
        assert any(e.kind == "split" for e in sup.events)
        if sup.head.pid == head_pid:
            assert any("live re-split to 3/1" in e.message for e in sup.events)
        await pilot.press("escape")
        await until(pilot, lambda: "[0,3)" in str(app.dashboard.query_one("#workers").get_cell("head", "layers")), 10)
        # Requests through the split while the console polls: the head's steps by phase show up.
        info, stop = app.dashboard.query_one("#info"), threading.Event()
        shown = re.compile(r"\nstep [\d.]+ ms · schedule [\d.]+ · forward [\d.]+ · read [\d.]+ · emit [\d.]+")

        def load() -> None:
            while not stop.is_set():
                body = {"prompt": "hello world", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
                assert HTTP.post(f"{sup.head.spec.url}/v1/completions", json=body, timeout=60).status_code == 200

        requests = threading.Thread(target=load)
        requests.start()
        try:
            await until(pilot, lambda: shown.search(str(info.render())), timeout=60)
        finally:
            stop.set()
            requests.join(timeout=60)
        app._stop_and_exit(True)
        await until(pilot, lambda: not sup.running_managed(), timeout=30)


async def test_an_attached_console_and_the_supervising_one_converge_on_a_split_and_a_head_restart(tiny_model, tmp_path):
    """Console B (attached) applies 3/1 live; console A (which runs the workers) follows it through
    the head's /status, so its crash-restart of the head relaunches 3/1; B sees the new pid."""
    import asyncio
    import os
    import signal
    import time

    profile = real_profile(tiny_model("llama", n_layers=4))
    own = Supervisor(profile, log_dir=tmp_path)
    att = Supervisor(profile.model_copy(deep=True), attach=True)

    async def wait(cond, timeout=120):
        deadline = time.monotonic() + timeout
        while not cond():
            assert time.monotonic() < deadline, "condition not met in time"
            await asyncio.sleep(0.1)

    await own.start()
    await att.start()
    try:
        await wait(lambda: all_ready(own) and all_ready(att) and own.stage_ranges() is not None)
        assert "--split" not in own.head.argv
        assert await att.apply_split([3, 1]) == "live"
        assert status(own.head)["split_by"] == att.identity
        await wait(lambda: own.split == [3, 1])
        assert any(e.kind == "split" and f"applied by {att.identity}" in e.message for e in own.events)
        old = own.head.pid
        os.killpg(old, signal.SIGKILL)
        await wait(lambda: own.head.pid != old and own.head.running)
        assert own.head.argv[own.head.argv.index("--split") + 1] == "3/1"
        await wait(lambda: all_ready(own) and [r for _, r in own.stage_ranges() or []] == [(0, 3), (3, 4)])
        await wait(
            lambda: any(e.kind == "restarted" and f"pid {old} → {own.head.pid}" in e.message for e in att.events)
        )
    finally:
        await att.shutdown()
        await own.shutdown()


async def test_a_missing_model_is_a_named_crash_loop_in_the_row_and_the_events(tmp_path):
    profile = real_profile(tmp_path / "no-such-model.gguf")
    profile.peers = []
    profile.supervisor = SupervisorSettings(
        poll_s=0.25, grace_s=10, backoff_initial_s=0.1, backoff_max_s=0.5, crash_loop_count=2
    )
    sup = Supervisor(profile, log_dir=tmp_path)
    app = HydraConsole(sup, load_model_shape=False)
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: any(e.kind == "crash-loop" for e in sup.events), timeout=120)
        loop = next(e.message for e in sup.events if e.kind == "crash-loop")
        assert "cannot open model file" in loop and "no-such-model.gguf" in loop
        table = app.dashboard.query_one("#workers")
        await until(pilot, lambda: "crash-loop" in str(table.get_cell("head", "state")))
        assert "2: hydra-engine: error: cannot open model file" in str(table.get_cell("head", "exit"))
        app._stop_and_exit(True)
        await until(pilot, lambda: not sup.running_managed(), timeout=30)


async def test_detached_real_workers_keep_serving_and_the_next_console_adopts_them(tiny_model, tmp_path):
    import asyncio
    import time

    import psutil

    profile = real_profile(tiny_model("llama", n_layers=4))
    first = Supervisor(profile, log_dir=tmp_path)
    await first.start()
    deadline = time.monotonic() + 120
    while not all_ready(first):
        assert time.monotonic() < deadline, "workers never ready"
        await asyncio.sleep(0.1)
    pids = [w.pid for w in first.workers.values()]
    await first.shutdown(stop_workers=False)

    def complete() -> int:
        body = {"prompt": "hi", "max_tokens": 4, "temperature": 0}
        return HTTP.post(f"{profile.head.url}/v1/completions", json=body, timeout=60).status_code

    assert await asyncio.to_thread(complete) == 200  # its pipes to the console are closed: it serves on
    nxt = Supervisor(profile, log_dir=tmp_path)
    await nxt.start()
    try:
        assert [w.pid for w in nxt.workers.values()] == pids and [e.kind for e in nxt.events] == ["adopted", "adopted"]
        assert await asyncio.to_thread(complete) == 200
        # The head writes its own log file: its access log line reaches the console that adopted it.
        deadline = time.monotonic() + 30
        while not any(ACCESS_LINE.search(ln.text) and "/v1/completions 200" in ln.text for ln in nxt.head.log):
            assert time.monotonic() < deadline, "no access-log line from the adopted head"
            await asyncio.sleep(0.05)
    finally:
        await nxt.shutdown()
    assert all(not psutil.pid_exists(p) or psutil.Process(p).status() == psutil.STATUS_ZOMBIE for p in pids)


async def test_a_keyboard_restart_of_the_head_under_12_requests_gives_no_5xx_but_503(tiny_model, tmp_path):
    """R on the head while 12 requests run or wait: the head drains, so each one ends with its text
    or a clean 503 in OpenAI's shape, never a 500, a reset connection or a traceback in the head's
    log; the new head serves."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    profile = real_profile(tiny_model("llama", n_layers=4))
    profile.ctx = 1024
    sup = Supervisor(profile, log_dir=tmp_path)
    app = HydraConsole(sup, load_model_shape=False)

    def complete(i: int) -> httpx.Response | httpx.HTTPError:
        body = {"prompt": f"request {i}", "max_tokens": 800, "temperature": 0, "ignore_eos": True}
        try:
            return HTTP.post(f"{profile.head.url}/v1/completions", json=body, timeout=120)
        except httpx.HTTPError as e:
            return e

    def in_engine() -> int:
        r = status(sup.head)["requests"]
        return r["slots_busy"] + r["queued"]

    try:
        async with app.run_test(size=(80, 24)) as pilot:
            await until(pilot, lambda: all_ready(sup), timeout=120)
            old = sup.head.pid
            with ThreadPoolExecutor(12) as pool:
                replies = [pool.submit(complete, i) for i in range(12)]
                await until(pilot, lambda: in_engine() == 12, timeout=60)
                await pilot.press("R")  # the cursor starts on the head
                assert isinstance(app.screen, ConfirmScreen) and f"head (pid {old})" in app.screen.question
                await pilot.press("y")
                await until(pilot, lambda: all(r.done() for r in replies), timeout=120)
            outcomes = [r.result() for r in replies]
            for r in outcomes:
                assert isinstance(r, httpx.Response), f"{type(r).__name__}: {r}"
                assert r.status_code in (200, 503), (r.status_code, r.text[:500])
                if r.status_code == 503:
                    assert r.json()["error"]["type"] == "unavailable_error" and r.headers.get("retry-after"), r.text
            assert any(r.status_code == 503 for r in outcomes)  # 12 x 800 tokens do not fit the drain
            await until(pilot, lambda: sup.head.pid != old and sup.head.state == State.READY, timeout=120)
            body = {"prompt": "hi", "max_tokens": 4, "temperature": 0}
            again = await asyncio.to_thread(httpx.post, f"{profile.head.url}/v1/completions", json=body, timeout=60)
            assert again.status_code == 200, again.text
            assert not any("Traceback" in ln.text for ln in sup.head.log), [ln.text for ln in sup.head.log][-40:]
    finally:
        await sup.shutdown()
