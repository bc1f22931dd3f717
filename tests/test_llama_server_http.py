"""llama-server's HTTP surface around the routes: CORS (preflight without the API key), /slots
(`is_processing`, --no-slots), /metrics (--no-metrics, Process-Start-Time-Unix, the cached-prompt
and busy-slot metrics) and /models (--alias, --tags). Real `hydra-engine serve` processes."""

from __future__ import annotations

import re
import threading

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from rpc_workers import HTTP, head, running, wait_for

from hydra_console.engine.http.cors import Cors

KEY = "s3cret"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "the quick brown fox jumps over the lazy dog"
# tokens of the request /slots must catch busy: ~2,000 decode steps of the tiny model outlast many
# polls on any machine (100 could end between two polls of a loaded one, as CI saw)
N_BUSY = 2000


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    """Defaults but for an API key and several aliases."""
    w = head(
        tiny_model("llama"),
        tmp_path_factory.mktemp("llama-http"),
        (),
        "--api-key",
        KEY,
        "--alias",
        "tiny-zeta, tiny-alpha,tiny-mid",
        "--tags",
        "small,test",
        parallel=2,
        ctx=N_BUSY + 64,
    )
    with running(w):
        yield w.url


@pytest.fixture(scope="module")
def locked_down(tiny_model, tmp_path_factory):
    """--no-slots --no-metrics --cors-origins localhost."""
    w = head(
        tiny_model("llama"),
        tmp_path_factory.mktemp("llama-http-off"),
        (),
        "--no-slots",
        "--no-metrics",
        "--cors-origins",
        "localhost",
        parallel=1,
        ctx=64,
    )
    with running(w):
        yield w.url


def preflight(base: str, path: str, origin: str) -> httpx.Response:
    return httpx.options(
        f"{base}{path}",
        headers={
            "Origin": origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "Authorization",
        },
    )


# ---- CORS ---------------------------------------------------------------------------------------


@pytest.mark.unit
def test_allowed_origin_by_setting():
    star, local = Cors(None), Cors(None, origins="localhost")
    listed = Cors(None, origins="https://a.org, https://b.org")
    assert star.allowed("https://anything.example") == "https://anything.example" and star.allowed(None) is None
    for origin in ("http://localhost", "http://localhost:8080", "http://127.0.0.1:3000", "http://[::1]:3000"):
        assert local.allowed(origin) == origin
    for origin in ("http://evil.com", "http://localhost.evil.com", "http://notlocalhost", "localhost"):
        assert local.allowed(origin) is None
    assert listed.allowed("https://b.org") == "https://b.org" and listed.allowed("https://c.org") is None


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/completions", "/v1/embeddings", "/no/such/route"])
def test_preflight_needs_no_key_and_answers_like_llama_server(server, path):
    r = preflight(server, path, "http://web.example")
    assert r.status_code == 200 and r.content == b""
    h = r.headers
    assert h["Access-Control-Allow-Origin"] == "http://web.example"
    assert h["Access-Control-Allow-Credentials"] == "true"
    assert h["Access-Control-Allow-Methods"] == "GET, POST, DELETE, OPTIONS"
    assert h["Access-Control-Allow-Headers"] == "*"
    # llama-server's spelling on the wire: its own tests read the names into a plain dict
    assert {
        b"Access-Control-Allow-Origin",
        b"Access-Control-Allow-Credentials",
        b"Access-Control-Allow-Methods",
        b"Access-Control-Allow-Headers",
    } <= {name for name, _ in h.raw}


def test_responses_carry_the_allowed_origin_and_the_key_still_holds(server):
    origin = {"Origin": "http://web.example"}
    refused = HTTP.get(f"{server}/v1/models", headers=origin)
    assert refused.status_code == 401 and refused.headers["Access-Control-Allow-Origin"] == "http://web.example"
    ok = HTTP.get(f"{server}/v1/models", headers={**origin, **AUTH})
    assert ok.status_code == 200 and ok.headers["Access-Control-Allow-Origin"] == "http://web.example"
    assert "Access-Control-Allow-Origin" not in HTTP.get(f"{server}/v1/models", headers=AUTH).headers


def test_localhost_origins_only(locked_down):
    assert preflight(locked_down, "/completions", "http://127.0.0.1:3000").headers["Access-Control-Allow-Origin"] == (
        "http://127.0.0.1:3000"
    )
    r = preflight(locked_down, "/completions", "http://evil.com")
    assert r.status_code == 200 and "Access-Control-Allow-Origin" not in r.headers
    r = HTTP.get(f"{locked_down}/health", headers={"Origin": "http://evil.com"})
    assert "Access-Control-Allow-Origin" not in r.headers


# ---- /slots ---------------------------------------------------------------------------------------


