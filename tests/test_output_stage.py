"""`--output-stage last`: the last peer holds the output norm, the output head and the MTP block (as
llama.cpp places them), the head holds neither. Real head and peer processes against a solo head:
the same tokens and logprobs bit for bit, MTP drafted and verified through the peer, sampled text
equal to the solo server's with the same seed; the peer's side refuses what does not fit its stage."""

from __future__ import annotations

import json
import socket

import pytest
import torch
from rpc_workers import MTP_EVERY_STEP, complete, engine_cli, solo_and_split, wait_for

from hydra_console.contracts.rpc import DraftAsk, LoadStageRequest, Op, Status
from hydra_console.engine.gguf_file import GGUFFile
from hydra_console.engine.model import ModelConfig, build_stage
from hydra_console.engine.rpc import wire
from hydra_console.engine.rpc.forward_frames import pack_forward_out, unpack_forward_out
from hydra_console.engine.rpc.resident import ComputeError, StageHost
from hydra_console.engine.rpc.wire import SocketReader

pytestmark = pytest.mark.integration

PROMPTS = ("hello world hello", "the cat sat on the", "a b a b a")


@pytest.fixture(scope="module")
def model(tiny_model):
    # `bigram`: the MTP block predicts the trunk's next token, so every greedy draft is right.
    return tiny_model("qwen35", n_layers=4, nextn=True, bigram=True)


@pytest.fixture(scope="module")
def ws(model, tmp_path_factory):
    """A solo head (no speculation), and a head whose one peer holds layers [2, 4), the output head
    and the MTP block (float32, all real processes)."""
    logs = tmp_path_factory.mktemp("output-stage-logs")
    with solo_and_split(model, logs, "--split", "2/2", "--output-stage", "last", *MTP_EVERY_STEP) as workers:
        yield workers


def choice(w, prompt: str, n: int, **kw) -> dict:
    r = complete(w, prompt, n, logprobs=1, cache_prompt=False, **kw)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_logits_from_the_last_peer_equal_solo_bit_for_bit(ws):
    for prompt in PROMPTS:
        got = choice(ws["head"], prompt, 12, speculative=False)
        want = choice(ws["solo"], prompt, 12)
        assert got["text"] == want["text"]
        assert got["logprobs"]["token_logprobs"] == want["logprobs"]["token_logprobs"]


def test_mtp_on_the_last_peer_drafts_and_every_draft_is_taken(ws):
    before = ws["head"].status()["speculative"]
    for prompt in PROMPTS:
        assert choice(ws["head"], prompt, 24)["text"] == choice(ws["solo"], prompt, 24)["text"]
    spec = ws["head"].status()["speculative"]
    drafted = spec["draft_tokens"] - before["draft_tokens"]
    assert spec["type"] == "mtp" and drafted > 20
    assert spec["accepted"] - before["accepted"] == drafted  # the block follows the target there
    assert spec["kv_bytes"] == 0  # the block's KV is the peer's


def test_greedy_steps_bring_back_each_rows_argmax_alone(ws, model):
    """A step whose rows are all read for their argmax (greedy, no logprobs, bias or penalty) gets
    4 bytes a row from the peer, not the row: the same text; a request with logprobs gets its rows."""
    n_vocab = ModelConfig.from_gguf(GGUFFile(model)).n_vocab

    def received(**kw) -> tuple[int, str]:
        before = ws["head"].status()["peers"][0]["bytes_recv"]
        r = complete(ws["head"], PROMPTS[1], 16, cache_prompt=False, **kw)
        assert r.status_code == 200, r.text
        return ws["head"].status()["peers"][0]["bytes_recv"] - before, r.json()["choices"][0]["text"]

    for spec in (False, True):  # plain decode steps, and verifies of MTP drafts
        before = ws["peer"].status()["resident"]
        argmax_bytes, text = received(speculative=spec)
        after = ws["peer"].status()["resident"]
        ahead, asked = (after[k] - before[k] for k in ("drafts_ahead", "drafts_asked"))
        # A greedy verify brings the slot's next draft with it: a DRAFT after the prompt, then (almost) none.
        assert (ahead >= 2 and ahead > asked >= 1) if spec else (ahead, asked) == (0, 0), (ahead, asked)
        row_bytes, text_with_rows = received(speculative=spec, logprobs=1)
        assert text == text_with_rows == choice(ws["solo"], PROMPTS[1], 16)["text"]
        assert argmax_bytes < 4 * n_vocab  # not even one row
        assert row_bytes >= 16 * 4 * n_vocab  # every step's rows


