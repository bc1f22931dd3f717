"""`hydra-engine generate` as a real process: streamed text, the same output as the Engine, clean errors."""

from __future__ import annotations

import subprocess

import pytest
from rpc_workers import engine_cli

from hydra_console.engine.gguf_file import GGUFFile
from hydra_console.engine.model import build_stage
from hydra_console.engine.pipeline import Pipeline
from hydra_console.engine.serving.runtime import Engine, Request
from hydra_console.engine.serving.sampling_params import SamplingParams
from hydra_console.engine.text.tokenizer import Tokenizer


def generate(*args: str) -> subprocess.CompletedProcess:
    return engine_cli("generate", "--device", "cpu", "--dtype", "float32", *args, timeout=120)


def test_output_equals_the_engine_and_seeds_repeat(tiny_model):
    path = tiny_model("llama")
    r = generate("--model", str(path), "-p", "hello world", "-n", "12")
    assert r.returncode == 0, r.stderr
    assert "generated" in r.stderr and "tok/s" in r.stderr

    g = GGUFFile(path)
    tok = Tokenizer.from_gguf(g)
    ids = tok.encode("hello world")
    engine = Engine(Pipeline(build_stage(g, device="cpu", dtype="float32", n_slots=1, n_ctx=64)), tok, 1, 64).start()
    try:
        want = "".join(
            ev.text for ev in engine.generate(Request(ids, SamplingParams(temperature=0.0), max_tokens=12), timeout=30)
        )
    finally:
        engine.stop()
    assert r.stdout == want + "\n"

    seeded = [
        generate("--model", str(path), "-p", "hello", "-n", "10", "--temperature", "1.2", "--seed", s).stdout
        for s in ("5", "5", "6")
    ]
    assert seeded[0] == seeded[1] and seeded[0] != seeded[2]


def test_chat_wraps_the_prompt(tiny_model):
    r = generate("--model", str(tiny_model("gemma3")), "-p", "hi", "-n", "4", "--chat")
    assert r.returncode == 0, r.stderr
    assert "prompt" in r.stderr


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["-p", "word " * 100, "--ctx", "32"], "context"),
        (["-p", "x", "--temperature", "-1"], "temperature"),
        (["-p", "x", "-n", "-5"], "-n"),
    ],
)
def test_bad_input_is_one_clear_error(tiny_model, extra, needle):
    r = generate("--model", str(tiny_model("llama")), *extra)
    assert r.returncode == 2
    assert needle in r.stderr and "Traceback" not in r.stderr


def test_missing_model_file_is_a_clear_error(tmp_path):
    r = generate("--model", str(tmp_path / "nope.gguf"), "-p", "x")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "nope.gguf" in r.stderr
