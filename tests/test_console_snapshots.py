"""Snapshot tests: the real app on a fixed data feed (attached workers, fixed clock), 80x24 and 120x40.

Update after an intended visual change with `pytest tests/test_console_snapshots.py --snapshot-update`
and look at the SVGs in tests/__snapshots__/ before committing them.
"""

from __future__ import annotations

import time
from collections import deque

import pytest
from consoles import uniform_shape

from hydra_console.app.config import Profile, SupervisorSettings, WorkerSpec
from hydra_console.app.records import LogLine
from hydra_console.app.sources import FixedFeedSource, Probe
from hydra_console.app.supervisor import Supervisor
from hydra_console.app.ui.app import HydraConsole

T0 = 1_767_225_600.0  # 2026-01-01 00:00:00 UTC
GiB = 1 << 30


def gpu(index: int, used: float, total: float = 139) -> dict:
    return {
        "index": index,
        "kind": "cuda",
        "name": "NVIDIA H200",
        "memory_used": int(used * GiB),
        "memory_total": int(total * GiB),
        "util": 35.0,
    }


HEAD_STATUS = {
    "role": "head",
    "pid": 4101,
    "uptime_s": 3725.0,
    "state": "ok",
    "startup_stage": 5,
    "model": {"name": "Gemma 3 270m", "arch": "gemma3", "n_layers": 18},
    "stages": [
        {"role": "head", "addr": "127.0.0.1:8081", "layers": [0, 6], "device": "cuda:0", "state": "ok"},
        {"role": "peer", "addr": "127.0.0.1:8091", "layers": [6, 12], "device": "cuda:1", "state": "ok"},
        {"role": "peer", "addr": "10.0.0.7:8091", "layers": [12, 18], "device": "cuda:0", "state": "ok"},
    ],
    "devices": [gpu(0, 31.5)],
    "throughput": {"prefill_tok_s": 4210.0, "decode_tok_s": 187.5},
    "speculative": {"type": "ngram", "draft_max": 3, "drafts": 812, "acceptance": 0.62, "mean_accepted_len": 1.86},
    "pool": {
        "size": 2,
        "busy": 1,
        "queued": 0,
        "queue_max": 64,
        "dropped": 0,
        "accepted": 57,
        "connections": 1,
        "compute": 0,
    },
    "requests": {
        "slots_busy": 1,
        "slots_total": 1,
        "queued": 2,
        "requests_per_s": 0.4,
        "requests_total": 57,
        "ttft_p50_ms": 212.0,
        "ttft_p99_ms": 930.0,
        "itl_p50_ms": 5.3,
        "itl_p99_ms": 11.8,
    },
    "peers": [
        {"addr": "127.0.0.1:8091", "state": "up", "rtt_ms": 0.4, "layers": [6, 12]},
        {"addr": "10.0.0.7:8091", "state": "up", "rtt_ms": 72.5, "layers": [12, 18]},
    ],
    "slots": [{"id": 0, "state": "processing", "n_ctx": 4096, "n_past": 812}],
}
PEER_STATUS = {
    "role": "peer",
    "pid": 4102,
    "uptime_s": 3731.0,
    "state": "ok",
    "startup_stage": 5,
    "stages": [{"role": "peer", "addr": "127.0.0.1:8091", "layers": [6, 12]}],
    "devices": [gpu(1, 128.0)],
}
FEED = {
    "head": Probe(True, 200, {"status": "ok", "startup_stage": 5}, HEAD_STATUS),
    "peer1": Probe(True, 200, {"status": "ok", "startup_stage": 5}, PEER_STATUS),
    # peer2 is down: the feed has no answer for it.
}
LOG = [
    ("head", "hydra-engine: serving gemma-3-270m on http://127.0.0.1:8080"),
    ("peer1", "hydra-engine peer: layers [6,12) on cuda:1"),
    ("peer2", "OSError: [Errno 98] Address already in use"),
    ("head", "peer 10.0.0.7:8091: [Errno 111] Connection refused, retrying in 2 s"),
    ("peer1", "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"),
    ("head", "INFO hydra.http 3f2a9c1b7d4e POST /v1/completions 200 in=12 out=64 412ms"),
]
SHAPE = uniform_shape(18, 3 << 19, 90 << 20, 512)


@pytest.fixture(autouse=True)
def utc(monkeypatch):
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def make_app(theme: str = "hydra-dark") -> HydraConsole:
    profile = Profile(
        name="lab",
        head=WorkerSpec(name="head", port=8080, device="cuda:0"),
        peers=[
            WorkerSpec(name="peer1", port=8090, device="cuda:1"),
            WorkerSpec(name="peer2", host="10.0.0.7", port=8090, device="cuda:0"),
        ],
        supervisor=SupervisorSettings(poll_s=3600),  # one poll: the picture must not move
    )
    sup = Supervisor(profile, attach=True, source=FixedFeedSource(FEED), clock=lambda: T0)
    for i, (worker, text) in enumerate(LOG):
        line = LogLine(i, T0 - 60 + i, worker, text)
        sup.workers[worker].log.append(line)
        sup.merged_log.append(line)
    return HydraConsole(sup, theme=theme, model_shape=SHAPE)


async def settle(pilot) -> None:
    app = pilot.app
    await app.supervisor.poll_once()
    app.supervisor.head.prefill_hist = deque([0, 800, 3900, 4100, 4210, 3000, 4500, 4210] * 4)
    app.supervisor.head.decode_hist = deque([150, 160, 187, 175, 190, 187, 120, 187.5] * 4)
    wan = [40.1, 41.0, 39.8, 72.5, 72.5, 43.0, 40.4, 40.9]  # a spike over the 50 ms alert, held two polls
    app.supervisor.head.rtt_hist = {
        "127.0.0.1:8091": deque((T0 - 31 + i, 0.4) for i in range(32)),
        "10.0.0.7:8091": deque((T0 - 31 + i, ms) for i, ms in enumerate(wan * 4)),
    }
    app.refresh_view()
    await pilot.pause()


@pytest.mark.parametrize("size", [(80, 24), (120, 40)])
def test_dashboard(snap_compare, size):
    assert snap_compare(make_app(), terminal_size=size, run_before=settle)


def test_dashboard_colourblind_theme(snap_compare):
    assert snap_compare(make_app("hydra-colourblind"), terminal_size=(120, 40), run_before=settle)


def test_dashboard_light_no_color(snap_compare, monkeypatch):
    monkeypatch.setenv("NO_COLOR", "1")
    assert snap_compare(make_app("hydra-light"), terminal_size=(80, 24), run_before=settle)


@pytest.mark.parametrize("size", [(80, 24), (120, 40)])
def test_logs_merged_with_failures_highlighted(snap_compare, size):
    async def run_before(pilot):
        await settle(pilot)
        await pilot.press("l")
        await pilot.pause(0.4)

    assert snap_compare(make_app(), terminal_size=size, run_before=run_before)


def test_split_editor(snap_compare):
    async def run_before(pilot):
        await settle(pilot)
        await pilot.press("s", "right", "right", "down", "left")
        await pilot.pause()

    assert snap_compare(make_app(), terminal_size=(80, 24), run_before=run_before)


def test_worker_detail(snap_compare):
    async def run_before(pilot):
        await settle(pilot)
        await pilot.press("down", "enter")
        await pilot.pause()

    assert snap_compare(make_app(), terminal_size=(80, 24), run_before=run_before)


def test_help(snap_compare):
    async def run_before(pilot):
        await settle(pilot)
        await pilot.press("question_mark")
        await pilot.pause()

    assert snap_compare(make_app(), terminal_size=(80, 24), run_before=run_before)
