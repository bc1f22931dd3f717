"""Layer split across real processes: head + 2 peers on loopback against a solo head.

Greedy output and logprobs must be identical to solo (hidden states cross the wire as raw
float32). Then the failure paths: a peer killed mid-decode (503 in OpenAI's shape, degraded
health, recovery when it returns), live re-split under a running request, peer readiness.
"""

from __future__ import annotations

import json
import socket
import subprocess
import threading

import httpx
import pytest
from rpc_workers import (
    Worker,
    assert_peer_kill_fails_request_fast,
    complete,
    engine_cli,
    free_ports,
    greedy,
    head,
    peer,
    wait_for,
)

from hydra_console.contracts.rpc import Op, Status
from hydra_console.contracts.status import READY_STAGE
from hydra_console.engine.rpc import wire
from hydra_console.engine.rpc.wire import SocketReader

PROMPTS = ["hello world", "the cat sat on", "abc abc abc"]
N_LAYERS = 4


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("gemma3", n_layers=N_LAYERS, n_embd=64, n_ff=128)


@pytest.fixture(scope="module")
def cluster(model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("split-logs")
    solo = head(model, logs)
    peers = [peer(model, logs), peer(model, logs)]
    # --peer-grace 0: the failure paths here are a lost peer's 503 at once (test_peer_restart.py: the pause)
    split = head(model, logs, peers, "--split", "2/1/1", "--peer-grace", "0")
    workers = [solo, *peers, split]
    try:
        for w in workers:
            w.wait_ready()
        yield {"solo": solo, "peers": peers, "head": split, "logs": logs}
    finally:
        for w in workers:
            w.stop()


def control(w, op: int, payload: bytes = b"") -> wire.ControlResponse:
    with socket.create_connection(("127.0.0.1", w.rpc_port), timeout=30) as s:
        s.sendall(wire.pack_control_request(op, payload))
        return wire.read_control_response(SocketReader(s), 1 << 20)


def test_split_greedy_output_is_identical_to_solo(cluster):
    for prompt in PROMPTS:
        assert greedy(cluster["head"], prompt) == greedy(cluster["solo"], prompt)


def test_status_reports_explicit_ranges_peers_and_pool(cluster):
    st = cluster["head"].status()
    assert [s["layers"] for s in st["stages"]] == [[0, 2], [2, 3], [3, 4]]
    assert [p["addr"] for p in st["peers"]] == [p.rpc_addr for p in cluster["peers"]]
    assert all(p["state"] == "up" and p["bytes_sent"] > 0 and p["bytes_recv"] > 0 for p in st["peers"])
    assert st["pool"]["size"] == 2 and st["pool"]["queue_max"] == 64
    peer_st = cluster["peers"][0].status()
    assert peer_st["role"] == "peer" and peer_st["stages"][0]["layers"] == [2, 3]
    metrics = httpx.get(f"{cluster['head'].url}/metrics", timeout=10).text
    assert f'hydra_peer_up{{peer="{cluster["peers"][0].rpc_addr}"}} 1.0' in metrics


def test_live_resplit_under_a_running_request(cluster):
    w = cluster["head"]
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("r", complete(w, "count with me", 120, timeout=120)))
    t.start()
    try:
        wait_for(lambda: any((s["n_decoded"] or 0) > 3 for s in w.status()["slots"]), 60, "decoding to start")
        resp = control(w, Op.CONFIGURE, json.dumps({"split": "1/2/1"}).encode())
        assert resp.status == Status.OK, resp.meta
        assert resp.meta["layers"] == [[0, 1], [1, 3], [3, 4]]
        assert resp.meta["rebuilt_tokens"] > 3  # the running request's KV was rebuilt, not dropped
    finally:
        t.join(timeout=120)
    r = result["r"]
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 120
    assert [s["layers"] for s in w.status()["stages"]] == [[0, 1], [1, 3], [3, 4]]
    assert cluster["peers"][1].status()["stages"][0]["layers"] == [3, 4]
    assert greedy(w, PROMPTS[0]) == greedy(cluster["solo"], PROMPTS[0])
    bad = control(w, Op.CONFIGURE, json.dumps({"split": "4/0/0"}).encode())
    assert bad.status == Status.BAD_REQUEST and "no layer" in bad.meta["error"]
    assert control(w, Op.CONFIGURE, json.dumps({"layers": [[0, 2], [2, 3], [3, 4]]}).encode()).status == Status.OK


