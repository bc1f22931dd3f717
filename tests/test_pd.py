"""Prefill/decode disaggregation and the state ops, with real workers on loopback: a decode head
(solo, or split with a peer) sends long prompts to a `serve --role prefill` worker, pulls their
state (PREFILL), places each stage's layers (peers through STATE_PUT) and decodes: greedy output
equals the head's own prefill, token for token; every failure falls back to a local prefill and
is counted; bad states are refused and leave the slot as it was."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time

import httpx
import psutil
import pytest
import torch
from rpc_workers import Worker, complete, free_ports, greedy, head, peer, running, wait_for

from hydra_console.contracts.rpc import COMPUTE_HEADER, Cmd, Op, Status
from hydra_console.contracts.slot_state import SlotHeader
from hydra_console.engine.gguf_file import GGUFFile
from hydra_console.engine.model import ModelConfig
from hydra_console.engine.rpc.client import PeerError, RemoteStage
from hydra_console.engine.rpc.wire import SocketReader, pack_control_request, read_control_response

LONG = "the quick brown fox jumps over the lazy dog and keeps running far away " * 3
SHAPE = {"n_layers": 4}


def prefill_worker(model, log_dir, *extra) -> Worker:
    port, rpc = free_ports(2)
    argv = [
        "--model",
        str(model),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--parallel",
        "2",
        "--ctx",
        "256",
        "--role",
        "prefill",
        *extra,
    ]
    return Worker("serve", argv, log_dir, port, rpc)


def pd_head(model, log_dir, prefill_addr, peers=(), *extra) -> Worker:
    return head(
        model,
        log_dir,
        peers,
        "--dtype",
        "float32",
        "--prefill-worker",
        prefill_addr,
        "--prefill-threshold",
        "8",
        *extra,
    )


def metric(w: Worker, name: str) -> float:
    text = httpx.get(f"{w.url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


@pytest.fixture(scope="module")
def shared(tiny_model, tmp_path_factory):
    """A prefill worker and a plain head (the reference: its own prefill) on the SHAPE model, for the
    tests that leave both as they found them: two worker starts less."""
    model, logs = tiny_model("llama", **SHAPE), tmp_path_factory.mktemp("pd-shared")
    with running(prefill_worker(model, logs)) as pw, running(head(model, logs, (), "--dtype", "float32")) as ref:
        yield pw, ref


def test_greedy_with_pd_equals_greedy_without_solo_and_split(tiny_model, tmp_path, shared):
    model = tiny_model("llama", **SHAPE)
    pw, ref = shared
    served = pw.status()["pd"]["served"]
    want = [greedy(ref, LONG + str(i), 12)[0] for i in range(2)]
    with running(pd_head(model, tmp_path, pw.rpc_addr)) as solo:
        assert [greedy(solo, LONG + str(i), 12)[0] for i in range(2)] == want
        pd = solo.status()["pd"]
        assert pd["transfers"] == 2 and pd["fallbacks"] == 0 and pd["bytes"] > 0
        assert [t["transport"] for t in pd["recent"]] == ["socket", "shm"]  # the first sizes the shared segment
        assert metric(solo, "hydra_pd_transfers_total") == 2
    with (
        running(peer(model, tmp_path)) as p,
        running(pd_head(model, tmp_path, pw.rpc_addr, [p], "--split", "2/2")) as split,
    ):
        assert [greedy(split, LONG + str(i), 12)[0] for i in range(2)] == want
        pd = split.status()["pd"]
        assert pd["transfers"] == 2 and [t["transport"] for t in pd["recent"]] == [
            "socket",
            "shm",
        ]  # one state per stage
        assert p.status()["resident"]["state_bytes_in"] > 0  # the peer's layers went in through STATE_PUT
    assert pw.status()["role"] == "prefill" and pw.status()["pd"]["served"] == served + 4
    r = httpx.post(f"{pw.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    assert r.status_code == 400 and "only prefills" in r.json()["error"]["message"]


class Relay:
    """A TCP relay on a free loopback port in front of `upstream`; each accepted connection gets its
    own upstream connection and `_relay(down, up)` in a thread."""

    def __init__(self, upstream: tuple[str, int]):
        self.upstream = upstream
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.addr = self.rpc_addr = f"127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                down, _ = self.sock.accept()
            except OSError:
                return
            try:
                up = socket.create_connection(self.upstream)
            except OSError:
                down.close()
                continue
            threading.Thread(target=self._relay, args=(down, up), daemon=True).start()

    def _relay(self, down, up):
        raise NotImplementedError

    @staticmethod
    def _pump(src, dst):
        while data := _recv(src):
            try:
                dst.sendall(data)
            except OSError:
                return

    def close(self):
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accept(): the port stops listening
        self.sock.close()


class CutRelay(Relay):
    """In front of the prefill worker's RPC port. With `cut` set, it forwards the first bytes of the
    next reply, signals `mid_transfer` and holds the rest until the connection drops: the test
    kills the worker right then, mid-transfer."""

    def __init__(self, upstream: tuple[str, int]):
        self.cut = False
        self.mid_transfer, self.killed = threading.Event(), threading.Event()
        super().__init__(upstream)

    def _relay(self, down, up):
        cut, self.cut = self.cut, False
        threading.Thread(target=self._pump, args=(down, up), daemon=True).start()
        sent = 0
        with up, down, contextlib.suppress(OSError):
            while data := _recv(up):
                if cut and sent + len(data) > 64:
                    down.sendall(data[: 64 - sent])
                    self.mid_transfer.set()
                    self.killed.wait(30)
                    down.shutdown(socket.SHUT_RDWR)  # the head sees the stream end mid-reply
                    return
                down.sendall(data)
                sent += len(data)


def _recv(s) -> bytes:
    try:
        return s.recv(1 << 16)
    except OSError:
        return b""


class HoldRelay(Relay):
    """In front of a peer's compute port; reads the head's frames (`cmd u8 | size u64 | payload`).
    Armed, it forwards the next STATE_PUT's header and half its payload, sets `holding` and keeps
    the rest until `release`: the peer is then mid-placement, in its prepare phase, for as long as
    the test wants."""

    def __init__(self, upstream: str):
        host, port = upstream.rsplit(":", 1)
        self.armed = False
        self.holding, self.release = threading.Event(), threading.Event()
        super().__init__((host, int(port)))

    def _relay(self, down, up):
        threading.Thread(target=self._pump, args=(up, down), daemon=True).start()
        with up, down, contextlib.suppress(OSError):
            while header := _recv_exact(down, COMPUTE_HEADER.size):
                cmd, size = COMPUTE_HEADER.unpack(header)
                payload = _recv_exact(down, size)
                if cmd == Cmd.STATE_PUT and self.armed:
                    self.armed = False
                    up.sendall(header + payload[: size // 2])
                    self.holding.set()
                    self.release.wait(60)
                    up.sendall(payload[size // 2 :])
                else:
                    up.sendall(header + payload)

    def close(self):
        self.release.set()
        super().close()


def _recv_exact(s, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        data = s.recv(min(n - len(out), 1 << 20))
        if not data:
            return b""
        out += data
    return bytes(out)


def test_running_streams_decode_while_a_peer_is_mid_placement(tiny_model, tmp_path, shared):
    """A split head places a transferred prompt's layers on its peer (STATE_PUT) while a running
    stream keeps decoding: the relay holds the STATE_PUT halfway, the peer reports it staging,
    and meanwhile the stream's token count grows. Both answers then equal the reference."""
    model = tiny_model("llama", **SHAPE)
    pw, ref = shared
    want = greedy(ref, LONG, 12)[0]
    with running(peer(model, tmp_path)) as p:
        relay = HoldRelay(p.rpc_addr)
        try:
            with running(pd_head(model, tmp_path, pw.rpc_addr, [relay], "--split", "2/2", "--ctx", "2048")) as split:
                stream = {}
                a = threading.Thread(
                    target=lambda: stream.update(r=complete(split, "hi", 1500, timeout=300, ignore_eos=True))
                )
                a.start()

                # The running stream's tokens (the prompt being transferred has none yet).
                def decoded():
                    return max(
                        (s.get("n_decoded") or 0 for s in split.status()["slots"] if s["state"] == "processing"),
                        default=0,
                    )

                wait_for(lambda: decoded() > 0, 60, "the stream to decode")
                relay.armed = True
                prompt = {}
                b = threading.Thread(target=lambda: prompt.update(text=greedy(split, LONG, 12)[0]))
                b.start()
                assert relay.holding.wait(60), "no STATE_PUT reached the peer"
                wait_for(lambda: p.status()["resident"]["staging"] == 1, 60, "the peer to stage the state")
                n = decoded()
                assert n > 0, "the stream ended before the placement began"
                wait_for(lambda: decoded() >= n + 2, 60, "the stream to decode while the peer is mid-placement")
                assert p.status()["resident"]["staging"] == 1  # still mid-placement all along
                relay.release.set()
                b.join(120)
                a.join(300)
                assert prompt["text"] == want and stream["r"].status_code == 200
                pd = split.status()["pd"]
                assert pd["transfers"] == 1 and pd["fallbacks"] == 0
                assert p.status()["resident"]["staging"] == 0
        finally:
            relay.close()