def test_slots_show_is_processing_while_a_request_runs(server):
    idle = HTTP.get(f"{server}/slots", headers=AUTH).json()
    assert len(idle) == 2 and all(s["is_processing"] is False and "params" not in s for s in idle)
    assert all({"id", "n_ctx", "speculative"} <= set(s) for s in idle)
    client = openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=120)
    done: list = []  # the request's outcome: an error there must not read as "never busy"

    def request() -> None:
        try:
            done.append(
                client.completions.create(
                    model="m", prompt=PROMPT, max_tokens=N_BUSY, temperature=0, extra_body={"ignore_eos": True}
                )
            )
        except Exception as e:
            done.append(e)

    def busy_slots() -> list:
        assert not done, f"the request ended before a poll saw its slot: {done[0]!r}"
        return [s for s in HTTP.get(f"{server}/slots", headers=AUTH).json() if s["is_processing"]]

    t = threading.Thread(target=request)
    t.start()
    try:
        s = wait_for(busy_slots, 60, "a busy slot")[0]
        assert s["params"]["n_predict"] == N_BUSY and s["params"]["temperature"] == 0
        assert s["next_token"][0]["n_remain"] == N_BUSY - s["next_token"][0]["n_decoded"]
        # one slot busy of two: not "no slot available"
        assert HTTP.get(f"{server}/slots", params={"fail_on_no_slot": 1}, headers=AUTH).status_code == 200
    finally:
        t.join(60)
    assert not any(s["is_processing"] for s in HTTP.get(f"{server}/slots", headers=AUTH).json())
    assert done and done[0].usage.completion_tokens == N_BUSY


def test_no_slots_and_no_metrics_answer_501(locked_down):
    for path, name in (("/slots", "slots"), ("/metrics", "metrics")):
        r = HTTP.get(f"{locked_down}{path}")
        assert r.status_code == 501, r.text
        err = r.json()["error"]
        assert err["type"] == "not_supported_error" and f"does not support {name} endpoint" in err["message"]


# ---- /metrics ---------------------------------------------------------------------------------------


def scrape(base: str) -> tuple[httpx.Response, dict[str, tuple[str, float]]]:
    r = HTTP.get(f"{base}/metrics")
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            if s.name.startswith("llamacpp:") and not s.labels:
                out[s.name] = (fam.type, s.value)
    return r, out


def test_metrics_are_public_and_carry_llama_servers_names(server):
    r, m = scrape(server)  # no key: public, as the console polls it
    assert r.status_code == 200 and int(r.headers["Process-Start-Time-Unix"]) > 1_600_000_000
    assert b"Process-Start-Time-Unix" in [name for name, _ in r.headers.raw]  # llama-server's spelling on the wire
    client = openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=120)
    # the same prompt twice: the second reuses the first one's prefix, and its usage says how much
    runs = [client.completions.create(model="m", prompt=PROMPT, max_tokens=4, temperature=0) for _ in range(2)]
    assert runs[1].usage.prompt_tokens_details.cached_tokens == runs[1].model_extra["timings"]["cache_n"] > 0
    _, after = scrape(server)
    for name in (
        "prompt_tokens_total",
        "prompt_tokens_cached_total",
        "prompt_seconds_total",
        "tokens_predicted_total",
        "tokens_predicted_seconds_total",
        "n_decode_total",
    ):
        assert after[f"llamacpp:{name}"][0] == "counter", name
    for name in (
        "prompt_tokens_seconds",
        "predicted_tokens_seconds",
        "requests_processing",
        "requests_deferred",
        "n_busy_slots_per_decode",
    ):
        assert after[f"llamacpp:{name}"][0] == "gauge", name
    # llama-server's one counter without `_total`, a high watermark
    text = HTTP.get(f"{server}/metrics").text
    assert "# TYPE llamacpp:n_tokens_max counter" in text
    assert float(re.search(r"^llamacpp:n_tokens_max (\S+)$", text, re.M).group(1)) >= len(PROMPT.split())
    cached = after["llamacpp:prompt_tokens_cached_total"][1] - m["llamacpp:prompt_tokens_cached_total"][1]
    assert cached > 0
    assert after["llamacpp:n_busy_slots_per_decode"][1] >= 1.0


# ---- /models ----------------------------------------------------------------------------------------


def test_models_list_aliases_and_the_first_is_the_id(server):
    for path in ("/v1/models", "/models"):
        model = HTTP.get(f"{server}{path}", headers=AUTH).json()["data"][0]
        assert model["aliases"] == ["tiny-alpha", "tiny-mid", "tiny-zeta"] and model["id"] == "tiny-alpha"
        assert model["tags"] == ["small", "test"]
    client = openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=60)
    assert client.models.list().data[0].id == "tiny-alpha"
