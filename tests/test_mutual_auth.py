"""Both ends prove the token (contracts/auth.py), attacked by impostors without it as real
processes (tests/fake_rpc_worker.py): a fake prefill worker that relays the head's own control
port, one that reflects the head's nonce, and a fake peer that offers no authentication."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from rpc_workers import free_ports, head, running, wait_for

import hydra_console.contracts.auth as auth
from hydra_console.contracts.auth import AuthError, ClientHandshake, ServerHandshake
from hydra_console.contracts.rpc import Op, Status

TOKEN = "mutual-test-token"
LONG = "the quick brown fox jumps over the lazy dog and keeps running far away " * 3


# --- the handshake's rules, on its own --------------------------------------------------------------


def elsewhere(hs: ClientHandshake) -> ClientHandshake:
    """`hs` as if another process had made it (its nonce is not one this process issued)."""
    auth._own.pop(hs.nonce)
    return hs


@pytest.mark.unit
def test_the_honest_pair_proves_the_token_both_ways():
    client = elsewhere(ClientHandshake(TOKEN, "compute", ("peer",)))
    server = ServerHandshake(TOKEN, "compute", "peer", client.nonce)
    proof = client.answer(server.nonce, "peer", server.proof)
    assert server.check(proof)
    assert not server.check(server.proof)  # a server's proof never passes as the client's
    wrong = elsewhere(ClientHandshake("another-token", "compute", ("peer",)))
    other = ServerHandshake(TOKEN, "compute", "peer", wrong.nonce)
    with pytest.raises(AuthError, match="did not prove"):
        wrong.answer(other.nonce, "peer", other.proof)


@pytest.mark.unit
def test_relayed_reflected_and_foreign_role_proofs_fail():
    client = ClientHandshake(TOKEN, "control", ("prefill",))
    relayed = ServerHandshake(
        TOKEN, "control", "prefill", elsewhere(ClientHandshake(TOKEN, "control", ("prefill",))).nonce
    )
    with pytest.raises(AuthError, match="did not prove"):  # proved for another session's nonce
        client.answer(relayed.nonce, "prefill", relayed.proof)
    compute = ServerHandshake(
        TOKEN, "compute", "prefill", elsewhere(ClientHandshake(TOKEN, "compute", ("prefill",))).nonce
    )
    with pytest.raises(AuthError, match="did not prove"):  # a compute proof on the control protocol
        client.answer(compute.nonce, "prefill", compute.proof)
    with pytest.raises(AuthError, match="reflected"):  # our own nonce handed to our own server
        ServerHandshake(TOKEN, "control", "head", client.nonce)
    head = ServerHandshake(TOKEN, "control", "head", elsewhere(ClientHandshake(TOKEN, "control", ("head",))).nonce)
    with pytest.raises(AuthError, match="'head' worker, not a prefill"):
        client.answer(head.nonce, "head", head.proof)


# --- impostors as real processes ----------------------------------------------------------------------


def impostor(mode: str, port: int, record: Path, head_rpc: int | None = None) -> subprocess.Popen:
    argv = [
        sys.executable,
        str(Path(__file__).with_name("fake_rpc_worker.py")),
        mode,
        "--port",
        str(port),
        "--record",
        str(record),
    ]
    if head_rpc is not None:
        argv += ["--head-rpc", str(head_rpc)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    wait_for(lambda: record.exists(), 30, "the impostor to listen")
    return proc


def events(record: Path) -> list[dict]:
    return [json.loads(line) for line in record.read_text().splitlines()]


@pytest.mark.integration
@pytest.mark.parametrize("mode", ["relay-prefill", "own-nonce-prefill"])
def test_a_fake_prefill_worker_learns_no_prompt_and_cannot_log_into_the_head(tiny_model, tmp_path, mode):
    model = tiny_model("llama", n_layers=4)
    (fake_port,) = free_ports(1)
    w = head(
        model,
        tmp_path,
        (),
        "--dtype",
        "float32",
        "--auth-token",
        TOKEN,
        "--prefill-worker",
        f"127.0.0.1:{fake_port}",
        "--prefill-threshold",
        "8",
        "--prefill-deadline",
        "20",
    )
    record = tmp_path / f"{mode}.jsonl"
    fake = impostor(mode, fake_port, record, head_rpc=w.rpc_port)
    try:
        with running(w):
            r = httpx.post(
                f"{w.url}/v1/completions", json={"prompt": LONG, "max_tokens": 8, "temperature": 0}, timeout=120
            )
            assert r.status_code == 200 and r.json()["choices"][0]["text"]  # prefilled here after all
            assert w.status()["pd"]["fallback_reasons"] == {"refused": 1}, w.status()["pd"]
            got = events(record)
            assert got[1]["event"] == "head_first_frame" and got[1]["op"] == Op.AUTH and got[1]["nbytes"] == 16
            challenge = next(e for e in got if e["event"] == "victim_challenge")
            if mode == "relay-prefill":  # the head's own nonce came back to it: refused as reflected
                assert challenge["status"] == Status.ERROR and "reflected" in challenge["meta"]["error"]
            else:  # a valid proof, but over the fake's nonce and as a head: the head's client refuses it
                assert challenge["status"] == Status.OK
            kinds = [e["event"] for e in got]
            assert (
                "head_sent_request" not in kinds and "victim_login" not in kinds and "victim_state_get" not in kinds
            ), got
            assert "failed to authenticate" in w.log()
    finally:
        fake.kill()


@pytest.mark.integration
def test_a_head_with_a_token_sends_nothing_to_a_peer_that_offers_no_authentication(tiny_model, tmp_path):
    model = tiny_model("llama", n_layers=4)
    (fake_port,) = free_ports(1)
    record = tmp_path / "downgrade.jsonl"
    fake = impostor("downgrade-peer", fake_port, record)
    w = head(model, tmp_path, (), "--auth-token", TOKEN, "--peer", f"127.0.0.1:{fake_port}", "--split", "2/2")
    try:
        wait_for(lambda: "offers no authentication" in w.log(), 60, "the head to refuse the peer")
        time.sleep(0.5)  # any command the head would wrongly send next has time to arrive
        cmds = {e["cmd"] for e in events(record) if e["event"] == "command"}
        assert cmds == {14}, cmds  # HELLO only: no CHECK (the model's fingerprint), no LOAD_STAGE
        w.proc.wait(timeout=30)  # a peer that must not be used: the head fails clearly, it does not serve
        assert w.proc.returncode != 0
    finally:
        w.stop()
        fake.kill()
