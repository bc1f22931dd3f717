"""Layer split over a real network path: the peer runs in its own network namespace, reached
through a veth pair (its own IP stack and address), not loopback.

Greedy output must equal solo's; a peer killed mid-decode must fail the head's request quickly
with a 503. Needs root (`ip netns add`); skips otherwise. Names are unique per run and the
namespace and veth are always removed.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess

import pytest
from rpc_workers import Worker, assert_peer_kill_fails_request_fast, free_ports, greedy, head

N_LAYERS = 2


def ip(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *argv], capture_output=True, text=True, timeout=10)


@pytest.fixture
def netns():
    """A namespace with one end of a veth pair; yields (name, address inside it)."""
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command (iproute2)")
    if os.geteuid() != 0:
        pytest.skip("needs root to create a network namespace and a veth pair")
    tag = secrets.token_hex(3)  # interface names must stay within 15 characters
    name, outer, inner = f"hydra-test-{tag}", f"hyo{tag}", f"hyi{tag}"
    subnet = f"10.77.{int(tag[:2], 16)}"
    made = ip("netns", "add", name)
    if made.returncode != 0:
        pytest.skip(f"`ip netns add` failed: {made.stderr.strip()}")
    try:
        for argv in [
            ("link", "add", outer, "type", "veth", "peer", "name", inner),
            ("link", "set", inner, "netns", name),
            ("addr", "add", f"{subnet}.1/24", "dev", outer),
            ("link", "set", outer, "up"),
            ("-n", name, "addr", "add", f"{subnet}.2/24", "dev", inner),
            ("-n", name, "link", "set", inner, "up"),
        ]:
            done = ip(*argv)
            if done.returncode != 0:
                pytest.skip(f"`ip {' '.join(argv)}` failed: {done.stderr.strip()}")
        yield name, f"{subnet}.2"
    finally:
        ip("netns", "del", name)  # takes the inner end, and with it the pair, along
        ip("link", "del", outer)  # in case it outlived the namespace


def test_peer_in_another_network_namespace(netns, tiny_model, tmp_path):
    name, addr = netns
    model = tiny_model("gemma3", n_layers=N_LAYERS, n_embd=64, n_ff=128)
    port, rpc_port = free_ports(2)  # free here; the namespace's ports are all free
    # Off loopback a peer needs a token (or --insecure): the real path, proven over the veth pair.
    argv = ["--model", str(model), "--device", "cpu", "--host", addr, "--rpc-host", addr, "--auth-token", "netns-token"]
    remote = Worker("peer", argv, tmp_path, port, rpc_port, host=addr, launcher=("ip", "netns", "exec", name))
    solo = head(model, tmp_path, ctx=2048)
    split = head(  # --peer-grace 0: a lost peer's 503 at once (test_peer_restart.py: the pause)
        model, tmp_path, [remote], "--split", "1/1", "--auth-token", "netns-token", "--peer-grace", "0", ctx=2048
    )
    workers = [remote, solo, split]
    try:
        for w in workers:
            w.wait_ready(timeout=60)
        assert split.status()["peers"][0]["addr"] == f"{addr}:{rpc_port}"
        for prompt in ["hello world", "abc abc abc"]:
            assert greedy(split, prompt) == greedy(solo, prompt)

        assert_peer_kill_fails_request_fast(split, remote, 1500, 30)
    finally:
        for w in workers:
            w.stop()