def test_prefill_worker_slow_killed_mid_transfer_or_down_falls_back_and_is_counted(tiny_model, tmp_path):
    model = tiny_model("llama", **SHAPE)
    pw = prefill_worker(model, tmp_path)
    relay = None
    try:
        pw.wait_ready()
        relay = CutRelay(("127.0.0.1", pw.rpc_port))
        with running(pd_head(model, tmp_path, relay.addr, (), "--prefill-deadline", "3")) as w:
            want = greedy(w, LONG, 12)[0]  # through the prefill worker
            assert w.status()["pd"]["transfers"] == 1

            os.killpg(pw.proc.pid, signal.SIGSTOP)  # slow: past the deadline
            assert greedy(w, LONG, 12)[0] == want
            os.killpg(pw.proc.pid, signal.SIGCONT)

            relay.cut = True  # killed mid-transfer
            result = {}
            t = threading.Thread(target=lambda: result.setdefault("text", greedy(w, LONG, 12)[0]))
            t.start()
            assert relay.mid_transfer.wait(60), "the prefill worker never started answering"
            pw.kill9()
            relay.killed.set()
            t.join(60)
            assert result["text"] == want

            relay.close()  # down: nothing listens any more
            assert greedy(w, LONG, 12)[0] == want

            pd = w.status()["pd"]
            assert pd["fallback_reasons"] == {"deadline": 1, "transfer": 1, "down": 1}, pd
            assert [t["fallback"] for t in pd["recent"]] == [None, "deadline", "transfer", "down"]
            for reason in ("deadline", "transfer", "down"):
                assert metric(w, f'hydra_pd_fallbacks_total{{reason="{reason}"}}') == 1
    finally:
        if relay is not None:
            relay.close()
        if pw.proc.poll() is None:
            os.killpg(pw.proc.pid, signal.SIGCONT)
        pw.stop()


