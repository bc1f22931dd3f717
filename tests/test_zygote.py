"""The test support that forks workers from a zygote (zygote.py) gives what a fresh `python -m
hydra_console.engine.cli` process gives: the same exit code, stdout and stderr; its own session;
the test's working directory and the environment it is given; signals seen as `subprocess` reports them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from rpc_workers import engine_cli, head, running

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="workers are exec'd on a CUDA host")


def test_a_forked_cli_run_answers_as_an_execd_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a relative path resolves against the test's directory, in both
    argv = ["peer", "--model", "missing.gguf", "--port", "0", "--rpc-port", "0"]
    execd = subprocess.run(
        [sys.executable, "-m", "hydra_console.engine.cli", *argv], capture_output=True, text=True, timeout=120
    )
    forked = engine_cli(*argv, timeout=120)
    assert (forked.returncode, forked.stdout, forked.stderr) == (execd.returncode, execd.stdout, execd.stderr)
    assert forked.returncode == 2 and "missing.gguf" in forked.stderr
    # the environment it is given: a public bind is refused without a token, and goes on to the model with one
    public = ["peer", "--model", "missing.gguf", "--rpc-host", "0.0.0.0", "--port", "1"]
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_TOKEN"}
    assert "--insecure" in engine_cli(*public, env=env, timeout=120).stderr
    assert "missing.gguf" in engine_cli(*public, env={**env, "HYDRA_TOKEN": "t" * 32}, timeout=120).stderr
    usage = engine_cli("serve", "--no-such-flag", timeout=120)  # argparse's own exit, from inside main
    assert usage.returncode == 2 and usage.stderr.startswith("usage: hydra-engine") and usage.stdout == ""


def test_a_forked_worker_has_its_own_session_and_the_tests_directory(tiny_model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with running(head(tiny_model("llama"), tmp_path)) as w:
        pid = w.proc.pid
        assert os.getsid(pid) == pid and os.readlink(f"/proc/{pid}/cwd") == str(tmp_path)
        assert w.log_path.exists() and "serving llama" in w.log()
        w.kill9()
    assert w.proc.returncode == -9 and w.proc.poll() == -9
