"""The RPC port's JSON layouts (contracts/rpc.py on contracts/wire_json.py): each round-trips, and
anything the wire may send that is not its layout (a wrong type, a missing or unknown key, a number
out of bounds) is refused with the field named, by both servers before their backends see it."""

from __future__ import annotations

import dataclasses
import json
import socket
import types

import pytest

from hydra_console.contracts import rpc
from hydra_console.contracts.framing import SocketReader, pack_control_request, read_control_response
from hydra_console.contracts.rpc import Cmd, Op, Status
from hydra_console.contracts.wire_json import Message, WireError

pytestmark = pytest.mark.unit

SAMPLES = [
    rpc.CheckRequest(fingerprint="ab12", shapes={"blk.0.attn_q.weight": [64, 64], "output_norm.weight": [64]}),
    rpc.CheckReply(ok=True, fingerprint="ab12", epoch=3),
    rpc.LoadStageRequest(layers=[2, 4], n_slots=4, n_ctx=512),
    rpc.LoadStageRequest(
        layers=[0, 1],
        dtype="bfloat16",
        n_slots=1,
        n_ctx=8,
        kv_pool=64,
        kv_types=["q8_0", "auto"],
        max_run=5,
        deterministic=True,
        output=True,
        mtp=True,
    ),
    rpc.DraftAsk(released=[0], resting=[1], following=[2], slots=[3], tokens=[7], positions=[40], ks=[3], p_mins=[0.5]),
    rpc.DraftReply(counts=[2, 0], tokens=[5, 9]),
    rpc.LoadStageReply(epoch=2, layers=[2, 4], device="cuda:0", load_s=0.25, state_key="0" * 32),
    rpc.ProbeRequest(slot=1, position=10, tokens=4, reps=1),
    rpc.PipelineProbeRequest(tokens=32, reps=3),
    rpc.StageProbe(
        layers=[2, 4],
        device="cpu",
        decode_ms=[0.5, 0.25],
        prefill_ms=[2.0, 1.5],
        layer_bytes=[100, 200, 300, 400],
        held_bytes=700,
        free_bytes=1 << 33,
    ),
    rpc.PipelineProbe(tokens=32, stages=[{"name": "head", "layers": [0, 2]}], fixed_ms=1.0, step_ms=3.5),
    rpc.StateMeta(slot=0, n_tokens=12, layers=[[2, 4]], bytes=4096, fingerprint="ab12", dtype="float32"),
    rpc.StateGetRequest(slot=3, tokens=[1, 2, 3]),
    rpc.ShmOffer(name="hydra-pd-1-" + "0" * 32, size=1 << 20, nonce="ff" * 16),
    rpc.PrefillRequest(tokens=[5, 6, 7], ranges=[[0, 2], [2, 4]], fingerprint="ab12"),
    rpc.PrefillRequest(
        tokens=[5],
        ranges=[[0, 4]],
        fingerprint="ab12",
        ipc="GPU-1234",
        shm=rpc.ShmOffer(name="hydra-pd-1-" + "1" * 32, size=4096, nonce="00" * 16),
    ),
    rpc.PrefillReply(n_tokens=3, sizes=[10, 20], prefill_ms=1.5, collect_ms=0.5),
    rpc.PrefillReply(n_tokens=3, sizes=[10], prefill_ms=1, collect_ms=0, ipc=[{"header": "x"}], shm=False),
    rpc.IpcOpenRequest(uuid="GPU-1234", rows=8, dtype="float16"),
    rpc.ConfigureRequest(split="12/6", by="console"),
    rpc.ConfigureRequest(layers=[[0, 12], [12, 18]]),
]
TYPES = sorted({type(m) for m in SAMPLES}, key=lambda t: t.__name__)