def test_a_request_cancelled_while_its_state_is_in_flight_keeps_its_slot_until_the_transfer_ends(tiny_model, tmp_path):
    """The head copies a prompt state into its slot beside the running forwards, so a slot whose
    state is on its way is never handed on: a request cancelled meanwhile keeps its slot until the
    transfer ends (here at the deadline, the prefill worker being stopped), then the slot is free
    and the next request's output is as before."""
    model = tiny_model("llama", **SHAPE)
    pw = prefill_worker(model, tmp_path)
    try:
        pw.wait_ready()
        flags = (
            "--dtype",
            "float32",
            "--prefill-worker",
            pw.rpc_addr,
            "--prefill-threshold",
            "8",
            "--prefill-deadline",
            "6",
        )
        with running(head(model, tmp_path, (), *flags, parallel=1)) as w:
            want = greedy(w, LONG, 12)[0]
            os.killpg(pw.proc.pid, signal.SIGSTOP)
            try:
                with pytest.raises(httpx.TimeoutException):  # the client leaves: the server cancels the request
                    httpx.post(f"{w.url}/v1/completions", json={"prompt": "and " + LONG, "max_tokens": 4}, timeout=1.5)
                time.sleep(1.5)  # well past the server's disconnect poll, well before the deadline
                assert httpx.get(f"{w.url}/slots", timeout=10).json()[0]["is_processing"]
            finally:
                os.killpg(pw.proc.pid, signal.SIGCONT)
            assert greedy(w, LONG, 12)[0] == want
            assert not httpx.get(f"{w.url}/slots", timeout=10).json()[0]["is_processing"]
    finally:
        pw.stop()


def control(w: Worker, op: int, payload: bytes = b"", slot: int = 0):
    with socket.create_connection(("127.0.0.1", w.rpc_port), timeout=30) as s:
        s.sendall(pack_control_request(op, payload, key=str(slot).encode()))
        return read_control_response(SocketReader(s), 1 << 30)


def _respoiled(blob: bytes, **header) -> bytes:
    """The same state under another header (another model's fingerprint, another layer range)."""
    view = memoryview(blob)
    pos = 0

    def read(n):
        nonlocal pos
        pos += n
        return bytes(view[pos - n : pos])

    h, crcs = SlotHeader.decode(read)
    doc = {**h.__dict__, **header}
    return SlotHeader(**doc).encode(crcs) + bytes(view[pos:])


