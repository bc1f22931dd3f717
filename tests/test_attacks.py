"""Issue 13's attacks on the merged RPC port, against real head and peer processes on loopback:
each reproduces one way an attacker (or a flaky network) stopped, corrupted or starved a worker,
and asserts the fixed behaviour. Behaviour only: no timing thresholds."""

from __future__ import annotations

import json
import os
import socket
import struct
import threading
import time

import httpx
import psutil
import pytest
import torch
from rpc_workers import engine_cli, greedy, head, peer, wait_for

from hydra_console.contracts.rpc import (
    CAP_AUTH,
    CONTROL_MAGIC,
    FORWARD_OUT,
    KV_CLEAR,
    KV_SHIFT,
    MAX_CTX,
    PREAUTH_MAX_FRAME,
    Cmd,
    Op,
    StaleEpoch,
    Status,
)
from hydra_console.engine.gguf_file import GGUFFile
from hydra_console.engine.model import ModelConfig
from hydra_console.engine.rpc import wire
from hydra_console.engine.rpc.compute import ComputeServer, pack_hello
from hydra_console.engine.rpc.forward_frames import pack_forward
from hydra_console.engine.rpc.listener import RpcListener
from hydra_console.engine.rpc.resident import StageHost, tensor_shapes
from hydra_console.engine.rpc.wire import SocketReader

pytestmark = pytest.mark.integration

TOKEN = "attack-test-token"
PROMPT = "the cat sat on"
N_TOKENS = 24
MiB = 1 << 20


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("gemma3", n_layers=4, n_embd=64, n_ff=128)


@pytest.fixture(scope="module")
def ws(model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("attack-logs")
    open_peer = peer(model, logs)  # no token: loopback only, as before
    workers = {
        "peer": open_peer,
        "head": head(model, logs, [open_peer], "--split", "2/2"),
        "tok_peer": peer(model, logs, "--auth-token", TOKEN),
        "tok_head": head(model, logs, (), "--auth-token", TOKEN),
    }
    try:
        for w in workers.values():
            w.wait_ready()
        wait_for(lambda: workers["head"].status()["peers"][0]["state"] == "up", 60, "the peer to attach")
        workers["baseline"] = greedy(workers["head"], PROMPT, N_TOKENS)[0]
        yield workers
    finally:
        for w in workers.values():
            if hasattr(w, "stop"):
                w.stop()


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=30)


def compute(sock, cmd, payload=b"") -> bytes:
    sock.sendall(wire.pack_compute_request(cmd, payload))
    return bytes(wire.read_compute_response(SocketReader(sock), 16 * MiB))


def session(w, g) -> socket.socket:
    """A second compute session on a peer without a token: HELLO and CHECK pass (both public)."""
    s = connect(w.rpc_port)
    compute(s, Cmd.HELLO, pack_hello())
    assert (
        compute(s, Cmd.CHECK, json.dumps({"fingerprint": g.fingerprint, "shapes": tensor_shapes(g)}).encode())[0] == 0
    )
    return s


def hello_with_nonce(sock) -> bytes:
    """HELLO offering authentication, as a client with a token opens: the worker's challenge."""
    compute(sock, Cmd.HELLO, pack_hello(CAP_AUTH, nonce=os.urandom(16)))
    return bytes(wire.read_compute_response(SocketReader(sock), 64))


def unanswered_close(sock, timeout=30.0) -> bytes:
    """What the server still sent before closing (b"" = closed without an answer)."""
    sock.settimeout(timeout)
    got = b""
    try:
        while chunk := sock.recv(4096):
            got += chunk
    except ConnectionResetError:
        pass
    return got


def rss(w) -> int:
    return psutil.Process(w.proc.pid).memory_info().rss


def threads(w) -> int:
    return psutil.Process(w.proc.pid).num_threads()


def peer_epoch(w) -> int:
    return w.status()["resident"]["epoch"]


# --- 1: LOAD_STAGE cannot take the stage away -------------------------------------------------------


def test_oversized_load_stage_is_refused_and_the_stage_stays(ws, model):
    g, w = GGUFFile(model), ws["peer"]
    epoch = peer_epoch(w)
    with session(w, g) as s:
        for n_slots, n_ctx in ((1, 1 << 40), (1024, MAX_CTX)):  # over the bound; within it but over free memory
            req = {"layers": [2, 4], "dtype": "float32", "n_slots": n_slots, "n_ctx": n_ctx}
            reply = compute(s, Cmd.LOAD_STAGE, json.dumps(req).encode())
            # the bound on n_ctx, else the fit check before loading (contracts/fit.py: "needs … card has …")
            assert reply[0] == 1 and (b"n_ctx 1.." in reply or b"card has" in reply), reply
        for extra, why in (
            ({"max_run": 1 << 20}, b"max_run must be"),
            ({"kv_types": ["q8_0"]}, b"kv_types must be"),
            ({"kv_types": ["q8_0", "nope"]}, b"kv_types must be"),
        ):
            req = {"layers": [2, 4], "dtype": "float32", "n_slots": 1, "n_ctx": 8, **extra}
            reply = compute(s, Cmd.LOAD_STAGE, json.dumps(req).encode())
            assert reply[0] == 1 and why in reply, reply
    assert peer_epoch(w) == epoch and w.status()["stages"][0]["state"] == "ok"
    assert greedy(ws["head"], PROMPT, N_TOKENS)[0] == ws["baseline"]
    assert peer_epoch(w) == epoch  # the head never had to re-attach


