"""The merged RPC port on real worker processes, driven with raw sockets: dispatch, both
protocols' refusals, limits, the bounded pool, peer mode, and token auth."""

from __future__ import annotations

import json
import socket
import struct
import time

import httpx
import pytest
from rpc_workers import head, peer, wait_for

from hydra_console.contracts.auth import AuthError, ClientHandshake
from hydra_console.contracts.rpc import (
    CAP_AUTH,
    CAP_FORWARD,
    CAP_IPC,
    CONTROL_MAGIC,
    FORWARD_HEADER,
    HEADER_DEADLINE_S,
    HELLO,
    VERSION,
    Cmd,
    Op,
    Status,
)
from hydra_console.engine.gguf_file import GGUFFile
from hydra_console.engine.rpc import wire
from hydra_console.engine.rpc.compute import pack_hello
from hydra_console.engine.rpc.resident import tensor_shapes
from hydra_console.engine.rpc.wire import SocketReader

MAX_FRAME = 65536
TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def workers(tiny_model, tmp_path_factory):
    model = tiny_model("gemma3", n_layers=3)
    logs = tmp_path_factory.mktemp("rpc-port-logs")
    ws = {
        "head": head(model, logs, (), "--rpc-pool-size", "2", "--rpc-queue", "2", "--max-frame", str(MAX_FRAME)),
        "peer": peer(model, logs),
        "auth": head(model, logs, (), "--auth-token", TOKEN),
    }
    try:
        for w in ws.values():
            w.wait_ready()
        yield ws
    finally:
        for w in ws.values():
            w.stop()


def connect(w, port=None) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port or w.rpc_port), timeout=10)
    return s


def control(sock, op, payload=b"", key=b""):
    sock.sendall(wire.pack_control_request(op, payload, key=key))
    return wire.read_control_response(SocketReader(sock), 1 << 20)


def compute(sock, cmd, payload=b""):
    sock.sendall(wire.pack_compute_request(cmd, payload))
    return bytes(wire.read_compute_response(SocketReader(sock), 1 << 20))


def closed(sock, timeout=10.0) -> bool:
    """True once the server has closed its side (EOF or reset), reading whatever was left."""
    sock.settimeout(timeout)
    try:
        while sock.recv(4096):
            pass
        return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def test_first_byte_dispatches_to_compute_or_control(workers):
    with connect(workers["head"]) as s:
        reply = compute(s, Cmd.HELLO, pack_hello())
        assert HELLO.unpack_from(reply)[:3] == VERSION
        assert compute(s, Cmd.PING, b"abc") == b"\x00abc"
    with connect(workers["head"]) as s:
        info = control(s, Op.INFO)
        assert info.status == Status.OK
        assert info.meta["engine"] == "hydra" and info.meta["mode"] == "head"
        assert info.meta["layer_split"] == [[0, 3]]


def test_bad_magic_closes_only_that_connection(workers):
    with connect(workers["head"]) as s:
        s.sendall(struct.pack("<HBBHQH", 0xBEEF, Op.INFO, 0, 0, 0, 0))
        assert closed(s)
    with connect(workers["head"]) as s:
        assert control(s, Op.INFO).status == Status.OK


def test_upstream_llama_cpp_hello_gets_a_clean_refusal(workers):
    # ggml-rpc's client: cmd 14 with no payload, expects a 3-byte version reply.
    with connect(workers["head"]) as s:
        assert compute(s, Cmd.HELLO) == bytes(VERSION)
        assert closed(s)
    # A client sending its version (3.6.0, caps 0): refused with our version and a message, then closed.
    with connect(workers["peer"]) as s:
        reply = compute(s, Cmd.HELLO, struct.pack("<BBBBI", 3, 6, 0, 0, 0))
        assert HELLO.unpack_from(reply)[:3] == VERSION
        assert b"refuses client version 3.6.0" in reply[HELLO.size :]
        assert closed(s)


