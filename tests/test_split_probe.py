"""PROBE on real workers: every stage times its own layers without disturbing any request."""

from __future__ import annotations

import json
import socket
import threading

from rpc_workers import complete, head, peer, running, wait_for

from hydra_console.app import control_client
from hydra_console.contracts.rpc import Cmd, Op, ReplyStatus, Status
from hydra_console.engine.gguf_file import GGUFFile
from hydra_console.engine.rpc import wire
from hydra_console.engine.rpc.compute import pack_hello
from hydra_console.engine.rpc.resident import tensor_shapes


def probe(h, body: dict) -> control_client.ControlReply:
    return control_client.request_sync("127.0.0.1", h.rpc_port, Op.PROBE, json.dumps(body).encode(), timeout=120)


def text(h, prompt: str, n: int = 24) -> str:
    r = complete(h, prompt, n, ignore_eos=True)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_probe_reports_every_stage_and_loses_no_kv(tiny_model, tmp_path):
    model = tiny_model("llama", n_layers=4)
    # The peer's layers take 10 ms each: a 100-token request decodes for seconds, so the probe below
    # meets it mid-generation however slow the machine's polls are.
    slow_peer = peer(model, tmp_path, "--layer-delay-ms", "10")
    with running(slow_peer) as p, running(head(model, tmp_path, [p], parallel=1, ctx=128)) as h:
        prompt = "the quick brown fox"
        baseline = text(h, prompt)
        reply = probe(h, {"tokens": 8, "reps": 2})
        assert reply.ok, reply.meta
        stages = reply.meta["stages"]
        assert [s["layers"] for s in stages] == [[0, 2], [2, 4]]
        for s in stages:
            assert len(s["decode_ms"]) == len(s["prefill_ms"]) == 2 and all(ms > 0 for ms in s["decode_ms"])
            assert len(s["layer_bytes"]) == 4 and s["held_bytes"] == sum(s["layer_bytes"][slice(*s["layers"])])
            assert s["free_bytes"] > 0
        assert stages[1]["name"] == p.rpc_addr and stages[1]["hop_ms"] >= 0
        assert reply.meta["step_ms"] > 0 and reply.meta["fixed_ms"] > 0
        # The one slot's prompt cache survived the probe: the same prompt decodes the same.
        assert text(h, prompt) == baseline

        # A probe while a request decodes: it waits its turn between steps, and the request's KV stays whole.
        long_prompt = "a long story about the sea"
        expected = text(h, long_prompt, 100)
        got = {}
        t = threading.Thread(target=lambda: got.update(text=text(h, long_prompt, 100)))
        t.start()
        wait_for(lambda: any((s["n_decoded"] or 0) > 2 for s in h.status()["slots"]), 60, "decoding to start")
        assert probe(h, {"tokens": 16, "reps": 1}).ok
        t.join(60)
        assert got["text"] == expected


def test_probe_refusals(tiny_model, tmp_path):
    model = tiny_model("llama", n_layers=4)
    with running(head(model, tmp_path)) as solo:
        reply = probe(solo, {})
        assert reply.status == Status.BAD_REQUEST and "solo" in reply.meta["error"]
    with running(peer(model, tmp_path)) as p, running(head(model, tmp_path, [p], ctx=64)) as h:
        for body, words in (
            ({"tokens": 0}, "'tokens' must be 1.."),
            ({"reps": "x"}, "integers"),
            ({"slot": 1}, "takes 'tokens' and 'reps'"),
            ({"tokens": 100}, "no room"),
        ):
            reply = probe(h, body)
            assert reply.status == Status.BAD_REQUEST and words in reply.meta["error"], (body, reply.meta)
        assert probe(h, {"tokens": 4, "reps": 1}).ok  # the connection and the head carry on


def compute_probe(port: int, g: GGUFFile) -> bytes:
    """PROBE from a compute session of our own (HELLO and CHECK pass: no token on these workers)."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:

        def ask(cmd, payload=b""):
            s.sendall(wire.pack_compute_request(cmd, payload))
            return bytes(wire.read_compute_response(wire.SocketReader(s), 1 << 20))

        ask(Cmd.HELLO, pack_hello())
        assert (
            ask(Cmd.CHECK, json.dumps({"fingerprint": g.fingerprint, "shapes": tensor_shapes(g)}).encode())[0]
            == ReplyStatus.OK
        )
        return ask(Cmd.PROBE, json.dumps({"slot": 0, "position": 0, "tokens": 4, "reps": 1}).encode())


def test_only_the_heads_session_may_probe_a_peer(tiny_model, tmp_path):
    """Another session's PROBE would write KV into the head's slots: refused, as its FORWARD is;
    and the head's own compute port refuses PROBE (its stage is timed under its pipeline)."""
    model = tiny_model("llama", n_layers=4)
    g = GGUFFile(model)
    with running(peer(model, tmp_path)) as p, running(head(model, tmp_path, [p])) as h:
        reply = compute_probe(p.rpc_port, g)
        assert reply[0] == ReplyStatus.ERROR and b"another session" in reply
        reply = compute_probe(h.rpc_port, g)
        assert reply[0] == ReplyStatus.ERROR and b"use the control op PROBE" in reply
        assert probe(h, {"tokens": 4, "reps": 1}).ok  # the head's own session may