# --- 2: another session cannot clear or run the head's slots -----------------------------------------


def test_second_session_cannot_clear_or_forward_into_the_heads_slots(ws, model):
    g, w = GGUFFile(model), ws["peer"]
    n_embd = ModelConfig.from_gguf(g).n_embd
    replies, stop, crashed = [], threading.Event(), []

    def attack():
        try:
            run_attack()
        except Exception as e:  # the thread's own failure fails the test (else only a warning)
            crashed.append(e)

    def run_attack():
        with session(w, g) as s:
            for key in (b"\0" * 16, b"", os.urandom(64)):  # guessing the head's state_key takes nothing over
                replies.append(compute(s, Cmd.STATE_JOIN, key))
            while not stop.is_set():
                replies.append(compute(s, Cmd.KV_CLEAR, KV_CLEAR.pack(-1)))
                replies.append(compute(s, Cmd.KV_SHIFT, KV_SHIFT.pack(0, 1, 2, 4)))
                epoch = peer_epoch(w)
                h = torch.randn(2, n_embd)
                parts = pack_forward(epoch, h, torch.tensor([0, 1]), torch.tensor([0, 0]))
                frame = b"".join(bytes(memoryview(p).cast("B")) for p in parts)
                replies.extend([compute(s, Cmd.FORWARD, frame), compute(s, Cmd.FORWARD_ACK, frame)])
                out = frame + FORWARD_OUT.pack(1, 0, 0) + struct.pack("<i", 1)  # logit row 1
                replies.append(compute(s, Cmd.FORWARD_OUT, out))
                replies.append(compute(s, Cmd.DRAFT, b'{"released": [0, 1]}'))
                time.sleep(0.02)

    t = threading.Thread(target=attack)
    t.start()
    try:
        wait_for(lambda: len(replies) >= 9 or crashed, 30, "the attack to start")
        text = greedy(ws["head"], PROMPT, N_TOKENS)[0]
    finally:
        stop.set()
        t.join(30)
    assert not crashed, crashed
    assert text == ws["baseline"]
    joins, others = replies[:3], replies[3:]
    assert all(r[0] == 1 and b"STATE_JOIN refused" in r for r in joins), joins
    assert others and all(r[0] == 1 and b"another session" in r for r in others), others[:2]


# --- 3: nothing large is read before AUTH ------------------------------------------------------------


def test_huge_preauth_frames_close_the_connection_without_allocating(ws):
    huge = 512 * MiB
    for w in (ws["tok_peer"], ws["tok_head"]):
        before = rss(w)
        for _ in range(4):
            with connect(w.rpc_port) as s:  # a first frame announcing 512 MiB
                s.sendall(struct.pack("<BQ", Cmd.HELLO, huge) + b"x" * 4096)
                assert unanswered_close(s) == b""
            with connect(w.rpc_port) as s:  # AUTH of 511 MiB after a valid HELLO
                assert len(hello_with_nonce(s)) > 48  # the worker's nonce, proof and role
                s.sendall(struct.pack("<BQ", Cmd.AUTH, huge - MiB))
                assert unanswered_close(s) == b""
        if w is ws["tok_head"]:
            for op in (Op.INFO, Op.AUTH):  # control frames with a 512 MiB payload
                with connect(w.rpc_port) as s:
                    s.sendall(struct.pack("<HBBHQH", CONTROL_MAGIC, op, 0, 0, huge, 0))
                    assert unanswered_close(s) == b""
        assert rss(w) - before < 64 * MiB  # the frames were never allocated (a 512 MiB buffer would show)


def test_unknown_and_state_changing_ops_before_auth_close_unanswered(ws):
    w = ws["tok_head"]
    for op in (0x7A, Op.INFO, Op.CONFIGURE, Op.DECODE, Op.STATE_GET, Op.STATE_PUT, Op.STATE_META, Op.PREFILL, Op.PROBE):
        with connect(w.rpc_port) as s:
            s.sendall(wire.pack_control_request(op, b"{}"))
            assert unanswered_close(s) == b""
    with connect(w.rpc_port) as s:  # an AUTH frame over the pre-auth cap
        s.sendall(wire.pack_control_request(Op.AUTH, b"x" * PREAUTH_MAX_FRAME))
        assert unanswered_close(s) == b""
    for cmd in (
        Cmd.LOAD_STAGE,
        Cmd.KV_CLEAR,
        Cmd.KV_SHIFT,
        Cmd.STATS,
        Cmd.STATE_META,
        Cmd.STATE_GET,
        Cmd.STATE_PUT,
        Cmd.STATE_JOIN,
        Cmd.PROBE,
        Cmd.FORWARD_ACK,
        Cmd.FORWARD_OUT,
        Cmd.DRAFT,
        99,
    ):
        with connect(ws["tok_peer"].rpc_port) as s:
            hello_with_nonce(s)
            assert compute(s, Cmd.PING, b"ok") == b"\x00ok"  # PING is allowed
            s.sendall(wire.pack_compute_request(cmd, b"{}"))
            assert unanswered_close(s) == b""


