"""A worker refuses a stage that would not leave `--headroom-gb` free on its device, before it
allocates anything, naming the stage's need and what its device has (contracts/fit.py): the head
given `--split`, a peer given LOAD_STAGE. Real worker processes on loopback."""

from __future__ import annotations

import re

import httpx
from rpc_workers import head, peer, running, wait_for

HUGE = ("--headroom-gb", "100000")  # more than any machine has: every stage is refused
NEED = re.compile(r"needs (\d+\.\d) GiB for layers \[(\d+),(\d+)\) \+ 100000\.0 GiB headroom, card has (\d+\.\d) GiB")


def test_head_refuses_its_split_before_loading_and_before_any_peer_loads(tiny_model, tmp_path):
    model = tiny_model("llama", n_layers=4)
    with running(peer(model, tmp_path)) as p:
        h = head(model, tmp_path, [p], "--split", "3/1", *HUGE)
        try:
            assert h.proc.wait(timeout=120) == 2
            log = h.log()
            assert "--split 3/1 refused before loading: head needs" in log, log
            m = NEED.search(log)
            assert m and m.group(2, 3) == ("0", "3") and float(m.group(4)) > 0, log
            assert "(available RAM)" in log
            # The peer was never asked to load: it holds no stage.
            assert httpx.get(f"{p.url}/status", timeout=10).json()["stages"][0]["layers"] is None
        finally:
            h.stop()


def test_peer_refuses_load_stage_past_its_headroom_and_keeps_serving(tiny_model, tmp_path):
    model = tiny_model("llama", n_layers=4)
    with running(peer(model, tmp_path, *HUGE), timeout=90) as p:
        h = head(model, tmp_path, [p], "--split", "3/1")
        try:
            assert h.proc.wait(timeout=120) == 2
            log = h.log()
            assert f"peer {p.rpc_addr} refused: LOAD_STAGE with 2x256 KV refused before loading: peer needs" in log
            m = NEED.search(log)
            assert m and m.group(2, 3) == ("3", "4"), log
            assert "the current stage stays" in log
            # The peer lives on, with no stage: a head with a split that fits it is served.
            assert httpx.get(f"{p.url}/health", timeout=10).status_code in (200, 503)
            wait_for(lambda: p.proc.poll() is None, 5, "the peer to stay up")
        finally:
            h.stop()


def test_the_default_headroom_lets_a_small_split_load(tiny_model, tmp_path):
    model = tiny_model("llama", n_layers=4)
    with running(peer(model, tmp_path)) as p, running(head(model, tmp_path, [p], "--split", "3/1")) as h:
        assert [s["layers"] for s in h.status()["stages"]] == [[0, 3], [3, 4]]
