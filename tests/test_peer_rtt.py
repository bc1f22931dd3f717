"""A peer's round-trip spike, from the head's measurement to the console's timeline and RTT chart:
real head and peer processes; the peer is stopped (SIGSTOP) for a moment while a request's forward
waits on it."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import threading

import httpx
from consoles import until
from rpc_workers import complete, head, peer, running, wait_for

from hydra_console.app.config import Alerts, Profile, SupervisorSettings, WorkerSpec
from hydra_console.app.supervisor import Supervisor
from hydra_console.app.triage import status_incidents
from hydra_console.app.ui.app import HydraConsole
from hydra_console.contracts.status import Status

STALL_S = 0.8  # under the head's 1 s probe: a stall, not a lost peer


def stall_during_a_request(p, w) -> httpx.Response:
    """Stop peer `p` for STALL_S while a request to head `w` waits on it; the request's answer."""
    os.killpg(p.proc.pid, signal.SIGSTOP)
    resume = threading.Timer(STALL_S, lambda: os.killpg(p.proc.pid, signal.SIGCONT))
    try:
        result = {}
        t = threading.Thread(target=lambda: result.setdefault("r", complete(w, "the cat sat", 16)))
        t.start()  # its first forward waits for the stopped peer
        wait_for(lambda: any(s["state"] == "processing" for s in w.status()["slots"]), 30, "the request")
        resume.start()
        t.join(60)
    finally:
        resume.cancel()
        os.killpg(p.proc.pid, signal.SIGCONT)
    return result["r"]


def test_a_stalled_peer_is_an_rtt_spike_in_status_and_on_the_timeline(tiny_model, tmp_path):
    model = tiny_model("llama", n_layers=4, n_embd=64, n_ff=128)
    p = peer(model, tmp_path)
    with running(p), running(head(model, tmp_path, [p])) as w:
        assert complete(w, "warm up", 2).status_code == 200
        before = Status.from_json(w.status())
        assert before.peers[0].rtt_max_ms is not None and before.peers[0].rtt_max_ms < STALL_S * 1e3 / 2
        answer = stall_during_a_request(p, w)
        assert answer.status_code == 200, answer.text
        after = Status.from_json(w.status())
        peer_now = after.peers[0]
        assert peer_now.state == "up" and peer_now.rtt_max_ms >= STALL_S * 1e3 / 2  # the stall, minus the head's part
        assert peer_now.rtt_ms < peer_now.rtt_max_ms  # the last round trip was normal again: only the window shows it
        spikes = [i for i in status_incidents(before, after, 1.0, Alerts(rtt_ms=100.0)) if i.kind == "rtt-spike"]
        assert [i.subject for i in spikes] == [p.rpc_addr]
        metrics = httpx.get(f"{w.url}/metrics", timeout=10).text
        worst = re.search(rf'hydra_peer_rtt_max_seconds{{peer="{re.escape(p.rpc_addr)}"}} ([0-9.e-]+)', metrics)
        assert worst and float(worst.group(1)) >= STALL_S / 2


async def test_the_console_charts_a_stalled_peers_rtt_spike(tiny_model, tmp_path):
    model = tiny_model("llama", n_layers=4, n_embd=64, n_ff=128)
    p = peer(model, tmp_path)
    with running(p), running(head(model, tmp_path, [p])) as w:
        assert complete(w, "warm up", 2).status_code == 200
        profile = Profile(
            name="rtt",
            head=WorkerSpec(name="head", port=w.port, rpc_port=w.rpc_port),
            peers=[WorkerSpec(name="peer1", port=p.port, rpc_port=p.rpc_port)],
            supervisor=SupervisorSettings(poll_s=0.25),
            alerts=Alerts(rtt_ms=STALL_S * 1e3 / 2),
        )
        app = HydraConsole(Supervisor(profile, attach=True), load_model_shape=False)
        async with app.run_test(size=(120, 40)) as pilot:
            info = app.dashboard.query_one("#info")
            healthy = re.compile(r"\n {5}rtt [·▁-█]*▁ 0–400 ms · \d+s$")  # bars under the alert: its scale
            await until(pilot, lambda: healthy.search(str(info.render())))
            answer = await asyncio.to_thread(stall_during_a_request, p, w)  # the console polls meanwhile
            assert answer.status_code == 200, answer.text
            spike = re.compile(r"\n {5}rtt [·▁-█]*█[·▁-█]* 0–\d+ ms · \d+ spikes? ≥ 400 ms ⚠")
            await until(pilot, lambda: spike.search(str(info.render())))
            await pilot.press("i")
            assert "spike" in str(app.screen.query_one("#triage-rtt").render())