def test_peer_state_ops_refuse_bad_states_and_leave_the_slot_as_it_was(tiny_model, tmp_path):
    """STATE_META/GET/PUT on a real peer, driven as its head drives it (RemoteStage)."""
    model = tiny_model("llama", **SHAPE)
    g = GGUFFile(model)
    with running(peer(model, tmp_path)) as p:
        remote = RemoteStage(p.rpc_addr, (2, 4), g=g, dtype=torch.float32, n_slots=2, n_ctx=64)
        remote.attach()
        torch.manual_seed(0)
        hidden = torch.randn(6, ModelConfig.from_gguf(g).n_embd)
        tokens = [5, 6, 7, 8, 9]
        remote.run_layers(hidden[:5], torch.zeros(5, dtype=torch.long), torch.arange(5))
        meta = remote.state_meta(0)
        assert meta["n_tokens"] == 5 and meta["layers"] == [[2, 4]] and meta["fingerprint"] == g.fingerprint
        blob = bytes(remote.state_get(0, tokens))
        bad = {
            "checksum": blob[:-20] + bytes([blob[-20] ^ 1]) + blob[-19:],
            "of model": _respoiled(blob, fingerprint="another-model"),
            "holds layers": _respoiled(blob, layers=[0, 2]),
            "truncated": blob[:-100],
        }
        for reason, state in bad.items():
            with pytest.raises(PeerError, match=reason):
                remote.state_put(0, state)
            assert remote.state_get(0, tokens) == blob  # the slot as it was; the session still in sync
        remote.state_put(1, blob)  # a good state: slot 1 continues exactly as slot 0
        step = lambda slot: remote.run_layers(hidden[5:], torch.tensor([slot]), torch.tensor([5]))  # noqa: E731
        assert torch.equal(step(0), step(1))
        remote.close()


@pytest.mark.parametrize("split", [False, True], ids=["solo", "split"])
def test_a_saved_slot_survives_a_head_restart_and_bad_files_leave_it_intact(tiny_model, tmp_path, split):
    model, other = tiny_model("llama", **SHAPE), tiny_model("llama", n_layers=6)
    peers = [peer(model, tmp_path)] if split else []
    extra = ["--dtype", "float32", "--slot-save-path", str(tmp_path), *(["--split", "2/2"] if split else [])]

    def act(w, action, name):
        return httpx.post(
            f"{w.url}/slots/0",
            params={"action": action},  # noqa: E731
            json={"filename": name},
            timeout=30,
        )

    def complete(w):
        return httpx.post(
            f"{w.url}/v1/completions",
            json={"prompt": LONG, "max_tokens": 8, "temperature": 0},  # noqa: E731
            timeout=60,
        ).json()

    try:
        for p in peers:
            p.wait_ready()
        with running(head(model, tmp_path, peers, *extra, parallel=1)) as w:
            first = complete(w)["choices"][0]["text"]
            saved = act(w, "save", "good.bin").json()
            assert saved["n_saved"] > 0
        blob = (tmp_path / "good.bin").read_bytes()
        (tmp_path / "corrupt.bin").write_bytes(blob[:-20] + bytes([blob[-20] ^ 1]) + blob[-19:])
        (tmp_path / "other.bin").write_bytes(_respoiled(blob, fingerprint=GGUFFile(other).fingerprint))
        with running(head(model, tmp_path, peers, *extra, parallel=1)) as w:  # restarted
            assert act(w, "restore", "good.bin").json()["n_restored"] == saved["n_saved"]
            for name, reason in (("corrupt.bin", "checksum"), ("other.bin", "of model")):
                r = act(w, "restore", name)
                assert r.status_code == 400 and reason in r.json()["error"]["message"], r.text
            # The same through the head's control port: STATE_META / STATE_GET / STATE_PUT on the pipeline.
            meta = control(w, Op.STATE_META)
            assert meta.status == Status.OK and meta.meta["n_tokens"] == saved["n_saved"]
            assert meta.meta["layers"] == ([[0, 2], [2, 4]] if split else [[0, 4]])
            got = control(w, Op.STATE_GET)
            assert got.status == Status.OK and got.payload == blob  # what the file holds
            r = control(w, Op.STATE_PUT, got.payload[:-20] + bytes([got.payload[-20] ^ 1]) + got.payload[-19:])
            assert r.status == Status.BAD_REQUEST and "checksum" in r.meta["error"]
            assert control(w, Op.STATE_PUT, got.payload).meta["n_tokens"] == saved["n_saved"]
            again = complete(w)
            assert again["choices"][0]["text"] == first
            assert again["timings"]["cache_n"] > 0  # continued from the restored slot
    finally:
        for p in peers:
            p.stop()