def test_truncated_frames_close_the_connection(workers):
    with connect(workers["head"]) as s:
        compute(s, Cmd.HELLO, pack_hello())
        s.sendall(struct.pack("<BQ", Cmd.PING, 100) + b"x" * 10)
        s.shutdown(socket.SHUT_WR)
        assert closed(s)
    with connect(workers["head"]) as s:
        s.sendall(wire.pack_control_request(Op.CONFIGURE, b"{}")[:12])
        s.shutdown(socket.SHUT_WR)
        assert closed(s)
    with connect(workers["head"]) as s:  # the listener is unharmed
        assert control(s, Op.INFO).status == Status.OK


def test_oversized_frames_are_refused_without_reading_them(workers):
    with connect(workers["head"]) as s:
        compute(s, Cmd.HELLO, pack_hello())
        s.sendall(struct.pack("<BQ", Cmd.PING, MAX_FRAME + 1))
        assert closed(s)
    with connect(workers["head"]) as s:
        s.sendall(struct.pack("<HBBHQH", CONTROL_MAGIC, Op.CONFIGURE, 0, 0, 1 << 40, 0))
        resp = wire.read_control_response(SocketReader(s), 1 << 20)
        assert resp.status == Status.BAD_REQUEST and "limit" in resp.meta["error"]
        assert closed(s)


def test_unknown_op_bad_key_and_unbuilt_ops_keep_the_connection(workers):
    with connect(workers["head"]) as s:
        r = control(s, 0x7A, b"z" * 200_000)  # unknown op: drained in 64 KiB chunks, past the frame limit
        assert r.status == Status.ERROR and "unknown op" in r.meta["error"]
        assert control(s, Op.STATE_META, key=b"slot-one").status == Status.ERROR
        assert control(s, Op.STATE_META, key=b"99").status == Status.NOT_FOUND
        meta = control(s, Op.STATE_META, key=b"1")
        assert meta.status == Status.OK and meta.meta["slot"] == 1
        assert control(s, Op.DECODE, b"\x00" * 8, key=b"0").status == Status.NOT_IMPLEMENTED
        assert control(s, Op.SET_EXPERT_MODE, b"bogus").status == Status.BAD_REQUEST
        r = control(s, Op.SET_EXPERT_MODE, b"combined")
        assert r.status == Status.OK
        assert control(s, Op.INFO).meta["expert_mode"] == "combined"
        assert control(s, Op.CONFIGURE, b"not json").status == Status.BAD_REQUEST
        assert control(s, Op.CONFIGURE, json.dumps({"split": "1/2"}).encode()).status == Status.BAD_REQUEST


def test_full_queue_drops_new_connections_and_health_still_answers(workers):
    w = workers["head"]
    # A silent socket holds no worker; a request whose payload never completes holds one until its
    # frame deadline (HEADER_DEADLINE_S): 2 workers held, 2 queued, 3 over. A snapshot read after that
    # deadline (a loaded machine: the held workers let go) tells nothing, so the flood is sent again.
    for _ in range(3):
        before = w.status()["pool"]
        sent = time.monotonic()  # the held connections' deadlines run from their accept
        idle = [connect(w) for _ in range(2 + 2 + 3)]
        for s in idle:
            s.sendall(wire.pack_control_request(Op.CONFIGURE, b"x" * 100)[:20])
        try:
            while time.monotonic() < sent + HEADER_DEADLINE_S:
                pool = w.status()["pool"]
                dropped = pool["dropped"] - before["dropped"]
                # settled: every connection counted, both workers holding theirs (a worker that has
                # not taken its connection from the FIFO yet leaves it counted as queued)
                if pool["busy"] + pool["queued"] + dropped == len(idle) and pool["busy"] == pool["size"]:
                    break
                time.sleep(0.1)
            in_time = time.monotonic() < sent + HEADER_DEADLINE_S
            if in_time:
                # Each connection holds a worker, waits in the FIFO, or was dropped (the accept loop may
                # outrun the idle workers' first get(), so more than the 3 surplus can be dropped).
                assert pool["busy"] + pool["queued"] + dropped == len(idle)
                assert pool["busy"] == 2 and pool["queued"] <= 2 and dropped >= 3
                assert pool["size"] == 2 and pool["queue_max"] == 2
                assert pool["accepted"] - before["accepted"] >= len(idle)
                assert httpx.get(f"{w.url}/health", timeout=5).status_code == 200
                metrics = httpx.get(f"{w.url}/metrics", timeout=5).text
                assert "hydra_rpc_dropped_total" in metrics
        finally:
            for s in idle:
                s.close()
        # Workers come back once the idle connections go: each notices its peer's close in its own time.
        wait_for(lambda: (p := w.status()["pool"])["busy"] + p["queued"] == 0, 30, "the pool's workers back")
        if in_time:
            break
    assert in_time, f"no snapshot of the flooded pool within the {HEADER_DEADLINE_S} s frame deadline in 3 tries"
    with connect(w) as s:
        assert control(s, Op.INFO).status == Status.OK


