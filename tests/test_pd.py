"""Prefill/decode disaggregation and the state ops, with real workers on loopback: a decode head
(solo, or split with a peer) sends long prompts to a `serve --role prefill` worker, pulls their
state (PREFILL), places each stage's layers (peers through STATE_PUT) and decodes: greedy output
equals the head's own prefill, token for token; every failure falls back to a local prefill and
is counted; bad states are refused and leave the slot as it was."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading

import httpx
import pytest
import torch
from rpc_workers import Worker, free_ports, greedy, head, peer, running, wait_for

from hydra_console.contracts.rpc import STATE_SLOT, Cmd, Op, Status
from hydra_console.contracts.rpc import ReplyStatus as R
from hydra_console.contracts.slot_state import SlotHeader
from hydra_console.engine.gguf_file import GGUFFile
from hydra_console.engine.rpc.client import PeerError, RemoteStage
from hydra_console.engine.rpc.wire import SocketReader, pack_control_request, read_control_response

LONG = "the quick brown fox jumps over the lazy dog and keeps running far away " * 3
SHAPE = {"n_layers": 4}


def prefill_worker(model, log_dir, *extra) -> Worker:
    port, rpc = free_ports(2)
    argv = ["--model", str(model), "--device", "cpu", "--dtype", "float32", "--parallel", "2", "--ctx", "256",
            "--role", "prefill", *extra]  # fmt: skip
    return Worker("serve", argv, log_dir, port, rpc)


def pd_head(model, log_dir, prefill_addr, peers=(), *extra) -> Worker:
    return head(model, log_dir, peers, "--dtype", "float32", "--prefill-worker", prefill_addr, "--prefill-threshold", "8",
                *extra)  # fmt: skip


def metric(w: Worker, name: str) -> float:
    text = httpx.get(f"{w.url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def test_greedy_with_pd_equals_greedy_without_solo_and_split(tiny_model, tmp_path):
    model = tiny_model("llama", **SHAPE)
    with running(prefill_worker(model, tmp_path)) as pw, running(head(model, tmp_path, (), "--dtype", "float32")) as ref:
        want = [greedy(ref, LONG + str(i), 12)[0] for i in range(2)]
        with running(pd_head(model, tmp_path, pw.rpc_addr)) as solo:
            assert [greedy(solo, LONG + str(i), 12)[0] for i in range(2)] == want
            pd = solo.status()["pd"]
            assert pd["transfers"] == 2 and pd["fallbacks"] == 0 and pd["bytes"] > 0
            assert metric(solo, "hydra_pd_transfers_total") == 2
        with running(peer(model, tmp_path)) as p, running(pd_head(model, tmp_path, pw.rpc_addr, [p], "--split", "2/2")) as split:
            assert [greedy(split, LONG + str(i), 12)[0] for i in range(2)] == want
            assert split.status()["pd"]["transfers"] == 2
            assert p.status()["resident"]["state_bytes_in"] > 0  # the peer's layers went in through STATE_PUT
        assert pw.status()["role"] == "prefill" and pw.status()["pd"]["served"] == 4