def test_head_revalidates_when_a_peers_resident_set_changes(cluster, model):
    """Someone else re-assigns a peer (its epoch moves on): the head notices on its next FORWARD,
    re-attaches, rebuilds that peer's KV and the answer is still the solo one."""
    from hydra_console.contracts.rpc import Cmd
    from hydra_console.engine.gguf_file import GGUFFile
    from hydra_console.engine.rpc.compute import pack_hello
    from hydra_console.engine.rpc.resident import tensor_shapes

    w, p = cluster["head"], cluster["peers"][0]
    attaches = w.status()["peers"][0]["attaches"]
    g = GGUFFile(model)
    with socket.create_connection(("127.0.0.1", p.rpc_port), timeout=30) as s:
        r = SocketReader(s)
        for cmd, payload in [
            (Cmd.HELLO, pack_hello()),
            (Cmd.CHECK, json.dumps({"fingerprint": g.fingerprint, "shapes": tensor_shapes(g)}).encode()),
            (Cmd.LOAD_STAGE, json.dumps({"layers": [0, 1], "dtype": "float32", "n_slots": 1, "n_ctx": 8}).encode()),
        ]:
            s.sendall(wire.pack_compute_request(cmd, payload))
            reply = wire.read_compute_response(r, 1 << 20)
            assert cmd == Cmd.HELLO or reply[0] == 0, bytes(reply)
    assert greedy(w, PROMPTS[2]) == greedy(cluster["solo"], PROMPTS[2])
    assert w.status()["peers"][0]["attaches"] == attaches + 1
    assert p.status()["stages"][0]["layers"] == w.status()["stages"][1]["layers"]


def test_peer_killed_mid_decode_fails_fast_then_recovers(cluster):
    w, victim = cluster["head"], cluster["peers"][1]
    expected = greedy(w, PROMPTS[1])
    assert_peer_kill_fails_request_fast(w, victim, 200, 60)

    health = httpx.get(f"{w.url}/health", timeout=10)
    assert health.status_code == 503 and health.json()["status"] == "degraded" and not health.json()["serving"]
    assert complete(w, PROMPTS[1], 4).status_code == 503  # while it is down: refused at once, no hang

    victim.start()  # same ports: the head re-attaches within a poll or two
    victim.wait_ready()
    wait_for(lambda: httpx.get(f"{w.url}/health", timeout=10).json()["status"] == "ok", 30, "the head to re-attach")
    assert greedy(w, PROMPTS[1]) == expected
    peers = w.status()["peers"]
    assert peers[1]["state"] == "up" and peers[1]["attaches"] == 2


def test_frozen_peer_fails_the_request_instead_of_hanging(cluster):
    """SIGSTOP: the TCP connection stays open and silent; the head's probe notices."""
    import os
    import signal

    w, victim = cluster["head"], cluster["peers"][0]
    wait_for(lambda: httpx.get(f"{w.url}/health", timeout=10).json()["status"] == "ok", 30, "a healthy head")
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("r", complete(w, "freeze", 200, timeout=60)))
    t.start()
    wait_for(lambda: any((s["n_decoded"] or 0) > 3 for s in w.status()["slots"]), 60, "decoding to start")
    os.killpg(victim.proc.pid, signal.SIGSTOP)
    try:
        t.join(timeout=60)
        assert result["r"].status_code == 503 and "stopped answering" in result["r"].json()["error"]["message"]
    finally:
        os.killpg(victim.proc.pid, signal.SIGCONT)
    wait_for(lambda: httpx.get(f"{w.url}/health", timeout=10).json()["status"] == "ok", 30, "the head to re-attach")
    assert greedy(w, PROMPTS[0]) == greedy(cluster["solo"], PROMPTS[0])


def run_head_cli(model, *argv, timeout=120) -> subprocess.CompletedProcess:
    return engine_cli(
        "serve", "--model", str(model), "--device", "cpu", "--port", "0", "--rpc-port", "0", *argv, timeout=timeout
    )