def test_every_layout_of_contracts_rpc_has_a_sample():
    declared = {v for v in vars(rpc).values() if isinstance(v, type) and issubclass(v, Message) and v is not Message}
    assert declared == set(TYPES)


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: type(m).__name__)
def test_each_layout_round_trips(message):
    wire = json.loads(json.dumps(message.to_json()))
    assert type(message).from_json(wire) == message
    assert type(message).decode(message.encode()) == message
    assert None not in message.to_json().values()  # an unset optional field is left out


def _wrong(value):
    """A JSON value of another type than `value`'s."""
    if isinstance(value, bool):
        return 1
    if isinstance(value, (int, float)):
        return "7"
    if isinstance(value, str):
        return 7
    if isinstance(value, list):
        return {"a": 1}
    return [1]


def _cases(message):
    """(bad JSON, the field it names) for every field of the sample."""
    good = message.to_json()
    for f in dataclasses.fields(message):
        if f.name in good:
            yield {**good, f.name: _wrong(good[f.name])}, f.name
            value = good[f.name]
            if isinstance(value, list) and value and isinstance(value[0], (int, float, list, dict)):
                yield {**good, f.name: [_wrong(value[0]), *value[1:]]}, f"{f.name}[0]"
            if isinstance(value, dict) and value and f.name == "shm":
                yield {**good, f.name: {**value, "size": -1}}, "shm.size"
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if required:
            yield {k: v for k, v in good.items() if k != f.name}, f.name
    yield {**good, "surprise": 1}, "surprise"


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: type(m).__name__)
def test_bad_json_is_refused_naming_the_field(message):
    for bad, field in _cases(message):
        with pytest.raises(WireError) as e:
            type(message).from_json(bad)
        assert e.value.field == field, (bad, str(e.value))
        assert field.split("[")[0].split(".")[0] in str(e.value), (bad, str(e.value))
    for payload in (b"not json", b"[1, 2]", b'"x"', b"\xff"):
        with pytest.raises(WireError, match="payload"):
            type(message).decode(payload)


@pytest.mark.parametrize(
    "layout,bad,field,words",
    [
        (rpc.LoadStageRequest, {"layers": [0, 2], "n_slots": 1, "n_ctx": 1 << 40}, "n_ctx", "n_ctx 1.."),
        (rpc.LoadStageRequest, {"layers": [0, 2], "n_slots": 0, "n_ctx": 8}, "n_slots", "n_slots must be 1.."),
        (rpc.LoadStageRequest, {"layers": [0, 2], "n_slots": 1, "n_ctx": 8, "max_run": 65}, "max_run", "max_run"),
        (
            rpc.LoadStageRequest,
            {"layers": [0, 2], "n_slots": 1, "n_ctx": 8, "kv_types": ["q8_0"]},
            "kv_types",
            "[K, V]",
        ),
        (rpc.LoadStageRequest, {"layers": [0, 2], "n_slots": 1, "n_ctx": 8, "dtype": "int4"}, "dtype", "one of"),
        (rpc.LoadStageRequest, {"layers": [0, 2, 4], "n_slots": 1, "n_ctx": 8}, "layers", "2 items"),
        (rpc.LoadStageRequest, {"layers": [0, 2], "n_slots": True, "n_ctx": 8}, "n_slots", "n_slots"),
        (rpc.PipelineProbeRequest, {"tokens": 0}, "tokens", "'tokens' must be 1.."),
        (rpc.PipelineProbeRequest, {"reps": 2.0}, "reps", "integers"),
        (rpc.PipelineProbeRequest, {"slot": 1}, "slot", "takes 'tokens' and 'reps'"),
        (rpc.ProbeRequest, {"slot": -1, "position": 0}, "slot", "'slot' must be an integer 0..1023"),
        (rpc.StateGetRequest, {"slot": 0, "tokens": [1, 1 << 40]}, "tokens[1]", "tokens[1]"),
        (rpc.PrefillRequest, {"tokens": [1], "ranges": [[0, 1, 2]], "fingerprint": "x"}, "ranges[0]", "ranges[0]"),
        (rpc.IpcOpenRequest, {"uuid": "GPU-x", "rows": 1 << 20}, "rows", "1..65536"),
        (rpc.ConfigureRequest, {"by": "me"}, "split", "exactly one of 'split' or 'layers'"),
        (rpc.ConfigureRequest, {"split": "1/1", "layers": [[0, 1], [1, 2]]}, "split", "exactly one"),
        (
            rpc.PrefillReply,
            {"n_tokens": 1, "sizes": [1], "prefill_ms": float("nan"), "collect_ms": 0},
            "prefill_ms",
            "number",
        ),
    ],
)
def test_bounds_and_their_words(layout, bad, field, words):
    with pytest.raises(WireError, match=None) as e:
        layout.from_json(bad)
    assert e.value.field == field and words in str(e.value), str(e.value)
    assert str(e.value).startswith(layout.OP)