# --- 4, 5: silent sockets cost no thread and starve nobody --------------------------------------------


def test_silent_sockets_hold_no_peer_thread_and_the_head_still_generates(ws):
    w = ws["peer"]
    before_threads, before_rss = threads(w), rss(w)
    accepted = w.status()["pool"]["accepted"]
    silent = [connect(w.rpc_port) for _ in range(200)]
    try:
        wait_for(lambda: w.status()["pool"]["accepted"] >= accepted + 200, 60, "the peer to accept every socket")
        assert threads(w) <= before_threads + 4  # no thread per socket (HTTP probes may add a couple)
        assert rss(w) - before_rss < 50 * MiB
        assert greedy(ws["head"], PROMPT, N_TOKENS)[0] == ws["baseline"]
    finally:
        for s in silent:
            s.close()


def test_silent_sockets_on_the_heads_port_do_not_block_info(ws):
    w = ws["head"]
    silent = [connect(w.rpc_port) for _ in range(80)]  # more than pool + queue (2 + 64)
    try:
        wait_for(lambda: w.status()["pool"]["accepted"] >= 80, 60, "the head to accept the sockets")
        with connect(w.rpc_port) as s:
            s.sendall(wire.pack_control_request(Op.INFO))
            r = wire.read_control_response(SocketReader(s), 16 * MiB)
        assert r.status == Status.OK and r.meta["mode"] == "head"
        assert w.status()["pool"]["busy"] <= 1  # silent sockets hold no pool worker
    finally:
        for s in silent:
            s.close()


# --- deadlines and caps, in process with short deadlines -----------------------------------------------


@pytest.fixture
def short_port(model):
    """A peer-mode port with a 0.5 s handshake deadline and a 1 s idle limit, at most 4 connections per IP."""
    g = GGUFFile(model)
    server = ComputeServer(StageHost(g, ModelConfig.from_gguf(g), "cpu"), idle_s=1.0)
    lst = RpcListener(
        "127.0.0.1", 0, mode="peer", compute=server, header_s=0.5, max_per_ip=4, cap_exempt=frozenset()
    ).start()
    yield lst
    lst.stop()


def test_deadlines_close_silent_trickling_and_idle_connections(short_port):
    port = short_port.bound_port
    with connect(port) as silent, connect(port) as trickle, connect(port) as idle:
        compute(idle, Cmd.HELLO, pack_hello())  # handshake done, then nothing
        frame = wire.pack_compute_request(Cmd.HELLO, pack_hello())
        try:
            for b in frame:  # a byte at a time, slower than the whole frame's deadline
                trickle.sendall(bytes([b]))
                time.sleep(0.2)
        except OSError:
            pass  # closed under us: that is the point
        for s in (silent, trickle, idle):
            assert unanswered_close(s) == b""
    with connect(port) as s:  # the port serves on
        compute(s, Cmd.HELLO, pack_hello())
        assert compute(s, Cmd.PING, b"hi") == b"\x00hi"


def test_per_ip_cap_closes_connections_over_it(short_port):
    port = short_port.bound_port
    held = [connect(port) for _ in range(4)]
    try:
        for s in held:
            compute(s, Cmd.HELLO, pack_hello())
        with connect(port) as over:
            assert unanswered_close(over) == b""
        assert short_port.stats().dropped >= 1
    finally:
        for s in held:
            s.close()


# --- 5 (no stage), 2 (exposure), 7 (token file) ----------------------------------------------------------


def test_a_peer_without_stage_is_degraded_and_reads_as_stale(ws, model):
    h = httpx.get(f"{ws['tok_peer'].url}/health", timeout=10).json()
    assert h["status"] == "degraded"  # no head has loaded a stage on it
    assert ws["tok_peer"].status()["stages"][0]["state"] == "idle"
    g = GGUFFile(model)
    host = StageHost(g, ModelConfig.from_gguf(g), "cpu")
    with pytest.raises(StaleEpoch, match="no stage"):  # the head re-attaches, which loads one
        host.forward(1, torch.zeros(1, host.cfg.n_embd), torch.tensor([0]), torch.tensor([0]))


def test_peer_refuses_a_public_bind_without_token_unless_insecure(model):
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_TOKEN"}
    r = engine_cli("peer", "--model", str(model), "--rpc-host", "0.0.0.0", "--port", "1", env=env, timeout=120)
    assert r.returncode == 2 and "--insecure" in r.stderr


def test_token_file_must_be_private(tmp_path):
    from hydra_console.engine.cli_config import read_token_file
    from hydra_console.engine.errors import UserError

    f = tmp_path / "token"
    f.write_text("s3cret\n")
    f.chmod(0o644)
    with pytest.raises(UserError, match="group or others"):
        read_token_file(str(f))
    f.chmod(0o600)
    assert read_token_file(str(f)) == "s3cret"