def test_peer_mode_has_no_peek_and_the_originals_pool(workers):
    w = workers["peer"]
    with connect(w) as s:  # a control frame on a peer goes straight into the compute protocol
        reply = control_raw_reply(s, wire.pack_control_request(Op.INFO))
        assert reply[0] == 1 and b"first command must be HELLO" in reply
        assert closed(s)
    pool = w.status()["pool"]
    assert pool["size"] == 2 and pool["queue_max"] == 64 and pool["accepted"] >= 1
    many = [connect(w) for _ in range(8)]  # handshakes take no pool worker: the selector answers them
    try:
        for s in many:
            assert HELLO.unpack_from(compute(s, Cmd.HELLO, pack_hello()))[:3] == VERSION
    finally:
        for s in many:
            s.close()


def test_cuda_ipc_commands_refused_cleanly_by_a_cpu_peer(workers, tiny_model):
    """IPC_OPEN on a CPU peer is refused with the reason (the head then sends hidden states in the
    frames); FORWARD_IPC without a channel is refused; the connection serves on after both."""
    with connect(workers["peer"]) as s:
        caps = HELLO.unpack_from(compute(s, Cmd.HELLO, pack_hello()))[4]
        assert not caps & CAP_IPC and caps & CAP_FORWARD
        reply = compute(s, Cmd.IPC_OPEN, json.dumps({"uuid": "GPU-x", "rows": 8}).encode())
        assert reply[0] == 1 and b"computes on cpu: no CUDA IPC" in reply
        header = FORWARD_HEADER.pack(0, 1, 64, 0) + struct.pack("<ii", 0, 0)
        reply = compute(s, Cmd.FORWARD_IPC, header)
        assert reply[0] == 1 and b"CHECK" in reply
        g = GGUFFile(tiny_model("gemma3", n_layers=3))
        check = {"fingerprint": g.fingerprint, "shapes": tensor_shapes(g)}
        assert compute(s, Cmd.CHECK, json.dumps(check).encode())[0] == 0
        reply = compute(s, Cmd.FORWARD_IPC, header)
        assert reply[0] == 1 and b"needs an open CUDA IPC channel" in reply
        assert compute(s, Cmd.PING, b"still here") == b"\x00still here"


def control_raw_reply(sock, frame: bytes) -> bytes:
    sock.sendall(frame)
    return bytes(wire.read_compute_response(SocketReader(sock), 1 << 20))


def compute_login(s, token: str) -> bytes:
    """HELLO with CAP_AUTH and our nonce, the head's proof checked, ours sent: AUTH's reply."""
    hs = ClientHandshake(token, "compute", ("head",))
    _, _, _, _, caps = HELLO.unpack_from(compute(s, Cmd.HELLO, pack_hello(CAP_AUTH, nonce=hs.nonce)))
    assert caps & CAP_AUTH
    challenge = bytes(wire.read_compute_response(SocketReader(s), 64))
    try:
        proof = hs.answer(challenge[:16], challenge[48:].decode(), challenge[16:48])
    except AuthError:
        proof = bytes(32)  # the wrong token: we cannot even check the worker's proof
    return compute(s, Cmd.AUTH, proof)


