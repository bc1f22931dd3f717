"""Same text whatever the split and the batch, on the default model (Gemma 3 270M Q4_K_M) in the
default CPU configuration (bfloat16 compute, int8 weights), with real worker processes.

- By default a split equals solo for several split points: each stage runs the rows a solo head
  would, and the RPC wire carries the residual in its own dtype. Identical greedy choices of one
  request share every step, so they agree too. Both on CPU and, where there is one, on CUDA
  (`pytest -o addopts="" tests/test_deterministic.py` on a GPU machine).
- A token's floats depend on how many rows share its forward by default (the bfloat16 prefill copy
  above 16 rows, SDPA's blocking of a many-row run: engine/model/stage.py): `--deterministic`
  makes them independent of it, so 8 identical greedy requests in one batch (n-gram drafting on,
  prompt cache on) give one text, the solo one, logprobs bit for bit, through any split.
"""

from __future__ import annotations

import json
import socket
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from rpc_workers import complete, greedy, head, peer

from hydra_console.contracts.rpc import Op, Status
from hydra_console.engine.gguf_file import GGUFFile
from hydra_console.engine.model import build_stage
from hydra_console.engine.rpc import wire
from hydra_console.engine.rpc.wire import SocketReader

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
# Repeats, so n-gram drafts are made and partly accepted: verify steps of several rows per slot.
ECHO = "one two three four five six. one two three four five six. one two three"
N_CHOICES = 3  # one request keeps all slots but one in the engine (http/streaming.engine_share)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]
SPLITS = {"9/9": [[0, 9], [9, 18]], "11/7": [[0, 11], [11, 18]], "4/14": [[0, 4], [4, 18]]}


def configure(w, split: str) -> None:
    with socket.create_connection(("127.0.0.1", w.rpc_port), timeout=120) as s:
        s.sendall(wire.pack_control_request(Op.CONFIGURE, json.dumps({"split": split}).encode()))
        reply = wire.read_control_response(SocketReader(s), 1 << 20)
    assert reply.status == Status.OK, reply.meta
    assert reply.meta["layers"] == SPLITS[split]


def workers(default_model, logs, *flags: str, parallel: int = 2, device: str = "cpu"):
    """A solo head, a peer and a head split over it (9/9), all with `flags` on `device`."""
    solo = head(default_model, logs, (), "--dtype", "auto", *flags, parallel=parallel, ctx=512, device=device)
    p = peer(default_model, logs, device=device)
    split = head(default_model, logs, [p], "--split", "9/9", *flags, parallel=parallel, ctx=512, device=device)
    return solo, p, split


def serve_all(ws):
    try:
        for w in ws:
            w.wait_ready(300)
        yield ws
    finally:
        for w in ws:
            w.stop()


# The default model's shape (18 layers: the SPLITS; its width rounded up to the K-quants' 256-value
# blocks), synthetic: a GPU machine need not have the package.
GEMMA3_270M = dict(n_layers=18, n_embd=768, n_head=4, n_head_kv=1, head_dim=256, n_ff=2048, qtype="Q4_K_M")


@pytest.fixture(scope="module", params=DEVICES)
def default_workers(request, tiny_model, tmp_path_factory):
    """The default configuration: on CPU with the default model, and on CUDA where there is one
    (pytest -o addopts="" there) with a synthetic model of its shape."""
    logs = tmp_path_factory.mktemp(f"det-default-{request.param}")
    cpu = request.param == "cpu"
    model = request.getfixturevalue("default_model") if cpu else tiny_model("gemma3", **GEMMA3_270M)
    yield from serve_all(workers(model, logs, parallel=N_CHOICES + 1, device=request.param))


@pytest.fixture(scope="module")
def deterministic_workers(default_model, tmp_path_factory):
    flags = ("--deterministic", "--spec-type", "ngram")
    yield from serve_all(workers(default_model, tmp_path_factory.mktemp("det-on"), *flags, parallel=4))


def test_split_equals_solo_at_several_split_points(default_workers):
    solo, _, split = default_workers
    want = {prompt: greedy(solo, prompt) for prompt in PROMPTS}
    for point in SPLITS:
        configure(split, point)
        for prompt in PROMPTS:
            assert greedy(split, prompt) == want[prompt], (point, prompt)


def test_identical_greedy_choices_in_one_batch_give_one_text(default_workers):
    """The default configuration, CPU and CUDA (where --deterministic is refused): a request's `n`
    identical greedy choices are submitted together and share every step, so they give one text
    and one list of logprobs; through a split the same as solo's."""
    solo, _, split = default_workers

    def texts(w) -> set:
        r = complete(w, PROMPTS[0], 16, timeout=600, logprobs=1, n=N_CHOICES, cache_prompt=False)
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"]) == N_CHOICES
        return {(c["text"], tuple(c["logprobs"]["token_logprobs"])) for c in r.json()["choices"]}

    want = texts(solo)
    assert len(want) == 1, want
    configure(split, "4/14")
    assert texts(split) == want


def test_identical_requests_in_one_batch_give_the_solo_text(deterministic_workers):
    """8 at once on 4 slots: they share steps with each other's prompts and drafts, later ones
    start from the earlier ones' prompt cache; all through a split, then through another."""
    solo, _, split = deterministic_workers
    want = greedy(solo, ECHO, 24)
    for point in ("9/9", "4/14"):
        configure(split, point)
        with ThreadPoolExecutor(8) as pool:
            replies = list(pool.map(lambda _: complete(split, ECHO, 24, timeout=600, logprobs=1), range(8)))
        got = set()
        for r in replies:
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            got.add((choice["text"], tuple(choice["logprobs"]["token_logprobs"])))
        assert got == {(want[0], tuple(want[1]))}, (point, got)
    assert split.status()["config"]["model"]["deterministic"] is True
    spec = split.status()["speculative"]
    assert spec["draft_tokens"] > 0 and spec["accepted"] > 0, spec  # verify steps of several rows ran


def test_deterministic_stage_is_independent_of_prompt_chunks(tiny_model):
    """In one process: a prompt's last logits, bit for bit, however its tokens were split into
    forwards (one chunk, a cached prefix + the rest, token by token, a 4-row verify-sized tail)."""
    g = GGUFFile(tiny_model("gemma3", n_layers=2, n_embd=64, n_ff=128))
    ids = list(range(3, 43))
    for dtype in ("bfloat16", "float32"):
        stage = build_stage(g, dtype=dtype, n_slots=2, n_ctx=64, deterministic=True)

        def last_logits(slot, chunks):
            at, h = 0, None
            for n in chunks:
                h = stage.run_layers(stage.embed(torch.tensor(ids[at : at + n])), [slot] * n, range(at, at + n))
                at += n
            return stage.logits(h[-1:])

        want = last_logits(0, [len(ids)])
        for chunks in ([17, 23], [39, 1], [1] * 40, [36, 4]):
            assert torch.equal(last_logits(1, chunks), want), (dtype, chunks)


def test_deterministic_is_refused_where_it_cannot_hold(tiny_model):
    from hydra_console.engine.errors import UserError

    with pytest.raises(UserError, match="recurrent"):
        build_stage(GGUFFile(tiny_model("qwen35", n_layers=2)), deterministic=True, n_slots=1, n_ctx=16)
