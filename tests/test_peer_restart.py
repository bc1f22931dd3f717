"""A peer restarted (SIGTERM, then a new process on the same port: the console's keyboard restart)
while a stream runs through it: within the head's `--peer-grace` the stream pauses, the head
re-attaches the new peer, replays the running slots' tokens into its KV and carries on; the client
sees no error and greedy text equal to the solo head's. Past the grace: a clean error event, and a
503 for the requests that follow.

Real processes on loopback, the openai client. The peer is slowed per layer so that a stream of
MAX_TOKENS is still decoding when it is stopped on any machine; every wait has a generous deadline."""

from __future__ import annotations

import threading
import time

import openai
import pytest
from consoles import all_ready, until
from rpc_workers import HTTP, complete, free_ports, head, peer, running, wait_for

from hydra_console.app.config import Profile, SupervisorSettings, WorkerSpec
from hydra_console.app.records import State
from hydra_console.app.supervisor import Supervisor
from hydra_console.app.ui.app import HydraConsole
from hydra_console.app.ui.dialogs import ConfirmScreen

MAX_TOKENS = 200
PROMPT = "once upon a time"
F32 = ("--dtype", "float32")
SLOW_PEER = ("--layer-delay-ms", "20")  # 2 layers: >= 40 ms a token, >= 8 s for the stream


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama", n_layers=4, n_embd=64, n_ff=128)


def _client(w) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{w.url}/v1", api_key="none", max_retries=0, timeout=300)


def _stream(w, out: dict) -> None:
    """A streamed greedy completion: out["text"] so far, out["finish"], or out["error"] (the
    openai client raises the stream's error event)."""
    out["text"] = ""
    try:
        for chunk in _client(w).completions.create(
            model="any",
            prompt=PROMPT,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True, "cache_prompt": False},
        ):
            out["text"] += chunk.choices[0].text
            if chunk.choices[0].finish_reason is not None:
                out["finish"] = chunk.choices[0].finish_reason
    except openai.APIError as e:
        out["error"] = e


def _decoding(w) -> bool:
    slots = HTTP.get(f"{w.url}/status", timeout=10).json()["slots"]
    return any((s["n_decoded"] or 0) > 10 for s in slots)


def _health(w) -> dict:
    return HTTP.get(f"{w.url}/health", timeout=10).json()


def _stop_mid_stream(split, victim, out: dict) -> threading.Thread:
    t = threading.Thread(target=_stream, args=(split, out))
    t.start()
    wait_for(lambda: _decoding(split), 120, "the stream to be decoding")
    victim.stop()  # SIGTERM, as the console's restart; waits for the exit
    assert t.is_alive() and "finish" not in out, "the stream ended before the peer stopped"
    return t


@pytest.mark.integration
def test_peer_restarted_within_the_grace_pauses_the_stream(model, tmp_path):
    solo = head(model, tmp_path, (), *F32)
    with running(solo):
        expected: dict = {}
        _stream(solo, expected)
    assert expected.get("finish") == "length" and "error" not in expected, expected

    p = peer(model, tmp_path, *F32, *SLOW_PEER)
    split = head(model, tmp_path, [p], *F32, "--peer-grace", "300")
    with running(p), running(split):
        out: dict = {}
        t = _stop_mid_stream(split, p, out)
        # Paused, not failed: /health names the wait (no request needs the peer meanwhile).
        wait_for(lambda: "paused" in (_health(split).get("reason") or ""), 60, "/health to say the head waits")
        queued: dict = {}  # a request that comes meanwhile waits, then is served
        q = threading.Thread(target=lambda: queued.setdefault("r", complete(split, "hello world", 8, timeout=300)))
        q.start()
        wait_for(lambda: split.status()["requests"]["requests_total"] >= 2, 60, "the second request to queue")
        t0 = time.monotonic()
        p.start()  # same ports, a new process
        p.wait_ready(120)
        print(f"peer restarted (new process ready) in {time.monotonic() - t0:.2f} s")
        t.join(timeout=300)
        assert not t.is_alive(), "the stream never finished"
        assert "error" not in out, out["error"]
        assert out["finish"] == "length" and out["text"] == expected["text"]
        q.join(timeout=300)
        assert queued["r"].status_code == 200, queued["r"].text
        assert split.status()["peers"][0]["attaches"] == 2
        assert _health(split)["status"] == "ok"


@pytest.mark.integration
def test_peer_not_back_within_the_grace_fails_the_stream_cleanly(model, tmp_path):
    p = peer(model, tmp_path, *F32, *SLOW_PEER)
    split = head(model, tmp_path, [p], *F32, "--peer-grace", "1")
    with running(p), running(split):
        out: dict = {}
        t = _stop_mid_stream(split, p, out)
        t.join(timeout=120)
        assert not t.is_alive(), "the stream hung after the grace"
        err = out.get("error")
        assert err is not None and p.rpc_addr in err.message, out
        assert "Traceback" not in split.log()
        # The grace is spent: the next request is refused at once, with a 503 in OpenAI's shape.
        with pytest.raises(openai.APIStatusError) as refused:
            _client(split).completions.create(model="any", prompt=PROMPT, max_tokens=4, temperature=0)
        assert refused.value.status_code == 503 and p.rpc_addr in refused.value.message


async def test_console_keyboard_restart_of_a_peer_under_a_stream(model, tmp_path):
    """The console's `R` on a peer (its supervisor: SIGTERM, wait for the exit, a new process on the
    same ports), unchanged: the stream through the head pauses and completes, text as before."""
    head_port, peer_port = free_ports(2, pairs=True)
    profile = Profile(
        name="restart",
        model=str(model),
        ctx=1024,
        parallel=2,
        head=WorkerSpec(name="head", port=head_port, device="cpu", args=[*F32, "--peer-grace", "300"]),
        peers=[WorkerSpec(name="peer1", port=peer_port, device="cpu", args=[*F32, *SLOW_PEER])],
        supervisor=SupervisorSettings(poll_s=0.25, grace_s=10),
    )
    sup = Supervisor(profile, log_dir=tmp_path)
    app = HydraConsole(sup, load_model_shape=False)
    try:
        async with app.run_test(size=(80, 24)) as pilot:
            await until(pilot, lambda: all_ready(sup), timeout=120)
            before: dict = {}
            t = threading.Thread(target=_stream, args=(sup.head.spec, before))
            t.start()
            await until(pilot, lambda: not t.is_alive(), timeout=300)
            assert before.get("finish") == "length" and "error" not in before, before

            peer_worker, out = sup.workers["peer1"], {}
            old = peer_worker.pid
            t = threading.Thread(target=_stream, args=(sup.head.spec, out))
            t.start()
            await until(pilot, lambda: _decoding(sup.head.spec), timeout=120)
            await pilot.press("down", "R")
            assert isinstance(app.screen, ConfirmScreen) and f"peer1 (pid {old})" in app.screen.question
            await pilot.press("y")
            await until(pilot, lambda: peer_worker.pid != old and peer_worker.state == State.READY, timeout=120)
            await until(pilot, lambda: not t.is_alive(), timeout=300)
            assert "error" not in out, out["error"]
            assert out["finish"] == "length" and out["text"] == before["text"]
            assert HTTP.get(f"{sup.head.spec.url}/status", timeout=15).json()["peers"][0]["attaches"] == 2
            await pilot.press("q")
    finally:
        await sup.shutdown()  # the quit dialog leaves workers running: stop them here
