"""`hydra-engine bench` as a real process on a tiny synthetic model: JSON shape and bad input."""

from __future__ import annotations

import json

import pytest
from rpc_workers import engine_cli


def test_bench_json(tiny_model):
    out = engine_cli(
        "bench", "--model", str(tiny_model("gemma3")), "-p", "16", "-n", "4", "-r", "1", "--json", timeout=120
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["n_prompt"] == 16 and result["n_gen"] == 4
    assert result["device"] == "cpu" and result["dtype"] == "bfloat16"
    assert result["prefill_tok_s"] > 0 and result["decode_tok_s"] > 0 and result["weight_bytes"] > 0
    # Consistent at any machine speed (it once read 0.0 after rounding on a loaded box).
    assert result["decode_gb_s"] == pytest.approx(result["weight_bytes"] * result["decode_tok_s"] / 1e9, rel=1e-3)


def test_bench_without_llama_bench_is_a_clear_error(tiny_model, tmp_path):
    out = engine_cli(
        "bench",
        "--model",
        str(tiny_model("llama")),
        *("-p", "4", "-n", "2", "-r", "1"),
        *("--llama-bench", str(tmp_path / "llama-bench")),
        timeout=120,
    )
    assert out.returncode == 2
    assert "llama-bench not found" in out.stderr and "Traceback" not in out.stderr


def test_bench_bad_flags(tiny_model):
    out = engine_cli("bench", "--model", str(tiny_model("llama")), "-r", "0", timeout=60)
    assert out.returncode == 2 and "--repetitions" in out.stderr
    out = engine_cli("bench", "--model", str(tiny_model("llama")), "--dtype", "int3", timeout=60)
    assert out.returncode == 2 and "unknown dtype" in out.stderr
