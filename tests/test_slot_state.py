"""Slot state (contracts.slot_state + engine.slot_state): a slot saved from one stage continues,
bit for bit, in another; anything wrong is refused with a reason and leaves the target slot as it was."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import socket
import threading

import pytest
import torch

from hydra_console.contracts.slot_state import SlotStateError
from hydra_console.engine import slot_state
from hydra_console.engine.gguf_file import GGUFFile
from hydra_console.engine.model import build_stage

PROMPT = [1, 5, 9, 2, 7, 3, 8]


def stage(path, layers=None, n_ctx=32):
    return build_stage(GGUFFile(path), layers, device="cpu", dtype="float32", n_slots=3, n_ctx=n_ctx)


def prefill(st, slot, tokens):
    n = len(tokens)
    h = st.run_layers(st.embed(torch.tensor(tokens)), torch.full((n,), slot), torch.arange(n))
    return st.logits(h[-1:])


def decode(st, slot, token, pos):
    h = st.run_layers(st.embed(torch.tensor([token])), torch.tensor([slot]), torch.tensor([pos]))
    return st.logits(h)


def saved(st, slot, tokens, fingerprint) -> bytes:
    return bytes(slot_state.save(st, slot, tokens, fingerprint))


def test_a_restored_slot_continues_bit_for_bit(tiny_model):
    path = tiny_model("llama")
    fp = GGUFFile(path).fingerprint
    a, b = stage(path), stage(path)
    nxt = prefill(a, 0, PROMPT).argmax(-1).item()
    blob = saved(a, 0, PROMPT, fp)
    assert slot_state.restore(b, 2, slot_state.Reader(blob), fp) == PROMPT
    assert torch.equal(decode(a, 0, nxt, len(PROMPT)), decode(b, 2, nxt, len(PROMPT)))


def test_a_peer_stage_moves_only_its_layers(tiny_model):
    path = tiny_model("llama", n_layers=4)
    fp = GGUFFile(path).fingerprint
    head, peer = stage(path, (0, 2)), stage(path, (2, 4))
    blob = saved(peer, 1, PROMPT[:3], fp)
    with pytest.raises(SlotStateError, match=r"holds layers \[2, 4\], this stage holds \[0, 2\]"):
        slot_state.restore(head, 1, slot_state.Reader(blob), fp)
    other = stage(path, (2, 4))
    assert slot_state.restore(other, 0, slot_state.Reader(blob), fp) == PROMPT[:3]


@pytest.mark.parametrize(
    "spoil, reason",
    [
        (lambda b: b[:-40], "truncated"),
        (lambda b: b[:-9] + bytes([b[-9] ^ 1]) + b[-8:], "checksum"),
        (lambda b: b"XX" + b[2:], "bad magic"),
    ],
)
def test_a_damaged_state_is_refused_and_the_slot_is_untouched(tiny_model, spoil, reason):
    path = tiny_model("llama")
    fp = GGUFFile(path).fingerprint
    src, dst = stage(path), stage(path)
    prefill(src, 0, PROMPT)
    prefill(dst, 1, PROMPT[::-1])
    before = {k: v.clone() for k, v in dst.slot_state(1, len(PROMPT)).items()}
    with pytest.raises(SlotStateError, match=reason):
        slot_state.restore(dst, 1, slot_state.Reader(spoil(saved(src, 0, PROMPT, fp))), fp)
    assert all(torch.equal(before[k], v) for k, v in dst.slot_state(1, len(PROMPT)).items())


def test_wrong_model_dtype_or_size_is_refused(tiny_model):
    path = tiny_model("llama")
    fp = GGUFFile(path).fingerprint
    src = stage(path)
    prefill(src, 0, PROMPT)
    blob = saved(src, 0, PROMPT, fp)
    with pytest.raises(SlotStateError, match="of model"):
        slot_state.restore(stage(path), 0, slot_state.Reader(blob), "another-model")
    with pytest.raises(SlotStateError, match="exceeds this stage's context"):
        slot_state.restore(stage(path, n_ctx=4), 0, slot_state.Reader(blob), fp)
    bf16 = build_stage(GGUFFile(path), device="cpu", dtype="bfloat16", n_slots=1, n_ctx=32)
    with pytest.raises(SlotStateError, match="computes in bfloat16"):
        slot_state.restore(bf16, 0, slot_state.Reader(blob), fp)
    with pytest.raises(SlotStateError, match="does not exist"):
        slot_state.restore(stage(path), 7, slot_state.Reader(blob), fp)


def test_slots_save_erase_restore_over_http(tiny_model, tmp_path):
    """llama-server's POST /slots/{id}?action=…: a restored slot's prompt is reused, not recomputed."""
    import httpx
    from rpc_workers import complete, head, running

    prompt = "the quick brown fox jumps over the lazy dog"
    with running(
        head(tiny_model("llama"), tmp_path, (), "--dtype", "float32", "--slot-save-path", str(tmp_path), parallel=1)
    ) as w:
        first = complete(w, prompt, 6).json()

        def act(action, **body):
            return httpx.post(f"{w.url}/slots/0", params={"action": action}, json=body or None, timeout=30)

        saved = act("save", filename="s.bin").json()
        assert saved["n_saved"] > 0 and saved["n_written"] == (tmp_path / "s.bin").stat().st_size
        assert act("erase").json()["n_erased"] == saved["n_saved"]
        assert act("restore", filename="s.bin").json()["n_restored"] == saved["n_saved"]
        again = complete(w, prompt, 6).json()
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        assert again["timings"]["cache_n"] > 0
        for body, code in (({"filename": "../x"}, 400), ({"filename": "missing.bin"}, 404)):
            r = act("restore", **body)
            assert r.status_code == code and r.json()["error"]["param"] == "filename"
        (tmp_path / "bad.bin").write_bytes(b"HYSLOT\x00\x01" + b"\xff" * 12)
        assert act("restore", filename="bad.bin").status_code == 400


def test_id_slot_pins_a_request_to_its_slot_over_http(tiny_model, tmp_path):
    """llama-server's id_slot: the request runs in that slot (its save then holds the prompt), choices
    pinned to one slot take turns in it, and a slot that does not exist is a 400 naming id_slot."""
    import httpx
    from rpc_workers import head, running

    with running(
        head(tiny_model("llama"), tmp_path, (), "--dtype", "float32", "--slot-save-path", str(tmp_path), parallel=2)
    ) as w:

        def post(path, body):
            return httpx.post(f"{w.url}{path}", json=body, timeout=60)

        done = post("/completion", {"prompt": "the quick brown fox", "n_predict": 4, "id_slot": 1}).json()
        assert done["id_slot"] == 1
        assert post("/slots/1?action=save", {"filename": "one.bin"}).json()["n_saved"] > 0
        assert post("/slots/0?action=save", {"filename": "zero.bin"}).json()["n_saved"] == 0  # never used
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "n": 2, "id_slot": 0}
        for _ in range(2):  # both choices want slot 0: one waits for the other, nothing locks up
            r = post("/v1/chat/completions", chat)
            assert r.status_code == 200 and len(r.json()["choices"]) == 2
        assert post("/slots/0?action=save", {"filename": "zero.bin"}).json()["n_saved"] > 0
        for path, body in (
            ("/completion", {"prompt": "x"}),
            ("/v1/completions", {"prompt": "x"}),
            ("/v1/chat/completions", chat),
        ):
            for bad in (2, -2):
                r = post(path, {**body, "id_slot": bad})
                assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", (path, bad)


def test_states_regroup_to_another_split_and_continue_bit_for_bit(tiny_model):
    """A whole-model state (a prefill worker's) placed on a head [0,1) and a peer [1,4), and back."""
    path = tiny_model("llama", n_layers=4)
    fp = GGUFFile(path).fingerprint
    full = stage(path, (0, 4))
    nxt = prefill(full, 0, PROMPT).argmax(-1).item()
    states = slot_state.read_all(saved(full, 0, PROMPT, fp))
    head_part, peer_part = slot_state.regroup(states, [(0, 1), (1, 4)])
    head, peer = stage(path, (0, 1)), stage(path, (1, 4))
    assert slot_state.restore(head, 2, slot_state.Reader(head_part), fp) == PROMPT
    assert slot_state.restore(peer, 2, slot_state.Reader(peer_part), fp) == PROMPT
    x = full.embed(torch.tensor([nxt]))
    one = lambda st, h, slot: st.run_layers(h, torch.tensor([slot]), torch.tensor([len(PROMPT)]))  # noqa: E731
    assert torch.equal(one(full, x, 0), one(peer, one(head, x, 2), 2))
    again = slot_state.regroup(slot_state.read_all(bytes(head_part) + bytes(peer_part)), [(0, 4)])
    assert slot_state.read_all(again[0])[0][0].layers == [0, 4]
    with pytest.raises(SlotStateError, match="lack layers"):
        slot_state.regroup(slot_state.read_all(head_part), [(0, 4)])


def test_states_in_device_buffers_are_placed_and_continue_bit_for_bit(tiny_model):
    """The CUDA IPC hand-off's form of a state (slot_state.device_states: one buffer per range,
    here on the CPU): the head's range is placed from the buffer, a peer's is packed into bytes
    for its STATE_PUT; both continue exactly as the stage they came from."""
    from hydra_console.engine.pipeline import Pipeline

    path = tiny_model("llama", n_layers=4)
    fp = GGUFFile(path).fingerprint
    full = stage(path, (0, 4))
    nxt = prefill(full, 0, PROMPT).argmax(-1).item()
    states = slot_state.device_states(full, 0, PROMPT, fp, [(0, 1), (1, 4)])
    assert [(h.layers, body.numel()) for h, body in states] == [
        ([0, 1], states[0][0].body_bytes),
        ([1, 4], states[1][0].body_bytes),
    ]
    head, peer = stage(path, (0, 1)), stage(path, (1, 4))
    pipeline = Pipeline(head, ranges=[(0, 1), (1, 4)])
    prepared = pipeline.prepare_state(states, PROMPT)
    assert pipeline.place_state(2, prepared) == PROMPT
    assert slot_state.restore(peer, 2, slot_state.Reader(prepared.peer_states[0]), fp) == PROMPT
    x = full.embed(torch.tensor([nxt]))
    one = lambda st, h, slot: st.run_layers(h, torch.tensor([slot]), torch.tensor([len(PROMPT)]))  # noqa: E731
    assert torch.equal(one(full, x, 0), one(peer, one(head, x, 2), 2))
    with pytest.raises(SlotStateError, match="this pipeline holds"):
        Pipeline(head, ranges=[(0, 2), (2, 4)]).prepare_state(states, PROMPT)
    with pytest.raises(SlotStateError, match="lacks layers"):
        slot_state.device_states(head, 2, PROMPT, fp, [(0, 4)])


def test_states_packed_per_range_are_what_regroup_makes_in_place_when_they_fit(tiny_model):
    """A prefill worker's PREFILL answer (slot_state.save_ranges): one state per range asked for,
    byte for byte what regrouping its whole state makes; back to back from the start of memory
    shared with the asker when they fit there, else in buffers of their own."""
    path = tiny_model("llama", n_layers=4)
    fp = GGUFFile(path).fingerprint
    full = stage(path, (0, 4))
    prefill(full, 0, PROMPT)
    ranges = [(0, 1), (1, 4)]
    want = [bytes(p) for p in slot_state.regroup(slot_state.read_all(saved(full, 0, PROMPT, fp)), ranges)]
    shared = bytearray(sum(map(len, want)) + 10)
    parts = slot_state.save_ranges(full, 0, PROMPT, fp, ranges, into=memoryview(shared))
    assert [bytes(p) for p in parts] == want and bytes(shared[: sum(map(len, want))]) == b"".join(want)
    small = bytearray(sum(map(len, want)) - 1)
    parts = slot_state.save_ranges(full, 0, PROMPT, fp, ranges, into=memoryview(small))
    assert [bytes(p) for p in parts] == want and not any(small)


def test_a_state_handed_over_by_cuda_ipc_is_checked_before_it_is_mapped():
    """open_states judges the header (its checksum, its body's size) before mapping any memory."""
    from zlib_ng.zlib_ng import crc32

    from hydra_console.contracts.slot_state import SlotHeader, TensorEntry
    from hydra_console.engine.rpc.cuda_ipc import open_states

    raw = SlotHeader(
        "fp", [0, 1], [1, 2], "float32", "float32", [TensorEntry("blk.0.k", [1, 2, 4], "float32", 32)]
    ).to_json()
    good = {"header": raw.decode(), "header_crc": crc32(raw), "body": {"shape": [32]}}
    gpu = torch.device("cuda", 0)
    with pytest.raises(SlotStateError, match="fails its checksum"):
        open_states([{**good, "header_crc": crc32(raw) ^ 1}], gpu)
    with pytest.raises(SlotStateError, match=r"body of \[31\] bytes, the header names 32"):
        open_states([{**good, "body": {"shape": [31]}}], gpu)
    with pytest.raises(SlotStateError, match="malformed"):
        open_states([{"header": raw.decode()}], gpu)


def _mtp_engine(path, spec_type: str):
    from stages import load

    from hydra_console.engine.config import ModelSettings, SpecConfig
    from hydra_console.engine.pipeline import Pipeline
    from hydra_console.engine.serving.runtime import Engine
    from hydra_console.engine.spec import build_speculator
    from hydra_console.engine.text.tokenizer import Tokenizer

    g = GGUFFile(path)
    st = load(path, n_slots=1, n_ctx=128)
    # A fixed k: the engines must draft alike (adaptive lengths follow each engine's own timings).
    cfg = SpecConfig(type=spec_type, n_max=3, p_min=0.0, adaptive=False)
    spec = build_speculator(cfg, None, g, ModelSettings(None, "cpu", "float32", 128), 1, head=st)
    return Engine(Pipeline(st), Tokenizer.from_gguf(g), 1, 128, speculator=spec).start()


def _greedy(eng, prompt: list[int], n: int) -> list[int]:
    from hydra_console.engine.serving.sampling_params import SamplingParams
    from hydra_console.engine.serving.sequence import Request

    req = Request(prompt, SamplingParams(temperature=0.0), max_tokens=n, ignore_eos=True)
    return [t.id for ev in eng.generate(req, timeout=120) for t in ev.tokens]


def _saved_slot(eng) -> bytes:
    parts = []
    eng.save_slot(0, parts.append)
    return b"".join(parts)


def _draft_logits(eng, n: int, token: int) -> torch.Tensor:
    """The MTP block's logits for `token` at position n of slot 0: its KV of positions < n and the
    trunk's h at n - 1, as the slot holds them."""
    d = eng.spec.mtp
    h = d.nextn.run(torch.tensor([token]), d._h_before(0, n)[None], torch.zeros(1, dtype=torch.long), torch.tensor([n]))
    return d.nextn.logits(h)


def test_the_mtp_blocks_state_moves_with_the_slot(tiny_model):
    """qwen35 with its MTP block: a saved slot carries the block's own KV and the trunk's last h
    (`mtp.*`), so after a restore in a fresh engine the block drafts exactly as in the engine that
    saved it, and greedy with MTP continues as without the restore, draft for draft. A state saved
    without MTP restores too, but then the block's state is not there (drafts differ)."""
    path = tiny_model("qwen35", n_layers=4, nextn=True)
    prompt, more = [5, 17, 300, 45, 99, 512, 7], 9
    src, dst, plain_src, plain_dst = (_mtp_engine(path, t) for t in ("mtp", "mtp", "off", "mtp"))
    try:
        first = _greedy(src, prompt, 8)
        assert _greedy(plain_src, prompt, 8) == first
        blob = _saved_slot(src)
        held = prompt + first[:-1]  # the slot's prompt cache: the last token was never run
        assert [h.name for h in slot_state.read_all(blob)[0][0].tensors][-3:] == ["mtp.k", "mtp.v", "mtp.h"]
        assert dst.restore_slot(0, blob) == len(held)
        assert plain_dst.restore_slot(0, _saved_slot(plain_src)) == len(held)
        want = _draft_logits(src, len(held), first[-1])
        assert torch.equal(_draft_logits(dst, len(held), first[-1]), want)
        assert not torch.allclose(_draft_logits(plain_dst, len(held), first[-1]), want, atol=1e-3)

        before = src.spec_stats.snapshot()
        cont = prompt + first + [more]
        assert _greedy(dst, cont, 12) == _greedy(src, cont, 12)
        after, moved = src.spec_stats.snapshot(), dst.spec_stats.snapshot()
        assert moved.drafts > 0 and moved.draft_tokens == after.draft_tokens - before.draft_tokens
        assert moved.accepted == after.accepted - before.accepted
    finally:
        for eng in (src, dst, plain_src, plain_dst):
            eng.stop()


def test_state_buffers_are_reused_only_once_released():
    pool = slot_state.Buffers(keep=2)
    a = pool.take(1000)
    b = pool.take(1000)
    assert a.obj is not b.obj  # both in use
    kept = id(a.obj)
    del a
    c = pool.take(800)
    assert id(c.obj) == kept and len(c) == 800  # released: handed out again
    assert pool.take(5000).obj not in (c.obj, b.obj)


@pytest.mark.unit
def test_the_header_and_table_carry_their_own_checksum_and_version_1_is_refused_by_name():
    from hydra_console.contracts.slot_state import CHUNK_BYTES, MAGIC, SlotHeader, TensorEntry

    body = bytes(range(256)) * (CHUNK_BYTES // 128 + 3)  # three chunks, the last one short
    header = SlotHeader(
        "fp", [0, 1], [7, 8, 9], "float32", "float32", [TensorEntry("blk.0.k", [len(body) // 4], "float32", len(body))]
    )
    blob = slot_state.pack(header, [memoryview(body)])
    assert header.n_chunks == 3 and header.prefix_bytes % 64 == 0 and bytes(blob[header.prefix_bytes :]) == body
    ((got, body_view, _),) = slot_state.read_all(bytes(blob))
    assert got == header and bytes(body_view) == body
    spoiled = bytes(blob).replace(b"[7,8,9]", b"[7,8,8]")  # another token, same length: only the checksum sees it
    with pytest.raises(SlotStateError, match="header fails its checksum"):
        slot_state.read_all(spoiled)
    raw = json.dumps({**dataclasses.asdict(header), "version": 1}).encode()  # a file of the first format
    with pytest.raises(SlotStateError, match="slot state version 1, this worker reads 2"):
        slot_state.read_all(MAGIC + len(raw).to_bytes(4, "little") + raw + body)


def _multi_chunk_state() -> tuple[object, bytes]:
    """(header, state) of four chunks of raw bytes: the checks of the stream, not of a stage."""
    from hydra_console.contracts.slot_state import CHUNK_BYTES, SlotHeader, TensorEntry

    body = bytes(range(256)) * (CHUNK_BYTES // 64)
    header = SlotHeader(
        "fp", [0, 1], [7, 8, 9], "float32", "float32", [TensorEntry("blk.0.k", [len(body) // 4], "float32", len(body))]
    )
    return header, bytes(slot_state.pack(header, [memoryview(body)]))


def _send(sock, data: bytes) -> None:
    with contextlib.suppress(OSError):  # the reader may stop early and close
        sock.sendall(data)


@pytest.mark.unit
def test_a_state_from_a_socket_is_checked_as_it_arrives_and_a_bad_chunk_stops_it_there():
    from hydra_console.contracts.slot_state import CHUNK_BYTES
    from hydra_console.engine.rpc.wire import SocketReader

    header, blob = _multi_chunk_state()
    spoiled = bytearray(blob)
    spoiled[header.prefix_bytes + CHUNK_BYTES + 5] ^= 1  # in the second chunk
    a, b = socket.socketpair()
    with a, b:
        threading.Thread(target=_send, args=(a, blob + blob), daemon=True).start()  # a pipeline's two states
        reader = SocketReader(b)
        states = slot_state.read_all(bytearray(2 * len(blob)), reader.read_into)
        assert [bytes(raw) for *_, raw in states] == [blob, blob] and reader.bytes_in == 2 * len(blob)
        threading.Thread(target=_send, args=(a, bytes(spoiled)), daemon=True).start()
        with pytest.raises(SlotStateError, match=f"chunk at byte {CHUNK_BYTES} fails its checksum"):
            slot_state.read_all(bytearray(len(spoiled)), SocketReader(b).read_into)
        b.settimeout(10)
        assert b.recv(1)  # refused when it arrived: the rest (more than the socket holds) is still to come
