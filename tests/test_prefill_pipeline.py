"""Pipelined prefill across stages (--prefill-pipeline): a prompt's chunks before its last go to the
last peer as FORWARD_ACK (FORWARD_OUT with no rows where its MTP block follows them) and the head computes the next chunk meanwhile. The math must be the
unpipelined one, chunk by chunk: float32 logits equal exactly (pipelined, unpipelined, solo), for
attention KV and for qwen35's recurrent state; a peer lost mid-pipeline fails the prompt with
PeerUnavailable (HTTP 503), never a hang. Real peer processes on loopback."""

from __future__ import annotations

import time

import pytest
import torch
from rpc_workers import greedy, head, peer, running, wait_for

from hydra_console.contracts.rpc import DraftAsk
from hydra_console.engine.cli import build_parser
from hydra_console.engine.cli_config import head_config
from hydra_console.engine.gguf_file import GGUFFile
from hydra_console.engine.model import ModelConfig, build_stage
from hydra_console.engine.pipeline import Pipeline
from hydra_console.engine.rpc.client import PeerUnavailable
from hydra_console.engine.workers.head_pipeline import build_pipeline

PROMPT, CHUNK, DECODE = 100, 16, 4
SHAPES = {
    "llama": dict(n_layers=4, n_embd=64, n_ff=128),
    "qwen35": dict(n_layers=4, n_embd=64, n_ff=128, full_attention_interval=2),
}


def split_pipeline(model, addr: str, *flags: str) -> Pipeline:
    """The head's side of `serve --peer addr` in this process, float32 on the CPU."""
    argv = ["serve", "--model", str(model), "--peer", addr, "--split", "2/2", "--device", "cpu"]
    argv += ["--dtype", "float32", "--parallel", "2", "--ctx", "256", "--peer-wait", "60", *flags]
    g = GGUFFile(model)
    return build_pipeline(
        head_config(build_parser().parse_args(argv), {"HYDRA_CACHE_DIR": "off"}), g, ModelConfig.from_gguf(g)
    )


