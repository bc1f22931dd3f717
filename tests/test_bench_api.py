"""benchmarks/bench_api.py end to end on a tiny model at minimal sizes: real `bench`, `serve`, `peer`
and bench_split.py processes, the real `openai` client. Checks the report has every field, and
the counts that do not depend on speed (no timing is asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH_API = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_api.py"


def number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0


def test_bench_api_reports_every_field(tiny_model, tmp_path):
    model = tiny_model("llama", n_layers=4, n_ctx=256)
    out = tmp_path / "report.json"
    cmd = [
        sys.executable,
        str(BENCH_API),
        "--model",
        str(model),
        "-n",
        "4",
        "--streams",
        "1,2",
        "--ctx",
        "64",
        "--ttft-prompt",
        "16",
        "--ttft-runs",
        "1",
        "--clients",
        "1",
        "--timeout",
        "120",
        "--restarts",
        "1",
        "--json",
        str(out),
    ]
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "HYDRA_CACHE_DIR": str(tmp_path / "cache")}
    )
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(out.read_text())
    assert "serve, 1 stream (openai, streaming)" in done.stdout and "head + peer, 1 stream (socket)" in done.stdout

    assert number(r["bench"]["decode_tok_s"]) and r["bench"]["weight_bytes"] > 0 and r["bench"]["kv_bytes"] > 0
    assert r["bench"]["estimate"]["kv_bytes"] == r["bench"]["kv_bytes"] and r["bench"]["peak_rss"] > 0
    solo = r["solo"]
    assert number(solo["first_start_ready_s"]) and number(solo["restart_ready_s"])
    assert len(solo["restarts"]) == 1 and solo["restart_ready_s"] == solo["restarts"][0]["ready_s"]
    assert solo["bytecode_cached"] is (os.environ.get("PYTHONDONTWRITEBYTECODE", "") == "")
    for stages in (solo["first_start_stages_s"], solo["restart_stages_s"]):  # seconds from process start, in order
        # the worker's stages in order, with the load's phases among them ("stage built", "graphs warmed", ...)
        named = [s for s in stages if s in ("alive", "model loaded", "RPC active", "warming", "ready")]
        assert named == ["alive", "model loaded", "RPC active", "warming", "ready"] and "graphs warmed" in stages
        assert all(number(t) for t in stages.values()) and list(stages.values()) == sorted(stages.values())
    assert (
        solo["single"]["tokens"] == 4
        and number(solo["single"]["client_tok_s"])
        and number(solo["single"]["server_tok_s"])
    )
    assert [c["streams"] for c in solo["concurrency"]] == [1, 2]
    for c in solo["concurrency"]:
        assert c["tokens"] == 4 * c["streams"]
        assert all(
            number(c[k])
            for k in (
                "wall_s",
                "aggregate_tok_s",
                "aggregate_decode_tok_s",
                "per_stream_tok_s",
                "per_stream_server_tok_s",
            )
        )
    for ttft in (solo["ttft"], r["split"]["ttft"]):
        assert ttft["prompt_tokens"] == 16 and ttft["runs"] == 1
        assert number(ttft["median_ms"]) and number(ttft["min_ms"]) and number(ttft["server_prompt_median_ms"])
        assert number(ttft["openai_median_ms"])
    # Each worker's memory from its /status: the stage's held weights and KV, the process's peaks.
    for mem in (solo["memory"], r["split"]["memory"]["head"], r["split"]["memory"]["peer"]):
        assert mem["weight_bytes"] > 0 and mem["kv_bytes"] > 0 and mem["rss"] > 0
    assert r["split"]["memory"]["head"]["weight_bytes"] < solo["memory"]["weight_bytes"]

    split = r["split"]
    assert split["transport"] == "socket" and split["single"]["tokens"] == 4 and number(split["ready_s"])
    parts = split["parts"]
    assert set(parts["decode_tok_s"]) == {"solo", "split"} and number(parts["split_over_solo"])
    assert set(parts["decode_parts_ms"]["split"]) == {
        "head layers",
        "peer 0 round trip",
        "peer 0 compute",
        "output head",
        "total",
    }
    assert set(parts["decode_parts_ms"]["solo"]) == {"head layers", "output head", "total"}
    assert set(r["ratios"]) == {
        "single_over_bench",
        "single_over_llama_cpp",
        "bench_over_llama_cpp",
        "split_over_solo_single",
        "split_over_bench",
        "split_over_llama_cpp_split",
    }
    assert all(number(v) for v in r["ratios"].values())
    # No --llama-bench: the ratios' reference is issue 15's H200 number, and the report says so.
    assert r["llama_cpp"]["source"].startswith("issue 15") and "llama.cpp decode (the ratios' reference)" in done.stdout
    assert r["ratios"]["bench_over_llama_cpp"] == round(r["bench"]["decode_tok_s"] / r["llama_cpp"]["decode_tok_s"], 3)


def test_bench_memory_estimate_equals_what_served_workers_hold(tiny_model, tmp_path):
    """benchmarks/bench_memory.py on CPU: a head and a peer process, one prompt served; each one's
    estimate (the split editor's) equals the bytes its stage holds, as its /status reports them."""
    model = tiny_model("llama", n_layers=4, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, qtype="Q4_K_M")
    cmd = [
        sys.executable,
        str(BENCH_API.with_name("bench_memory.py")),
        "--model",
        str(model),
        "--split",
        "3/1",
        "--ctx",
        "128",
        "--parallel",
        "2",
        "--prompt",
        "32",
        "--cache-type-k",
        "q8_0",
    ]
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "HYDRA_CACHE_DIR": str(tmp_path)}
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    assert [(r["role"], r["layers"]) for r in rows] == [("head", [0, 3]), ("peer", [3, 4])]
    for r in rows:
        assert r["estimate_weights"] == r["held_weights"] > 0 and r["estimate_kv"] == r["held_kv"] > 0
        assert r["reading_source"] == "rss" and r["reading"] > r["baseline"] > 0


def test_prompt_profile_runs_the_serve_config_and_prints_its_tables(tiny_model, tmp_path):
    model = tiny_model("llama", n_layers=2, n_ctx=256)
    script = BENCH_API.parent / "prompt_profile.py"
    cmd = [
        sys.executable,
        str(script),
        str(model),
        "--device",
        "cpu",
        "--prompt-tokens",
        "40",
        "--runs",
        "1",
        "--",
        "-b",
        "16",
    ]
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "HYDRA_CACHE_DIR": str(tmp_path / "cache")}
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "request ms (40 tokens, -b 16)" in done.stdout  # serve's own parser took the flag after --
    assert "Self CPU time total" in done.stdout