def test_auth_token_guards_both_protocols(workers):
    w = workers["auth"]
    with connect(w) as s:
        hs = ClientHandshake(TOKEN, "compute", ("head",))
        compute(s, Cmd.HELLO, pack_hello(CAP_AUTH, nonce=hs.nonce))
        wire.read_compute_response(SocketReader(s), 64)
        assert compute(s, Cmd.PING, b"hi") == b"\x00hi"  # PING is allowed before the proof
        s.sendall(wire.pack_compute_request(Cmd.STATS))  # nothing else: closed, unanswered
        assert closed(s)
    with connect(w) as s:  # a client offering no authentication gets HELLO (to say why), then the door
        _, _, _, _, caps = HELLO.unpack_from(compute(s, Cmd.HELLO, pack_hello()))
        assert caps & CAP_AUTH and closed(s)
    with connect(w) as s:
        assert compute_login(s, "wrong")[0] == 1
        assert closed(s)
    time.sleep(0.3)  # the failure above holds this address's next connection that long
    with connect(w) as s:
        assert compute_login(s, TOKEN) == b"\x00"
        assert compute(s, Cmd.PING, b"hi") == b"\x00hi"
    with connect(w) as s:
        s.sendall(wire.pack_control_request(Op.INFO))  # before AUTH: closed, unanswered
        assert closed(s)
    with connect(w) as s:
        hs = ClientHandshake(TOKEN, "control", ("head",))
        challenge = control(s, Op.AUTH, hs.nonce)
        assert challenge.status == Status.OK and challenge.meta["role"] == "head"
        proof = hs.answer(
            bytes.fromhex(challenge.meta["nonce"]), challenge.meta["role"], bytes.fromhex(challenge.meta["proof"])
        )
        assert control(s, Op.AUTH, proof).status == Status.OK
        info = control(s, Op.INFO)
        assert info.status == Status.OK and info.meta["auth"] is True
    with connect(w) as s:  # the first AUTH's old form (empty: "send me a nonce") is refused
        assert control(s, Op.AUTH).status == Status.ERROR and closed(s)


def test_failed_proofs_slow_their_address_are_logged_and_counted(workers):
    w = workers["auth"]
    before = _metric(w, "hydra_rpc_auth_failures_total")
    waits = []
    for _ in range(4):
        t0 = time.monotonic()
        with connect(w) as s:
            assert compute_login(s, "guess")[0] == 1
        waits.append(time.monotonic() - t0)
    assert _metric(w, "hydra_rpc_auth_failures_total") == before + 4
    assert waits[-1] >= 0.5  # 0.25 s doubling: the fourth guess waited for at least the third's 1 s less scan slack
    assert "RPC authentication from 127.0.0.1 failed" in w.log()
    time.sleep(2.1)
    with connect(w) as s:  # the honest client gets in once the wait has passed, and clears the address
        assert compute_login(s, TOKEN) == b"\x00"


def _metric(w, name: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{w.port}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " "))


# --- in-process pieces on real sockets ------------------------------------------------------------


def test_listener_lifecycle_stop_wakes_accept():
    from hydra_console.engine.rpc.listener import RpcListener

    seen = []

    class Seen:  # a server whose sessions need no handshake and serve by recording
        header, idle_s = 9, 60.0
        open = staticmethod(lambda: {"authed": True})
        serve = staticmethod(lambda conn, reader, session: seen.append(bytes(reader.read_exact(9))))

    lst = RpcListener("127.0.0.1", 0, mode="head", compute=Seen, control=None, pool_size=1, queue_max=1)
    assert not lst.is_running()
    lst.start()
    try:
        assert lst.is_running() and lst.bound_port > 0
        with socket.create_connection(("127.0.0.1", lst.bound_port), timeout=5) as s:
            s.sendall(b"\x0e" + bytes(8))
            wait = time.monotonic() + 5
            while not seen and time.monotonic() < wait:
                time.sleep(0.01)
        assert seen == [b"\x0e" + bytes(8)]  # the 0x0E first byte went to the compute server
    finally:
        lst.stop()  # returns although accept() was blocked
    assert not lst.is_running()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", lst.bound_port), timeout=2).close()