def test_a_hybrid_models_recurrent_state_moves_too(tiny_model, tmp_path):
    """qwen35: DeltaNet conv/ssm state travels with the attention layers' KV; greedy is unchanged."""
    model = tiny_model("qwen35", n_layers=4)
    with (
        running(prefill_worker(model, tmp_path)) as pw,
        running(head(model, tmp_path, (), "--dtype", "float32")) as ref,
    ):
        want = greedy(ref, LONG, 12)[0]
        with running(pd_head(model, tmp_path, pw.rpc_addr)) as w:
            assert greedy(w, LONG, 12)[0] == want
            assert w.status()["pd"]["transfers"] == 1


@pytest.mark.unit
def test_a_bad_chunk_from_the_prefill_worker_is_refused_as_it_arrives():
    """The head checks each chunk as it arrives: a bad one ends the exchange there, a `refused`
    fallback (the slot is never touched: nothing is placed), without reading the rest."""
    from hydra_console.contracts.slot_state import CHUNK_BYTES, TensorEntry
    from hydra_console.engine import slot_state
    from hydra_console.engine.pd import PdFallback, PrefillClient
    from hydra_console.engine.rpc.wire import pack_control_response, read_control_request

    body = bytes(range(256)) * (CHUNK_BYTES // 32)  # eight chunks
    header = SlotHeader(
        "fp", [0, 4], [1, 2, 3], "float32", "float32", [TensorEntry("blk.0.k", [len(body) // 4], "float32", len(body))]
    )
    state = bytearray(slot_state.pack(header, [memoryview(body)]))
    state[header.prefix_bytes + 2 * CHUNK_BYTES] ^= 1
    server = socket.create_server(("127.0.0.1", 0))

    def worker():
        conn, _ = server.accept()
        with conn, contextlib.suppress(OSError):  # the head hangs up mid-reply
            reader = SocketReader(conn)
            reader.drain(read_control_request(reader).payload_len)
            conn.sendall(pack_control_response(Status.OK, {"sizes": [len(state)]}, bytes(state)))

    threading.Thread(target=worker, daemon=True).start()
    with server:
        client = PrefillClient(f"127.0.0.1:{server.getsockname()[1]}", None, 30)
        with pytest.raises(PdFallback, match=f"chunk at byte {2 * CHUNK_BYTES} fails its checksum") as e:
            client.prefill([1, 2, 3], [(0, 4)], "fp", len(state))
        assert e.value.reason == "refused"


@pytest.mark.unit
def test_a_reply_larger_than_the_model_allows_is_refused_before_anything_is_allocated(tiny_model):
    """A worker announcing a 4 GiB state for three tokens: refused from the header alone (the bound
    comes from the head's own model), nothing allocated, nothing kept."""
    from hydra_console.contracts.footprint import model_tensors
    from hydra_console.engine import slot_state
    from hydra_console.engine.pd import PdFallback, PrefillClient
    from hydra_console.engine.rpc.wire import control_response_head, read_control_request

    g = GGUFFile(tiny_model("llama", **SHAPE))
    limit = model_tensors(g.metadata, g.tensors).slot_state_bound([(0, 4)], 3)
    assert 0 < limit < 1 << 20  # three tokens of a tiny model
    server = socket.create_server(("127.0.0.1", 0))

    def worker():
        conn, _ = server.accept()
        with conn, contextlib.suppress(OSError):
            reader = SocketReader(conn)
            reader.drain(read_control_request(reader).payload_len)
            conn.sendall(control_response_head(Status.OK, {"sizes": [4 << 30]}, 4 << 30))  # and never the bytes
            conn.recv(1)

    threading.Thread(target=worker, daemon=True).start()
    kept = len(slot_state.BUFFERS._kept)
    rss = psutil.Process().memory_info().rss
    with server:
        client = PrefillClient(f"127.0.0.1:{server.getsockname()[1]}", None, 30)
        with pytest.raises(PdFallback, match=f"announces {4 << 30} bytes") as e:
            client.prefill([1, 2, 3], [(0, 4)], "fp", limit)
        assert e.value.reason == "refused"
    assert psutil.Process().memory_info().rss - rss < 64 << 20 and len(slot_state.BUFFERS._kept) == kept
