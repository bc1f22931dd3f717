"""P/D on one GPU: a prefill worker and a decode head on the same CUDA device hand the prompt state
over by CUDA IPC (PREFILL answers device-buffer handles, the head copies device to device), and
greedy output matches the head's own prefill. Runs only where torch sees a CUDA device."""

from __future__ import annotations

import pytest
import torch
from rpc_workers import Worker, free_ports, greedy, head, peer, running

from hydra_console.engine import slot_state
from hydra_console.engine.gguf_file import GGUFFile
from hydra_console.engine.model import build_stage
from hydra_console.engine.pipeline import Pipeline

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = ("--device", "cuda", "--dtype", "float32")
LONG = "the quick brown fox jumps over the lazy dog and keeps running far away " * 3
SHAPE = {"n_layers": 4}
PROMPT = [1, 5, 9, 2, 7, 3, 8, 11, 4]


def test_device_states_place_on_the_gpu_and_continue_bit_for_bit(tiny_model):
    """The buffers a prefill worker exports (one per range, on the device) placed device to device."""
    path = tiny_model("llama", n_layers=4)
    g = GGUFFile(path)
    a, b = (build_stage(g, device="cuda", dtype="float32", n_slots=2, n_ctx=64) for _ in range(2))
    n = len(PROMPT)
    h = a.run_layers(a.embed(torch.tensor(PROMPT)), torch.zeros(n, dtype=torch.long), torch.arange(n))
    nxt = int(a.logits(h[-1:]).argmax(-1))
    states = slot_state.device_states(a, 0, PROMPT, g.fingerprint, [(0, 4)])
    assert states[0][1].is_cuda
    assert Pipeline(b).place_state(1, states, PROMPT) == PROMPT

    def step(st, slot):
        return st.logits(st.run_layers(st.embed(torch.tensor([nxt])), torch.tensor([slot]), torch.tensor([n])))

    assert torch.equal(step(a, 0), step(b, 1))


def prefill_worker(model, log_dir) -> Worker:
    port, rpc = free_ports(2)
    argv = ["--model", str(model), *CUDA, "--parallel", "2", "--ctx", "256", "--role", "prefill"]
    return Worker("serve", argv, log_dir, port, rpc)


def test_pd_on_one_gpu_moves_the_state_by_cuda_ipc_solo_and_split(tiny_model, tmp_path):
    model = tiny_model("llama", **SHAPE)
    prompts = [LONG + str(i) for i in range(2)]
    with running(prefill_worker(model, tmp_path)) as pw:
        with running(head(model, tmp_path, (), *CUDA)) as ref:
            want = [greedy(ref, p, 12) for p in prompts]
        pd_flags = ("--prefill-worker", pw.rpc_addr, "--prefill-threshold", "8")
        with running(head(model, tmp_path, (), *CUDA, *pd_flags)) as solo:
            got = [greedy(solo, p, 12) for p in prompts]
            pd = solo.status()["pd"]
        with (
            running(peer(model, tmp_path, *CUDA)) as p,
            running(head(model, tmp_path, [p], *CUDA, *pd_flags, "--split", "2/2")) as split,
        ):
            got_split = [greedy(split, p_, 12) for p_ in prompts]
            pd_split = split.status()["pd"]
            assert (
                p.status()["resident"]["state_bytes_in"] > 0
            )  # the peer's layers: packed from the device buffer, STATE_PUT
    for stats in (pd, pd_split):
        assert stats["transfers"] == 2 and stats["fallbacks"] == 0 and stats["bytes"] > 0
        assert {t["transport"] for t in stats["recent"]} == {"cuda-ipc"}
    for (text, logprobs), (want_text, want_logprobs) in zip(got + got_split, want + want):
        # Prefilled in another process (the same kernels, another batch shape for the last token).
        assert text == want_text
        assert max(abs(x - y) for x, y in zip(logprobs, want_logprobs)) < 1e-3
