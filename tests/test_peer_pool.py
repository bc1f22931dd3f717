"""A peer's merged port runs the original system's bounded pool (2 workers, 64 queued, drop on
overflow) for every client but the head's session: real head and peer processes, a flood of real
connections, the console (Pilot, attached to them) showing the pool line and the drop incident."""

from __future__ import annotations

import socket

import httpx
import pytest
from consoles import until
from rpc_workers import greedy, head, peer, wait_for

from hydra_console.app.config import Profile, SupervisorSettings, WorkerSpec
from hydra_console.app.supervisor import Supervisor
from hydra_console.app.ui.app import HydraConsole
from hydra_console.contracts.rpc import Cmd
from hydra_console.engine.rpc import wire
from hydra_console.engine.rpc.compute import pack_hello
from hydra_console.engine.rpc.wire import SocketReader

PROMPTS = ["hello world", "the cat sat on"]
SIZE, QUEUE = 2, 64  # the peer's defaults: the original's


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    model = tiny_model("gemma3", n_layers=4, n_embd=64, n_ff=128)
    logs = tmp_path_factory.mktemp("pool-logs")
    solo, p = head(model, logs), peer(model, logs)
    split = head(model, logs, [p], "--split", "2/2", "--slot-save-path", str(logs))
    try:
        for w in (solo, p, split):
            w.wait_ready()
        yield {"solo": solo, "peer": p, "head": split, "baseline": [greedy(solo, t) for t in PROMPTS]}
    finally:
        for w in (solo, p, split):
            w.stop()


def pinging(port: int) -> socket.socket:
    """A client that is not the head's session: HELLO (answered at once, no pool worker), then a
    PING it does not wait for, so the connection asks the pool for a worker."""
    s = socket.create_connection(("127.0.0.1", port), timeout=60)
    s.sendall(wire.pack_compute_request(Cmd.HELLO, pack_hello()))
    wire.read_compute_response(SocketReader(s), 1 << 10)
    s.sendall(wire.pack_compute_request(Cmd.PING, b"x"))
    return s


def answered(s: socket.socket) -> bool:
    """The PING's reply arrived: a pool worker holds this connection."""
    return bytes(wire.read_compute_response(SocketReader(s), 1 << 10)) == b"\x00x"


def dropped(s: socket.socket) -> bool:
    """The PING's answer says the pool is full, then the connection closes."""
    reply = bytes(wire.read_compute_response(SocketReader(s), 1 << 10))
    return reply[0] == 1 and b"RPC pool is full" in reply and s.recv(1) == b""


def pool(w) -> dict:
    return w.status()["pool"]


def saves_a_slot(w) -> bool:
    """A slot saved through the split: the peer's part comes over a connection of the head's own
    (STATE_JOIN), beside its main session; behind a full pool it would wait for a worker."""
    r = httpx.post(f"{w.url}/v1/completions", json={"prompt": "keep this prompt", "max_tokens": 4}, timeout=60)
    assert r.status_code == 200, r.text
    saved = [
        httpx.post(f"{w.url}/slots/{i}", params={"action": "save"}, json={"filename": f"s{i}.bin"}, timeout=60)
        for i in (0, 1)
    ]
    return all(r.status_code == 200 for r in saved) and any(r.json()["n_saved"] > 0 for r in saved)


def metric(w, name: str) -> float:
    text = httpx.get(f"{w.url}/metrics", timeout=10).text
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


async def test_a_flood_fills_the_peers_pool_drops_the_overflow_and_the_split_decodes_on(cluster):
    h, p = cluster["head"], cluster["peer"]
    before = pool(p)
    assert (before["size"], before["queue_max"], before["busy"], before["queued"]) == (SIZE, QUEUE, 0, 0)
    assert before["compute"] >= 1  # the head's session, served beside the pool
    profile = Profile(
        name="pool",
        head=WorkerSpec(name="head", port=h.port, rpc_port=h.rpc_port),
        peers=[WorkerSpec(name="peer1", port=p.port, rpc_port=p.rpc_port)],
        supervisor=SupervisorSettings(poll_s=0.25),
    )
    sup = Supervisor(profile, attach=True)
    app = HydraConsole(sup, load_model_shape=False)
    flood: list[socket.socket] = []
    try:
        async with app.run_test(size=(120, 40)) as pilot:
            info = app.dashboard.query_one("#info")
            await until(pilot, lambda: f"pool 0/{SIZE} · 0 queued · 0 dropped" in str(info.render()), 60)

            flood += [pinging(p.rpc_port) for _ in range(SIZE)]
            assert all(answered(s) for s in flood)  # each holds a worker for its life
            wait_for(lambda: pool(p)["busy"] == SIZE, 30, "the pool's workers busy")
            flood += [pinging(p.rpc_port) for _ in range(QUEUE)]
            wait_for(lambda: pool(p)["queued"] == QUEUE, 30, "the queue to fill")
            await until(pilot, lambda: f"pool {SIZE}/{SIZE} · {QUEUE} queued · 0 dropped" in str(info.render()), 60)
            assert [greedy(h, t) for t in PROMPTS] == cluster["baseline"]  # the head's sessions never wait
            assert saves_a_slot(h)

            overflow = [pinging(p.rpc_port) for _ in range(5)]
            flood += overflow
            assert all(dropped(s) for s in overflow)  # answered and closed, never blocked on
            assert pool(p)["dropped"] == before["dropped"] + 5
            assert metric(p, "hydra_rpc_dropped_total") == before["dropped"] + 5
            assert metric(p, "hydra_rpc_pool_busy") == SIZE and metric(p, "hydra_rpc_pool_queued") == QUEUE
            await until(pilot, lambda: f"pool {SIZE}/{SIZE} · {QUEUE} queued · 5 dropped" in str(info.render()), 60)
            await until(
                pilot, lambda: any(i.kind == "pool-drop" and i.subject == "peer1" for i in app.incidents.since(0))
            )
            assert [greedy(h, t) for t in PROMPTS] == cluster["baseline"]

            flood[0].close()  # a worker frees: the first queued connection gets it
            assert answered(flood[SIZE])
            wait_for(lambda: pool(p)["queued"] == QUEUE - 1, 30, "the queue to move")
            await until(pilot, lambda: f"pool {SIZE}/{SIZE} · {QUEUE - 1} queued" in str(info.render()), 60)
    finally:
        for s in flood:
            s.close()
    wait_for(lambda: pool(p)["busy"] == 0 and pool(p)["queued"] == 0, 60, "the pool to empty")
    assert [greedy(h, t) for t in PROMPTS] == cluster["baseline"]