@pytest.fixture
def token_peer(tiny_model, monkeypatch):
    """An in-process peer-mode port requiring TOKEN, serving a StageHost over a tiny model. Its
    client runs in this process too, so the server's reflection check (a client nonce this process
    issued) is off here; tests/test_mutual_auth.py covers it between processes."""
    monkeypatch.setattr("hydra_console.contracts.auth._issued_here", lambda nonce: False)
    from hydra_console.engine.gguf_file import GGUFFile
    from hydra_console.engine.model import ModelConfig
    from hydra_console.engine.rpc.compute import ComputeServer
    from hydra_console.engine.rpc.listener import RpcListener
    from hydra_console.engine.rpc.resident import StageHost

    g = GGUFFile(tiny_model("gemma3", n_layers=3))
    host = StageHost(g, ModelConfig.from_gguf(g), "cpu")
    lst = RpcListener("127.0.0.1", 0, mode="peer", compute=ComputeServer(host, auth_token=TOKEN)).start()
    yield g, host, lst
    lst.stop()


def test_remote_stage_proves_the_token_and_follows_epochs(token_peer):
    import torch

    from hydra_console.contracts.rpc import StaleEpoch
    from hydra_console.engine.rpc.client import PeerMismatch, RemoteStage

    g, host, lst = token_peer
    addr = f"127.0.0.1:{lst.bound_port}"
    make = lambda token: RemoteStage(addr, (1, 3), g=g, dtype=torch.float32, n_slots=2, n_ctx=32, auth_token=token)  # noqa: E731
    with pytest.raises(PeerMismatch, match="requires a token"):
        make(None).attach()
    with pytest.raises(PeerMismatch, match="failed to authenticate"):
        make("wrong").attach()
    remote = make(TOKEN)
    remote.attach()
    assert remote.state == "up" and host.layers == (1, 3) and remote.epoch == host.epoch
    h = torch.randn(3, g.get("gemma3.embedding_length"))
    out = remote.run_layers(h, torch.tensor([0, 0, 0]), torch.tensor([0, 1, 2]))
    assert out.shape == h.shape and out.dtype == h.dtype and not torch.equal(out, h)
    other = make(TOKEN)
    other.attach()  # another head re-assigns the resident set: the epoch moves on
    with pytest.raises(StaleEpoch):
        remote.run_layers(h, torch.tensor([1, 1, 1]), torch.tensor([0, 1, 2]))
    remote.attach()  # re-validate
    assert remote.run_layers(h, torch.tensor([1, 1, 1]), torch.tensor([0, 1, 2])).shape == h.shape
    assert remote.status().bytes_sent > 2 * h.numel() * 4 and remote.rtt_ms is not None
    remote.close()
    other.close()


def test_work_run_while_a_peer_computes_keeps_the_connection_in_step(token_peer):
    """`run_layers(meanwhile=…)` runs the caller's host work between the frame and the reply; what it
    raises comes out after the reply is read, so the next request reads its own reply, not that one."""
    import torch

    from hydra_console.engine.rpc.client import RemoteStage

    g, host, lst = token_peer
    remote = RemoteStage(
        f"127.0.0.1:{lst.bound_port}", (1, 3), g=g, dtype=torch.float32, n_slots=2, n_ctx=32, auth_token=TOKEN
    )
    remote.attach()
    h, other = torch.randn(2, 2, g.get("gemma3.embedding_length"))
    slots, positions = torch.tensor([0, 0]), torch.tensor([0, 1])
    calls = []
    want = remote.run_layers(h, slots, positions, meanwhile=lambda: calls.append(1))
    assert calls == [1]

    def fails():
        raise RuntimeError("the caller's own bug")

    with pytest.raises(RuntimeError, match="own bug"):
        remote.run_layers(other, slots, positions, meanwhile=fails)
    assert remote.state == "up"  # the caller's error is not the peer's
    with pytest.raises(RuntimeError, match="re-entered"):  # calling back into the peer: an error, not a deadlock
        remote.run_layers(other, slots, positions, meanwhile=lambda: remote.kv_clear(0))
    # Its own reply (the same positions rewritten, the same output), not the one for `other`.
    assert torch.equal(remote.run_layers(h, slots, positions), want)
    remote.close()
