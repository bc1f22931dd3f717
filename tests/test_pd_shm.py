"""P/D over shared memory on one host (engine/rpc/shm.py): a prefill worker writes PREFILL's slot
states into the decode head's segment under /dev/shm instead of the socket. Real workers on
loopback: greedy over shared memory equals greedy without; a chunk spoiled in the segment is
refused and the request falls back; a worker that cannot open the segment answers over the socket
(the head then stops offering). Then the segments themselves, without processes."""

from __future__ import annotations

import contextlib
import json
import os
import threading

import pytest
from rpc_workers import greedy, head, running
from test_pd import LONG, SHAPE, Relay, pd_head, prefill_worker

from hydra_console.contracts.rpc import SHM_DATA_OFFSET, SHM_DIR, Op
from hydra_console.contracts.slot_state import SlotStateError
from hydra_console.engine.rpc.shm import Attached, Segment, Segments, remove_stale
from hydra_console.engine.rpc.wire import (
    SocketReader,
    pack_control_request,
    pack_control_response,
    read_control_request,
    read_control_response,
)

PROMPTS = [LONG + str(i) for i in range(3)]


@pytest.fixture(scope="module")
def want(tiny_model, tmp_path_factory):
    """Greedy of each prompt on a head that prefills itself."""
    with running(head(tiny_model("llama", **SHAPE), tmp_path_factory.mktemp("ref"), (), "--dtype", "float32")) as ref:
        return [greedy(ref, p, 12)[0] for p in PROMPTS]


def segments_of(w) -> list[str]:
    return [n for n in os.listdir(SHM_DIR) if n.startswith(f"hydra-pd-{w.proc.pid}-")]


def transfers(w) -> list[tuple]:
    return [(t["transport"], t["fallback"]) for t in w.status()["pd"]["recent"]]


def test_greedy_over_shared_memory_equals_greedy_without(tiny_model, tmp_path, want):
    """The first transfer comes over the socket (it sizes the segment), the next ones through it;
    the segment is gone once the head stops."""
    model = tiny_model("llama", **SHAPE)
    with running(prefill_worker(model, tmp_path)) as pw:
        with running(pd_head(model, tmp_path, pw.rpc_addr)) as w:
            assert [greedy(w, p, 12)[0] for p in PROMPTS] == want
            assert transfers(w) == [("socket", None), ("shm", None), ("shm", None)]
            assert w.status()["pd"]["bytes"] > 0 and len(segments_of(w)) == 1
        assert segments_of(w) == []
        assert pw.status()["pd"]["served"] == 3


class ShmRelay(Relay):
    """In front of the prefill worker's RPC port, one PREFILL per connection. `spoil`: flips the
    last byte of the states the worker wrote into the head's segment before the reply goes on.
    `hide`: the offer names a file that does not exist (a worker on another host)."""

    def __init__(self, upstream: tuple[str, int], mode: str):
        self.mode, self.offers = mode, 0
        super().__init__(upstream)

    def _relay(self, down, up):
        with up, down, contextlib.suppress(OSError):
            reader = SocketReader(down)
            req = read_control_request(reader)
            payload = reader.read_exact(req.payload_len)
            request = json.loads(bytes(payload))
            offer = request.get("shm") if req.op == Op.PREFILL else None
            if offer is not None:
                self.offers += 1
                if self.mode == "hide":
                    offer["name"] = offer["name"][:-32] + "0" * 32
            up.sendall(pack_control_request(req.op, json.dumps(request).encode(), req.key, req.trace))
            reply = read_control_response(SocketReader(up), 1 << 30)
            if self.mode == "spoil" and reply.meta.get("shm"):
                with open(os.path.join(SHM_DIR, offer["name"]), "r+b") as f:
                    f.seek(SHM_DATA_OFFSET + sum(reply.meta["sizes"]) - 1)
                    last = f.read(1)[0]
                    f.seek(-1, os.SEEK_CUR)
                    f.write(bytes([last ^ 1]))
            down.sendall(pack_control_response(reply.status, reply.meta, bytes(reply.payload)))


@contextlib.contextmanager
def relayed(model, tmp_path, mode: str):
    with running(prefill_worker(model, tmp_path)) as pw:
        relay = ShmRelay(("127.0.0.1", pw.rpc_port), mode)
        try:
            with running(pd_head(model, tmp_path, relay.addr)) as w:
                yield w, relay
        finally:
            relay.close()