def test_unreachable_peer_fails_clearly_after_the_wait(model):
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
    try:
        port = dead.getsockname()[1]
        done = run_head_cli(model, "--peer", f"127.0.0.1:{port}", "--peer-wait", "1")
    finally:
        dead.close()
    assert done.returncode == 2
    assert "not ready after 1 s" in done.stderr and "--fallback-solo" in done.stderr
    assert "Traceback" not in done.stderr


def test_fallback_solo_runs_every_layer_on_the_head(model, tmp_path):
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    try:
        w = head(
            model, tmp_path, (), "--peer", f"127.0.0.1:{dead.getsockname()[1]}", "--peer-wait", "1", "--fallback-solo"
        )
        try:
            w.wait_ready()
            st = w.status()
            assert [s["layers"] for s in st["stages"]] == [[0, N_LAYERS]] and st["peers"] == []
            assert complete(w, "hi", 4).status_code == 200
        finally:
            w.stop()
    finally:
        dead.close()


def test_peer_cli_reports_bad_input_without_a_traceback(tmp_path):
    done = engine_cli("peer", "--model", str(tmp_path / "missing.gguf"), "--port", "0", "--rpc-port", "0", timeout=60)
    assert done.returncode == 2 and "cannot open model file" in done.stderr and "Traceback" not in done.stderr


def test_a_peer_with_another_model_is_refused(model, tiny_model, tmp_path):
    other = tiny_model("gemma3", n_layers=N_LAYERS, n_embd=64, n_ff=256)  # the header (fingerprint) differs
    p = peer(other, tmp_path)
    try:
        p.wait_ready()
        done = run_head_cli(model, "--peer", p.rpc_addr, "--peer-wait", "10")
    finally:
        p.stop()
    assert done.returncode == 2 and "fingerprint mismatch" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_the_head_loads_and_warms_its_stage_while_its_peer_loads(model, cluster, tmp_path):
    """A peer's LOAD_STAGE (its weights, then its graphs' compile and capture on a GPU) runs beside
    the head's own load and warm-up: the head gets as far as its warmed graphs while its peer is not
    even up, is ready once the peer has loaded, and serves the split's text."""
    port, rpc = free_ports(2)
    split = head(model, tmp_path, (), "--peer", f"127.0.0.1:{rpc}", "--peer-wait", "120", "--split", "2/2")
    p = None
    try:

        def warmed() -> bool:
            try:
                return "graphs warmed" in split.status()["startup_s"]
            except httpx.HTTPError:  # not listening yet
                return False

        wait_for(warmed, 90, "the head's own stage and warm-up")
        assert split.status()["startup_stage"] < READY_STAGE
        p = Worker("peer", ["--model", str(model), "--device", "cpu"], tmp_path, port, rpc)
        split.wait_ready()
        phases = split.status()["startup_s"]
        assert phases["graphs warmed"] <= phases["peers loaded"] <= phases["ready"]
        for prompt in PROMPTS:
            assert greedy(split, prompt) == greedy(cluster["solo"], prompt)
    finally:
        for w in (split, p):
            if w is not None:
                w.stop()


def test_peers_on_this_host_are_told_from_others():
    """Whose memory the head counts beside its own before loading with them side by side."""
    from hydra_console.engine.workers.head_pipeline import _on_this_host

    assert _on_this_host("127.0.0.1:9000") and _on_this_host("localhost:9000") and _on_this_host("[::1]:9000")
    assert _on_this_host(f"{socket.gethostname()}:9000")
    assert not _on_this_host("192.0.2.7:9000")  # TEST-NET-1: no machine's interface


def test_default_model_split_matches_solo(default_model, tmp_path):
    """Once on the real Gemma 3 270M: head + 2 peers, greedy text and logprobs equal solo's."""
    solo = head(default_model, tmp_path, ctx=128)
    peers = [peer(default_model, tmp_path), peer(default_model, tmp_path)]
    split = head(default_model, tmp_path, peers, "--split", "6/6/6", ctx=128)
    workers = [solo, *peers, split]
    try:
        for w in workers:
            w.wait_ready(timeout=180)
        prompt = "The capital of France is"
        assert greedy(split, prompt, 8) == greedy(solo, prompt, 8)
    finally:
        for w in workers:
            w.stop()