def test_a_live_resplit_keeps_the_output_on_the_last_peer(ws):
    """CONFIGURE moves the boundary: the peer loads its new range with the output head and the MTP
    block again, and the same tokens come out (its block starts empty: drafts refill it)."""
    for split, layers in (("3/1", [[0, 3], [3, 4]]), ("2/2", [[0, 2], [2, 4]])):
        with socket.create_connection(("127.0.0.1", ws["head"].rpc_port), timeout=120) as s:
            s.sendall(wire.pack_control_request(Op.CONFIGURE, json.dumps({"split": split}).encode()))
            reply = wire.read_control_response(SocketReader(s), 1 << 20)
        assert reply.status == Status.OK and reply.meta["layers"] == layers, reply.meta
        for prompt in PROMPTS[:2]:
            got = choice(ws["head"], prompt, 12, speculative=False)
            want = choice(ws["solo"], prompt, 12)
            assert (got["text"], got["logprobs"]["token_logprobs"]) == (
                want["text"],
                want["logprobs"]["token_logprobs"],
            )
            assert choice(ws["head"], prompt, 16)["text"] == choice(ws["solo"], prompt, 16)["text"]


def test_a_sampled_request_gives_the_solo_servers_text_for_its_seed(ws):
    body = dict(temperature=0.8, seed=1234)
    for prompt in PROMPTS[:2]:
        assert choice(ws["head"], prompt, 20, **body)["text"] == choice(ws["solo"], prompt, 20, **body)["text"]


def test_the_head_holds_no_output_head(ws, model):
    g = GGUFFile(model)
    held = ws["head"].status()["stages"][0]["weight_bytes"]
    assert held == build_stage(g, (0, 2), head=False, dtype="float32", n_ctx=256).held_weight_bytes
    assert held < build_stage(g, (0, 2), dtype="float32", n_ctx=256).held_weight_bytes  # what --output-stage head holds


def test_a_restarted_last_peer_is_loaded_with_the_output_again(ws):
    """SIGTERM and a new process on the same port (the console's restart): the head re-attaches it
    with LOAD_STAGE's output and MTP block, and the same tokens come out, drafted and verified."""
    p = ws["peer"]
    p.stop()
    p.start()
    p.wait_ready(120)
    wait_for(lambda: ws["head"].status()["peers"][0]["attaches"] == 2, 60, "the head to re-attach the peer")
    for prompt in PROMPTS[:2]:
        got = choice(ws["head"], prompt, 12, speculative=False)
        want = choice(ws["solo"], prompt, 12)
        assert (got["text"], got["logprobs"]["token_logprobs"]) == (want["text"], want["logprobs"]["token_logprobs"])
    before = ws["head"].status()["speculative"]["draft_tokens"]
    assert choice(ws["head"], PROMPTS[2], 16)["text"] == choice(ws["solo"], PROMPTS[2], 16)["text"]
    assert ws["head"].status()["speculative"]["draft_tokens"] > before


# --- the peer's side: what its stage cannot take is refused, naming why ---------------------------


@pytest.fixture(scope="module")
def host(model):
    g = GGUFFile(model)
    return StageHost(g, ModelConfig.from_gguf(g), "cpu")


def load(host, layers, **kw):
    request = LoadStageRequest(layers=list(layers), dtype="float32", n_slots=2, n_ctx=64, max_run=4, **kw)
    return host.load(request)


def test_only_the_last_stage_holds_the_output_and_the_mtp_block_goes_with_it(host, tiny_model):
    with pytest.raises(ComputeError, match=r"only the last stage holds it, \[0,2\) ends before 4"):
        load(host, (0, 2), output=True)
    with pytest.raises(ComputeError, match="the MTP block goes with the output head"):
        load(host, (2, 4), mtp=True)
    no_block = GGUFFile(tiny_model("qwen35", n_layers=4))
    with pytest.raises(ComputeError, match="no MTP block"):
        load(StageHost(no_block, ModelConfig.from_gguf(no_block), "cpu"), (2, 4), output=True, mtp=True)