def test_a_chunk_spoiled_in_shared_memory_is_refused_and_the_request_falls_back(tiny_model, tmp_path, want):
    """The head checks every chunk it reads out of its segment: a spoiled one is a `refused`
    fallback (prefilled here, the same output); that segment is dropped, the next transfer goes
    through a new one."""
    with relayed(tiny_model("llama", **SHAPE), tmp_path, "spoil") as (w, relay):
        assert greedy(w, PROMPTS[0], 12)[0] == want[0]  # over the socket: the segment's size is learnt
        assert greedy(w, PROMPTS[1], 12)[0] == want[1]
        relay.mode = None
        assert greedy(w, PROMPTS[2], 12)[0] == want[2]
        assert transfers(w) == [("socket", None), ("shm", "refused"), ("shm", None)]
        pd = w.status()["pd"]
        assert pd["fallback_reasons"] == {"refused": 1} and "checksum" in pd["recent"][1]["error"]
        assert relay.offers == 2 and len(segments_of(w)) == 1


def test_a_worker_that_cannot_open_the_segment_answers_over_the_socket(tiny_model, tmp_path, want):
    """Another host or mount namespace: the worker finds no such file and sends the states on the
    socket, no failure counted; the head stops offering (and unlinks its segment)."""
    with relayed(tiny_model("llama", **SHAPE), tmp_path, "hide") as (w, relay):
        assert [greedy(w, p, 12)[0] for p in PROMPTS] == want
        assert transfers(w) == [("socket", None)] * 3
        assert relay.offers == 1 and w.status()["pd"]["fallbacks"] == 0
        assert segments_of(w) == []


# --- the segments, in one process --------------------------------------------------------------


@pytest.mark.unit
def test_a_worker_maps_only_this_hosts_segment_of_its_user_with_the_offered_nonce(tmp_path):
    segment = Segment(1 << 20, str(tmp_path))
    attached, offer = Attached(str(tmp_path)), segment.offer
    try:
        window = attached.window(offer)
        assert window is not None and len(window) == segment.capacity
        window[:3] = b"abc"
        assert bytes(segment.states([3])) == b"abc"  # the same memory
        del window
        other = {**offer, "nonce": os.urandom(16).hex()}  # a file of that name elsewhere
        bad = [
            other,
            {**offer, "size": offer["size"] + 1},
            {**offer, "name": "../" + segment.name},
            {**offer, "name": segment.name[:-32] + "0" * 32},
            {"name": segment.name},
            "junk",
        ]
        assert [attached.window(o) for o in bad] == [None] * len(bad)
        link = segment.name[:-32] + "1" * 32
        os.symlink(segment.path, tmp_path / link)
        assert attached.window({**offer, "name": link}) is None  # no symlinks followed
        assert attached.window(offer) is not None
        segment.close()  # the head unlinked it: the worker lets its mapping go at its next PREFILL
        assert attached.window(offer) is None and not attached._maps
    finally:
        segment.close()
        attached.close()


@pytest.mark.unit
def test_a_reply_is_read_only_inside_the_segment():
    segment = Segment(1 << 20)
    try:
        assert len(segment.states([10, 20])) == 30
        for sizes in ([segment.capacity + 1], [segment.capacity, 1], [-1], [1.5], "12", None):
            with pytest.raises(SlotStateError, match="do not fit"):
                segment.states(sizes)
    finally:
        segment.close()


@pytest.mark.unit
def test_one_segment_per_exchange_reused_dropped_on_failure_unlinked_at_close(tmp_path):
    segments = Segments(str(tmp_path))
    names = lambda: sorted(os.listdir(tmp_path))  # noqa: E731
    with segments.lease(100) as a, segments.lease(100) as b:
        assert a is not b and len(names()) == 2  # two exchanges in flight: two segments
    with segments.lease(200) as c:
        assert c in (a, b)  # reused
    with pytest.raises(RuntimeError), segments.lease(100) as d:
        raise RuntimeError("the exchange failed")
    assert d.name not in names() and len(names()) == 1  # dropped: the worker may still write into it
    with segments.lease(64 << 20) as e:
        assert e.capacity >= 64 << 20 and len(names()) == 1  # the small one made way for it
    barrier = threading.Barrier(2)

    def lease():
        with segments.lease(100):
            barrier.wait(10)

    threads = [threading.Thread(target=lease) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    segments.close()
    assert names() == []
    with segments.lease(100) as none:
        assert none is None


@pytest.mark.unit
def test_segments_of_a_head_that_is_gone_are_removed(tmp_path):
    dead = tmp_path / f"hydra-pd-{2**22 + 1}-{'a' * 32}"  # above the kernel's pid limit
    alive = tmp_path / f"hydra-pd-{os.getpid()}-{'b' * 32}"
    other = tmp_path / "unrelated"
    for path in (dead, alive, other):
        path.write_bytes(b"x")
    remove_stale(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([alive.name, other.name])
