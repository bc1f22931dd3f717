"""Speculative decoding through `hydra-engine serve` (real processes, the openai client), solo and
through the layer split: greedy output equal with and without drafts, draft timings, /metrics, /status."""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from rpc_workers import Worker, engine_cli, free_ports

N_CTX, N_SLOTS = 256, 2
# Repetitive text: prompt lookup finds earlier n-grams to propose.
PROMPTS = ["a b c d a b c d a b c d a b", "the cat sat on the mat the cat sat on the", "one two three one two"]


def _serve(tmp_path, model, *extra: str) -> Worker:
    port, rpc = free_ports(2)
    argv = [
        "--model",
        str(model),
        "--parallel",
        str(N_SLOTS),
        "--ctx",
        str(N_CTX),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--spec-type",
        "ngram",
        "--draft-max",
        "4",
        *extra,
    ]
    w = Worker("serve", argv, tmp_path, port, rpc)
    w.wait_ready()
    return w


def _complete(base: str, prompt: str, **extra) -> dict:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    r = client.completions.create(
        model=model, prompt=prompt, temperature=0, max_tokens=40, extra_body={"ignore_eos": True, **extra}
    )
    return r.model_dump()


def _metrics(base: str) -> dict:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def _check_equal_and_counted(base: str) -> None:
    drafted = accepted = 0
    for prompt in PROMPTS:
        plain = _complete(base, prompt, speculative={"type": "off"})
        spec = _complete(base, prompt)
        assert spec["choices"][0]["text"] == plain["choices"][0]["text"]
        assert plain["timings"]["draft_n"] == 0
        drafted += spec["timings"]["draft_n"]
        accepted += spec["timings"]["draft_n_accepted"]
        assert 0 <= spec["timings"]["draft_n_accepted"] <= spec["timings"]["draft_n"]
    assert drafted > 0

    m = _metrics(base)
    assert m[("llamacpp:spec_decode_num_draft_tokens_total", ())] == drafted
    assert m[("llamacpp:spec_decode_num_accepted_tokens_total", ())] == accepted
    assert m[("llamacpp:spec_decode_num_drafts_total", ())] > 0
    per_pos = {dict(k[1])["position"]: v for k, v in m.items() if k[0].endswith("accepted_tokens_per_pos_total")}
    assert sum(per_pos.values()) == accepted

    spec = httpx.get(f"{base}/status", timeout=10).json()["speculative"]
    assert (spec["type"], spec["draft_max"], spec["draft_tokens"], spec["accepted"]) == ("ngram", 4, drafted, accepted)
    assert spec["acceptance"] == pytest.approx(accepted / drafted)
    assert spec["mean_accepted_len"] == pytest.approx(1 + accepted / spec["drafts"])


def test_solo_server_speculation_is_exact_and_counted(tmp_path, tiny_model):
    head = _serve(tmp_path, tiny_model("llama"))
    try:
        _check_equal_and_counted(head.url)
        # llama-server's flat per-request fields and bad overrides
        r = _complete(head.url, PROMPTS[0], **{"speculative.n_max": 1})
        assert r["timings"]["draft_n"] <= 40
        for bad in (
            {"speculative": {"type": "draft"}},
            {"speculative": {"n_max": 99}},
            {"speculative": "x"},
            {"speculative.p_min": 3},
            {"speculative": {"type": "mtp"}},
        ):
            resp = httpx.post(f"{head.url}/v1/completions", json={"prompt": "a", **bad}, timeout=30)
            assert resp.status_code == 400, (bad, resp.text)
            assert resp.json()["error"]["message"]
    finally:
        head.stop()


def test_split_server_speculation_is_exact_and_counted(tmp_path, tiny_model):
    """Head + one peer (`--split 1/1`): each verify is one forward, so one round trip to the peer;
    rejected drafts' KV on the peer is overwritten like the head's."""
    model = tiny_model("llama")
    port, rpc = free_ports(2)
    peer = Worker("peer", ["--model", str(model), "--device", "cpu", "--dtype", "float32"], tmp_path, port, rpc)
    try:
        peer.wait_ready()
        head = _serve(tmp_path, model, "--peer", peer.rpc_addr, "--split", "1/1", "--peer-wait", "30")
        try:
            assert [s["role"] for s in head.status()["stages"]] == ["head", "peer"]
            _check_equal_and_counted(head.url)
        finally:
            head.stop()
    finally:
        peer.stop()


def test_draft_model_server(tmp_path, tiny_model):
    """`--spec-type draft --model-draft`: a second GGUF with the same vocabulary drafts; the
    output is the plain greedy output."""
    head = _serve(
        tmp_path,
        tiny_model("llama"),
        "--spec-type",
        "draft",
        "--model-draft",
        str(tiny_model("llama", seed=7, n_layers=1)),
        "--draft-p-min",
        "0",
    )
    try:
        plain = _complete(head.url, PROMPTS[2], speculative={"type": "off"})
        spec = _complete(head.url, PROMPTS[2])
        assert spec["choices"][0]["text"] == plain["choices"][0]["text"]
        assert spec["timings"]["draft_n"] > 0
        assert head.status()["speculative"]["type"] == "draft"
    finally:
        head.stop()


def test_mtp_flag_is_a_clear_error(tiny_model):
    """No supported GGUF carries an MTP head: `--spec-type mtp` exits 2 with one line saying so."""
    model, port = str(tiny_model("llama")), str(free_ports(1)[0])
    r = engine_cli("serve", "--model", model, "--port", port, "--device", "cpu", "--spec-type", "mtp", timeout=120)
    assert r.returncode == 2, r.stderr
    assert "no multi-token-prediction head" in r.stderr and "Traceback" not in r.stderr