def test_forward_out_and_draft_are_refused_by_a_stage_without_them(host):
    epoch = load(host, (2, 4)).epoch
    h, slots, pos = torch.zeros(2, host.cfg.n_embd), torch.tensor([0, 0]), torch.tensor([0, 1])
    with pytest.raises(ComputeError, match="holds no output head"):
        host.forward_out(epoch, h, slots, pos, torch.tensor([1]), None, False, ())
    with pytest.raises(ComputeError, match="holds no MTP block"):
        host.draft(DraftAsk(slots=[0], tokens=[1], positions=[0], ks=[3], p_mins=[0.0]))


def test_bad_drafts_and_token_ids_are_refused_before_anything_runs(host):
    epoch = load(host, (2, 4), output=True, mtp=True).epoch
    n_vocab = host.cfg.n_vocab
    for ask, why in (
        (DraftAsk(slots=[0, 1], tokens=[1], positions=[0, 0], ks=[3, 3], p_mins=[0.0, 0.0]), "one length"),
        (DraftAsk(slots=[1, 1], tokens=[1, 1], positions=[0, 0], ks=[3, 3], p_mins=[0.0, 0.0]), "twice for one slot"),
        (DraftAsk(slots=[2], tokens=[1], positions=[0], ks=[3], p_mins=[0.0]), "past this stage's 2"),
        (DraftAsk(resting=[5]), "past this stage's 2"),
        (DraftAsk(slots=[0], tokens=[n_vocab], positions=[0], ks=[3], p_mins=[0.0]), "token id out of range"),
        (DraftAsk(slots=[0], tokens=[1], positions=[62], ks=[3], p_mins=[0.0]), "past the slot's 64 positions"),
    ):
        with pytest.raises(ComputeError, match=why):
            host.draft(ask)
    h, slots, pos = torch.zeros(2, host.cfg.n_embd), torch.tensor([0, 0]), torch.tensor([0, 1])
    with pytest.raises(ComputeError, match="token id out of range"):
        host.forward_out(epoch, h, slots, pos, torch.tensor([1]), torch.tensor([1, n_vocab]), False, ())
    with pytest.raises(ComputeError, match="exactly when this stage holds the MTP block"):
        host.forward_out(epoch, h, slots, pos, torch.tensor([1]), None, False, ())
    logits, x, ahead = host.forward_out(epoch, h, slots, pos, torch.tensor([1]), torch.tensor([1, 2]), True, ())
    assert logits.shape == (1, n_vocab) and x.shape == (2, host.cfg.n_embd) and ahead == []
    rows = torch.tensor([0, 1])
    for bad, why in (
        ([(0, 1, 3, 0.0), (0, 1, 3, 0.0)], "name a slot twice"),
        ([(1, 0, 3, 0.0)], "0 drafted tokens need 1 logit rows"),
        ([(0, 2, 3, 0.0)], "2 drafted tokens need 3 logit rows"),
        ([(0, 1, 0, 0.0)], "k must be"),
        ([(0, 1, 3, float("nan"))], "p_min 0..1"),
    ):
        with pytest.raises(ComputeError, match=why):
            host.forward_out(epoch, h, slots, pos, rows, torch.tensor([1, 2]), False, bad)
    drafts = host.draft(DraftAsk(slots=[0], tokens=[3], positions=[2], ks=[3], p_mins=[0.0]))
    assert drafts.counts == [3] and len(drafts.tokens) == 3