def prefill_then_decode(pipe: Pipeline, slot: int, tokens: torch.Tensor) -> list[torch.Tensor]:
    """The prompt in CHUNK-token forwards as the scheduler's steps run it (rows only for the last
    chunk), then DECODE greedy steps: every logits row the engine would read."""
    n, out = len(tokens), []
    for start in range(0, n, CHUNK):
        end = min(n, start + CHUNK)
        rows = torch.tensor([end - start - 1]) if end == n else torch.zeros(0, dtype=torch.long)
        logits = pipe.forward(tokens[start:end], torch.full((end - start,), slot), torch.arange(start, end), rows)
        assert logits.shape[0] == (1 if end == n else 0)
    out.append(logits)
    for i in range(DECODE):
        tok = logits.argmax(-1)
        logits = pipe.forward(tok, torch.tensor([slot]), torch.tensor([n + i]), None)
        out.append(logits)
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen35"])
def test_pipelined_prefill_logits_equal_unpipelined_and_solo(tiny_model, tmp_path, request, arch):
    model = tiny_model(arch, **SHAPES[arch])
    tokens = torch.randint(3, 200, (PROMPT,), generator=torch.Generator().manual_seed(1))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers run (OMP_NUM_THREADS=1): the same sums in the same order
    request.addfinalizer(lambda: torch.set_num_threads(threads))
    with running(peer(model, tmp_path, "--dtype", "float32")) as p:
        split = split_pipeline(model, p.rpc_addr, "--prefill-pipeline", "2")
        try:
            remote = split.remotes[0]
            pipelined = prefill_then_decode(split, 0, tokens)
            assert remote.pipelined == -(-PROMPT // CHUNK) - 1  # every chunk but the last went unanswered
            remote.pipeline_depth = 0  # --prefill-pipeline 0: each chunk waits for the peer
            unpipelined = prefill_then_decode(split, 1, tokens)
            assert remote.pipelined == -(-PROMPT // CHUNK) - 1
            assert remote.status().pipelined == remote.pipelined
        finally:
            split.stop()
    g = GGUFFile(model)
    solo = Pipeline(build_stage(g, device="cpu", dtype=torch.float32, n_slots=1, n_ctx=256))
    alone = prefill_then_decode(solo, 0, tokens)
    for a, b, c in zip(pipelined, unpipelined, alone):
        assert torch.equal(a, b) and torch.equal(a, c)


def top_probability(remote, slot: int, at: int, bits: int = 20) -> float:
    """The top-10 probability of the MTP block's one-token draft from position `at` (its KV before
    `at` read), to 2^-bits, through DRAFT's p-min cut: the draft comes back whole at or above it. A
    draft's argmax barely depends on the KV of a small random block; its probability does."""
    lo, hi = 0.0, 1.0
    for _ in range(bits):
        mid = (lo + hi) / 2
        if remote.draft(DraftAsk(slots=[slot], tokens=[7], positions=[at], ks=[1], p_mins=[mid]))[0]:
            lo = mid
        else:
            hi = mid
    return lo


def test_a_last_peer_with_the_mtp_block_pipelines_and_its_block_follows_every_chunk(tiny_model, tmp_path, request):
    """`--output-stage last` with MTP (the users' layout that fits their cards): the block on the
    peer follows every batch, so pipelined chunks carry their token ids (FORWARD_OUT asking no rows).
    The logits equal the unpipelined run's, and so does the block's draft probability read over the
    prompt's KV (every chunk's)."""
    model = tiny_model("qwen35", **SHAPES["qwen35"], nextn=True)
    tokens = torch.randint(3, 200, (PROMPT,), generator=torch.Generator().manual_seed(4))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    request.addfinalizer(lambda: torch.set_num_threads(threads))
    flags = ("--output-stage", "last", "--spec-type", "mtp", "--draft-p-min", "0", "--prefill-pipeline", "2")
    with running(peer(model, tmp_path, "--dtype", "float32")) as p:
        split = split_pipeline(model, p.rpc_addr, *flags)
        try:
            remote = split.remotes[0]
            assert remote.mtp and split.output_remote is remote
            runs, probes = [], []
            for slot, depth in ((0, 2), (1, 0)):  # pipelined, then each chunk waiting for the peer
                remote.pipeline_depth = depth
                runs.append(prefill_then_decode(split, slot, tokens))
                probes.append(top_probability(remote, slot, PROMPT - CHUNK // 2))
            assert remote.pipelined == -(-PROMPT // CHUNK) - 1
        finally:
            split.stop()
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    assert probes[0] == probes[1] and 0 < probes[0] < 1


def test_a_peer_lost_mid_pipeline_fails_the_prompt_cleanly(tiny_model, tmp_path):
    model = tiny_model("llama", **SHAPES["llama"])
    tokens = torch.randint(3, 200, (PROMPT,), generator=torch.Generator().manual_seed(2))
    p = peer(model, tmp_path, "--dtype", "float32")
    with running(p):
        # --peer-grace 1: the same pause for the lost peer, then the failure, without the default's 15 s idle
        split = split_pipeline(model, p.rpc_addr, "--peer-grace", "1")
        try:
            for start in range(0, 3 * CHUNK, CHUNK):  # three chunks sent, none answered yet
                end = start + CHUNK
                split.forward(
                    tokens[start:end],
                    torch.zeros(CHUNK, dtype=torch.long),
                    torch.arange(start, end),
                    torch.zeros(0, dtype=torch.long),
                )
            assert split.remotes[0].pipelined == 3
            p.kill9()
            t0 = time.monotonic()
            with pytest.raises(PeerUnavailable, match=p.rpc_addr):
                split.forward(
                    tokens[3 * CHUNK :],
                    torch.zeros(PROMPT - 3 * CHUNK, dtype=torch.long),
                    torch.arange(3 * CHUNK, PROMPT),
                    torch.tensor([PROMPT - 3 * CHUNK - 1]),
                )
            assert time.monotonic() - t0 < 30
            assert split.remotes[0].state == "down" and split.unavailable()
        finally:
            split.stop()


def test_an_abandoned_pipeline_is_read_by_the_watchers_ping(tiny_model, tmp_path):
    """A prompt cancelled mid-pipeline leaves replies unread: the ping skips them while a prompt may
    still be flowing (its own next step reads them), then reads them (PIPELINE_IDLE_S), and the
    session serves on."""
    model = tiny_model("llama", **SHAPES["llama"])
    tokens = torch.randint(3, 200, (PROMPT,), generator=torch.Generator().manual_seed(3))
    with running(peer(model, tmp_path, "--dtype", "float32")) as p:
        split = split_pipeline(model, p.rpc_addr)
        try:
            remote = split.remotes[0]
            for start in (0, CHUNK):
                end = start + CHUNK
                slots, rows = torch.zeros(CHUNK, dtype=torch.long), torch.zeros(0, dtype=torch.long)
                split.forward(tokens[start:end], slots, torch.arange(start, end), rows)
            assert remote.pipelined == 2 and remote.ping() is None  # replies pending, the prompt may go on
            wait_for(lambda: remote.ping() is not None, 60, "the ping to read the abandoned replies")
            assert remote.state == "up"
            split.clear_slot(0)
            assert prefill_then_decode(split, 0, tokens)[0].shape == (1, split.cfg.n_vocab)
        finally:
            split.stop()


def test_serve_pipelines_a_long_prompt_and_answers_as_solo(tiny_model, tmp_path):
    """Through the engine (scheduler chunks of -b 8 tokens both, default --prefill-pipeline): the
    split head's greedy text and logprobs equal the solo head's, and the peer saw pipelined chunks."""
    model = tiny_model("llama", **SHAPES["llama"])
    prompt = "the cat sat on the mat and the dog sat on the log " * 4
    flags = ("-b", "8", "--dtype", "float32")
    p = peer(model, tmp_path, "--dtype", "float32")
    with (
        running(head(model, tmp_path, (), *flags)) as solo,
        running(p),
        running(head(model, tmp_path, [p], *flags)) as split,
    ):
        assert greedy(split, prompt) == greedy(solo, prompt)
        assert split.status()["peers"][0]["pipelined"] > 0
