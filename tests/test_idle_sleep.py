"""`--sleep-idle-seconds` on real processes (workers/idle_sleep.py, http/wake.py): the head frees its
model after the idle time, says so in /props and /status, answers the observation routes without
waking, and the next request loads the model again and gives the same greedy text; split, the
peer keeps its stage."""

from __future__ import annotations

import pytest
from rpc_workers import HTTP, greedy, head, peer, running, wait_for

PROMPTS = ["hello world", "the cat sat on"]
F32 = ("--dtype", "float32")


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("gemma3", n_layers=3, n_embd=64, n_ff=128)


def props(w) -> dict:
    r = HTTP.get(f"{w.url}/props", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def metric(w, name: str) -> float:
    text = HTTP.get(f"{w.url}/metrics", timeout=30).text
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(f"llamacpp:{name} ")))


def asleep(w) -> dict:
    """Waits for the head to sleep (generous: the idle second starts after the last request ends)."""
    wait_for(lambda: props(w)["is_sleeping"], 60, "the head to sleep")
    return w.status()


def test_sleeps_when_idle_and_wakes_with_the_same_text(model, tmp_path):
    with running(head(model, tmp_path, (), "--sleep-idle-seconds", "1", *F32)) as w:
        awake = w.status()
        assert not awake["sleeping"] and awake["stages"][0]["weight_bytes"] > 0
        want = [greedy(w, p) for p in PROMPTS]
        predicted = metric(w, "tokens_predicted_total")

        st = asleep(w)
        assert st["sleeping"] and st["stages"][0]["state"] == "sleeping"
        assert (st["stages"][0]["weight_bytes"], st["stages"][0]["kv_bytes"]) == (0, 0)
        assert all(s["state"] == "idle" and s["n_past"] == 0 for s in st["slots"])
        # The observation routes answer from what is kept, without waking it.
        assert HTTP.get(f"{w.url}/health", timeout=30).status_code == 200
        assert HTTP.get(f"{w.url}/v1/models", timeout=30).json()["data"][0]["id"] == model.stem
        assert metric(w, "tokens_predicted_total") == predicted  # the counters, not a fresh engine's zeros
        assert props(w)["is_sleeping"] and w.status()["sleeping"]

        assert [greedy(w, p) for p in PROMPTS] == want  # woken by the request, which then runs
        assert not props(w)["is_sleeping"] and w.status()["stages"][0]["weight_bytes"] > 0
        # llama-server's throughput gauge: over the processing time since the last scrape, which resets it
        assert metric(w, "predicted_tokens_seconds") > 0
        assert metric(w, "predicted_tokens_seconds") == 0
        assert metric(w, "tokens_predicted_total") > predicted  # the counters went on

        asleep(w)  # llama-server's list: any request but the observation routes wakes it, /tokenize too
        r = HTTP.post(f"{w.url}/tokenize", json={"content": "hello"}, timeout=60)
        assert r.status_code == 200 and r.json()["tokens"]
        assert not props(w)["is_sleeping"]


def test_split_head_sleeps_and_its_peer_keeps_its_stage(model, tmp_path):
    with (
        running(peer(model, tmp_path, *F32)) as p,
        running(head(model, tmp_path, [p], "--split", "1/2", "--sleep-idle-seconds", "1", *F32)) as w,
    ):
        want = [greedy(w, prompt) for prompt in PROMPTS]
        peer_weights = p.status()["stages"][0]["weight_bytes"]
        st = asleep(w)
        assert st["stages"][0]["weight_bytes"] == 0 and st["stages"][1]["state"] == "up"
        assert p.status()["stages"][0]["weight_bytes"] == peer_weights > 0
        assert [greedy(w, prompt) for prompt in PROMPTS] == want
        assert [s["layers"] for s in w.status()["stages"]] == [[0, 1], [1, 3]]


def test_a_held_head_never_sleeps_and_a_failed_load_leaves_it_asleep():
    """IdleSleep alone, with callables for the model: nothing sleeps while a holder runs (however
    long), the idle clock starts when it lets go, and a load that fails raises to the request and
    the next one tries again."""
    import threading
    import time

    from hydra_console.engine.workers.idle_sleep import CHECK_S, IdleSleep

    calls, fail = [], threading.Event()

    def wake():
        calls.append("wake")
        if fail.is_set():
            raise RuntimeError("no memory")

    idle = IdleSleep(0.1, lambda: calls.append("sleep"), wake, busy=lambda: False)
    idle.hold()
    idle.start()
    try:
        time.sleep(3 * CHECK_S)  # three looks at the idle clock while held
        assert calls == [] and not idle.sleeping
        idle.release()
        wait_for(lambda: idle.sleeping, 30, "sleep after the holder let go")
        fail.set()
        with pytest.raises(RuntimeError, match="no memory"):
            idle.hold()
        assert idle.sleeping
        fail.clear()
        with idle.held():
            assert not idle.sleeping
        assert calls == ["sleep", "wake", "wake"]
    finally:
        idle.stop()