def test_a_draft_ahead_is_the_draft_the_verified_outcome_would_ask_for(host):
    """Slot 0 verifies the greedy continuation of its prompt (every draft right: the bigram block),
    slot 1 a draft whose first token is wrong: each draft made ahead starts from the token the head's
    greedy verification emits last, at its position, and equals what DRAFT gives from there."""
    epoch = load(host, (2, 4), output=True, mtp=True).epoch
    g = host.g
    stage = build_stage(g, (0, 2), head=False, dtype="float32", n_slots=2, n_ctx=64)
    solo = build_stage(g, dtype="float32", n_slots=2, n_ctx=64)

    def greedy_next(ids):
        h = solo.run_layers(
            solo.embed(torch.tensor(ids)), torch.zeros(len(ids), dtype=torch.long), torch.arange(len(ids))
        )
        return int(solo.logits(h[-1:]).argmax())

    prompt = [5, 9, 2]
    cont = [greedy_next(prompt)]
    for _ in range(3):
        cont.append(greedy_next(prompt + cont))
    solo.kv_clear(0)
    # Both slots' prompts through the split, then one verify step: slot 0 [x, d1, d2] right, slot 1 wrong.
    for slot in (0, 1):
        ids = torch.tensor(prompt)
        h = stage.run_layers(stage.embed(ids), torch.full((3,), slot), torch.arange(3))
        host.forward_out(epoch, h, torch.full((3,), slot), torch.arange(3), torch.tensor([2]), ids, False, ())
    wrong = (cont[1] + 1) % host.cfg.n_vocab
    ids = torch.tensor([cont[0], cont[1], cont[2], cont[0], wrong])
    slots, pos = torch.tensor([0, 0, 0, 1, 1]), torch.tensor([3, 4, 5, 3, 4])
    h = stage.run_layers(stage.embed(ids), slots, pos)
    ahead = ((0, 2, 3, 0.0), (1, 1, 3, 0.0))
    _, _, drafts = host.forward_out(epoch, h, slots, pos, torch.arange(5), ids, False, ahead)
    assert [d[:2] for d in drafts] == [(6, cont[3]), (4, cont[1])]  # slot 0 took both; slot 1 none
    assert all(len(d[2]) == 3 for d in drafts)
    asked = host.draft(
        DraftAsk(slots=[0, 1], tokens=[cont[3], cont[1]], positions=[6, 4], ks=[3, 3], p_mins=[0.0, 0.0])
    )
    assert asked.tokens == drafts[0][2] + drafts[1][2]
    assert drafts[0][2] == [greedy_next(prompt + cont[:4])] + drafts[0][2][1:]  # the block's first guess is the trunk's


def frame(parts) -> bytes:
    return b"".join(bytes(memoryview(p).cast("B")) for p in parts)


def test_forward_out_frames_are_checked_against_their_own_batch():
    h, slots, pos = torch.zeros(3, 8), torch.tensor([0, 0, 0]), torch.tensor([0, 1, 2])
    ahead = ((0, 2, 3, 0.5),)
    good = frame(pack_forward_out(7, h, slots, pos, torch.tensor([2]), torch.tensor([4, 5, 6]), True, True, ahead))
    epoch, hidden, _, _, rows, tokens, want_hidden, argmax, got = unpack_forward_out(good)
    assert (epoch, hidden.shape, rows.tolist(), tokens.tolist(), want_hidden, argmax) == (
        7,
        (3, 8),
        [2],
        [4, 5, 6],
        True,
        True,
    )
    assert got == list(ahead)
    four = ((0, 1, 3, 0.0),) * 4
    with pytest.raises(ComputeError, match="4 drafts ahead of a 3-row batch"):
        unpack_forward_out(frame(pack_forward_out(7, h, slots, pos, torch.tensor([2]), None, False, False, four)))
    for bad, why in (
        (good[:-1], "needs"),
        (good + b"\0", "needs"),
        (frame(pack_forward_out(7, h, slots, pos, torch.tensor([3]), None, False)), "must index the batch's 3 rows"),
        (frame(pack_forward_out(7, h, slots, pos, torch.tensor([0, 1, 2, 0]), None, False)), "4 logit rows"),
        (frame(pack_forward_out(7, h, slots, pos, torch.tensor([0]), torch.tensor([1, -1, 2]), False)), ">= 0"),
    ):
        with pytest.raises(ComputeError, match=why):
            unpack_forward_out(bad)
    flags_at = len(frame(pack_forward_out(7, h, slots, pos, torch.zeros(0, dtype=torch.long), None, False))) - 4
    bad_flags = bytearray(frame(pack_forward_out(7, h, slots, pos, torch.zeros(0, dtype=torch.long), None, False)))
    bad_flags[flags_at] = 0x80
    with pytest.raises(ComputeError, match="flags 0x80"):
        unpack_forward_out(bytes(bad_flags))


def test_output_stage_last_needs_a_peer(model):
    out = engine_cli("serve", "--model", str(model), "--output-stage", "last", timeout=120)
    assert (
        out.returncode == 2
        and "--output-stage last puts the output head on the last peer: it needs --peer" in out.stderr
    )
