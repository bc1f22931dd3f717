"""The console driving REAL `hydra-engine serve` + `hydra-engine peer` workers on a tiny synthetic model."""

from __future__ import annotations

import importlib.util

import httpx
import pytest

from hydra_console.app.config import Profile, SupervisorSettings, WorkerSpec
from hydra_console.app.split_plan import ModelShape
from hydra_console.app.supervisor import State, Supervisor
from hydra_console.app.ui.app import HydraConsole
from hydra_console.app.ui.dialogs import ConfirmScreen
from hydra_console.app.ui.split_editor import SplitEditorScreen

from consoles import all_ready, port_pair, until

ENGINE_MISSING = [m for m in ("hydra_console.engine.api", "hydra_console.engine.workers.peer") if importlib.util.find_spec(m) is None]
pytestmark = pytest.mark.skipif(bool(ENGINE_MISSING), reason=f"engine workers not built yet: {ENGINE_MISSING} missing")


def real_profile(model) -> Profile:
    return Profile(
        name="real",
        model=str(model),
        ctx=128,
        parallel=2,
        head=WorkerSpec(name="head", port=port_pair(), device="cpu"),
        peers=[WorkerSpec(name="peer1", port=port_pair(), device="cpu")],
        supervisor=SupervisorSettings(poll_s=0.25, grace_s=10),
    )


def status(w) -> dict:
    return httpx.get(f"{w.spec.url}/status", timeout=15).json()


async def test_real_workers_ready_then_restart_peer_changes_pid(tiny_model, tmp_path):
    sup = Supervisor(real_profile(tiny_model("llama", n_layers=4)), log_dir=tmp_path)
    app = HydraConsole(sup, load_model_shape=False)
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: all_ready(sup), timeout=120)
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
        app._stop_and_exit(True)
        await until(pilot, lambda: not sup.running_managed(), timeout=30)