def test_the_compute_server_answers_a_bad_request_naming_the_field():
    from hydra_console.engine.rpc.compute import ComputeServer
    from hydra_console.engine.rpc.resident import ComputeError

    seen = []
    host = types.SimpleNamespace(check=lambda r: seen.append(r) or rpc.CheckReply(ok=True, fingerprint="f", epoch=1))
    server = ComputeServer(host)
    session = server.open()
    with pytest.raises(ComputeError, match=r"CHECK: 'shapes\.a\[0\]' must be an integer"):
        server._command(Cmd.CHECK, b'{"fingerprint": "f", "shapes": {"a": ["x"]}}', session)
    with pytest.raises(ComputeError, match="CHECK takes 'fingerprint' and 'shapes'"):
        server._command(Cmd.CHECK, b'{"fingerprint": "f", "shapes": {}, "more": 1}', session)
    assert not seen and not session["checked"]  # the host never saw them
    (reply,) = server._command(Cmd.CHECK, b'{"fingerprint": "f", "shapes": {"a": [2, 3]}}', session)
    assert json.loads(reply) == {"ok": True, "fingerprint": "f", "epoch": 1} and session["checked"]
    assert seen == [rpc.CheckRequest(fingerprint="f", shapes={"a": [2, 3]})]
    with pytest.raises(ComputeError, match="unknown command 99"):
        server._command(99, b"", session)


def test_the_control_server_answers_bad_request_naming_the_field():
    from hydra_console.engine.rpc.control import ControlServer

    seen = []

    class Backend:
        def info(self):
            return {"engine": "test"}

        def configure(self, request):
            seen.append(request)
            return {"ok": True}

    server = ControlServer(Backend())
    assert set(server.handlers) == {Op.INFO, Op.CONFIGURE}  # the dispatch table: the ops the backend has
    a, b = socket.socketpair()
    with a, b:
        reader = SocketReader(b)

        def ask(op, payload=b""):
            a.sendall(pack_control_request(op, payload))
            assert server.serve(b, reader, server.open())
            return read_control_response(SocketReader(a), 1 << 20)

        reply = ask(Op.CONFIGURE, b'{"split": 12}')
        assert reply.status == Status.BAD_REQUEST and "'split' must be a string" in reply.meta["error"]
        reply = ask(Op.CONFIGURE, b'{"layers": [[0, 2]], "speed": "max"}')
        assert reply.status == Status.BAD_REQUEST and "got unknown ['speed']" in reply.meta["error"]
        assert ask(Op.CONFIGURE, b"not json").status == Status.BAD_REQUEST
        assert not seen
        assert ask(Op.CONFIGURE, b'{"split": "2/2", "by": "me"}').meta == {"ok": True}
        assert seen == [rpc.ConfigureRequest(split="2/2", by="me")]
        assert ask(Op.INFO).meta == {"engine": "test"}
        assert ask(Op.PROBE, b"{}").status == Status.NOT_IMPLEMENTED
