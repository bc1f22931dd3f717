"""`hydra-engine serve` as a real process on a real port, driven by the official openai client."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from rpc_workers import HTTP, Worker, free_ports, head, peer, running, wait_for

from hydra_console.contracts.status import Throughput

N_CTX, N_SLOTS = 256, 2
PROMPT = "the quick brown fox jumps over the lazy dog"


def api_server(model, log_dir) -> Worker:
    return head(model, log_dir, (), "--dtype", "float32", parallel=N_SLOTS, ctx=N_CTX)


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    with running(api_server(tiny_model("llama"), tmp_path_factory.mktemp("api"))) as w:
        yield w.url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model_id(client):
    return client.models.list().data[0].id


def greedy(client, model_id, prompt=PROMPT, **kw):
    return client.completions.create(model=model_id, prompt=prompt, temperature=0, **kw)


def metrics(base: str) -> dict[str, float]:
    text = HTTP.get(f"{base}/metrics").text
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples if not s.labels}


# ---- health, models, tokenizer -----------------------------------------------------------------


def _health(w: Worker, seen: list) -> bool:
    try:
        r = HTTP.get(f"{w.url}/health", timeout=2.0)
    except httpx.HTTPError:
        return False
    seen.append((r.status_code, r.json()))
    return True


def test_health_is_staged_and_503_until_ready(tiny_model, tmp_path):
    # The head waits for its peer, which starts only once the head has answered 503 "starting":
    # every stage is seen however slow the machine (a solo tiny model can load between two polls).
    model, seen = tiny_model("llama"), []
    port, rpc = free_ports(2)
    w = head(model, tmp_path, (), "--dtype", "float32", "--peer", f"127.0.0.1:{rpc}", "--peer-wait", "120")
    p = None
    try:
        wait_for(lambda: _health(w, seen), 90, "the head's port to answer")
        p = Worker("peer", ["--model", str(model), "--device", "cpu", "--dtype", "float32"], tmp_path, port, rpc)
        w.wait_ready(timeout=120, seen=seen)
    finally:
        w.stop()
        if p is not None:
            p.stop()
    codes = [c for c, _ in seen]
    stages = [b["startup_stage"] for _, b in seen]
    # the port answers before the model is loaded (torch alone takes longer than a poll)
    assert codes[0] == 503 and seen[0][1]["status"] == "starting"
    last = seen[-1][1]
    assert codes[-1] == 200 and (last["status"], last["startup_stage"], last["has_model"]) == ("ok", 5, True)
    assert last["model_name"] and isinstance(last["rpc_active"], bool)
    assert all(c == 503 for c in codes[:-1]) and stages == sorted(stages) and stages[-1] == 5


def test_slot_save_is_off_without_a_save_path(server):
    r = HTTP.post(f"{server}/slots/0", params={"action": "save"}, json={"filename": "a.bin"})
    assert r.status_code == 501 and "--slot-save-path" in r.json()["error"]["message"]


def test_models_and_tokenize_roundtrip(server, model_id):
    base = server
    models = HTTP.get(f"{base}/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == model_id
    ids = HTTP.post(f"{base}/tokenize", json={"content": PROMPT}).json()["tokens"]
    with_bos = HTTP.post(f"{base}/tokenize", json={"content": PROMPT, "add_special": True}).json()["tokens"]
    assert len(with_bos) == len(ids) + 1 and with_bos[1:] == ids
    assert HTTP.post(f"{base}/detokenize", json={"tokens": ids}).json() == {"content": PROMPT}
    pieces = HTTP.post(f"{base}/tokenize", json={"content": PROMPT, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == ids and "".join(p["piece"] for p in pieces).strip() == PROMPT


# ---- completions ---------------------------------------------------------------------------------


def test_completion_plain_and_streamed_agree_with_exact_usage(server, client, model_id):
    base = server
    n_prompt = len(HTTP.post(f"{base}/tokenize", json={"content": PROMPT, "add_special": True}).json()["tokens"])
    full = greedy(client, model_id, max_tokens=10, extra_body={"ignore_eos": True})
    assert full.choices[0].finish_reason == "length"
    assert (full.usage.prompt_tokens, full.usage.completion_tokens, full.usage.total_tokens) == (
        n_prompt,
        10,
        n_prompt + 10,
    )
    timings = full.model_extra["timings"]
    assert timings["prompt_n"] == n_prompt and timings["predicted_n"] == 10 and timings["draft_n"] == 0

    chunks = list(greedy(client, model_id, max_tokens=10, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 10


def test_token_id_prompt_equals_text_prompt(server, client, model_id):
    base = server
    ids = HTTP.post(f"{base}/tokenize", json={"content": PROMPT, "add_special": True}).json()["tokens"]
    a = greedy(client, model_id, max_tokens=8, extra_body={"ignore_eos": True})
    b = greedy(client, model_id, prompt=ids, max_tokens=8, extra_body={"ignore_eos": True})
    c = greedy(client, model_id, prompt=[ids], max_tokens=8, extra_body={"ignore_eos": True})
    assert a.choices[0].text == b.choices[0].text == c.choices[0].text
    assert b.usage.prompt_tokens == len(ids)


def test_prompt_scoring_with_echo_and_token_ids(server, client, model_id):
    base = server
    ids = HTTP.post(f"{base}/tokenize", json={"content": PROMPT, "add_special": True}).json()["tokens"]
    r = client.completions.create(
        model=model_id, prompt=ids, echo=True, logprobs=1, max_tokens=0, extra_body={"return_tokens_as_token_ids": True}
    )
    lp = r.choices[0].logprobs
    assert lp.tokens == [f"token_id:{t}" for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x < 0 for x in lp.token_logprobs[1:]) and len(lp.token_logprobs) == len(ids)
    assert all(len(t) == 1 and next(iter(t)).startswith("token_id:") for t in lp.top_logprobs[1:])
    assert r.usage.completion_tokens == 0 and r.choices[0].text == PROMPT
    # the greedy token after a prefix is the top alternative there, with the same logprob as scoring it
    nxt = (
        greedy(
            client,
            model_id,
            prompt=ids[:5],
            max_tokens=1,
            logprobs=1,
            extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True},
        )
        .choices[0]
        .logprobs
    )
    assert nxt.tokens == [next(iter(lp.top_logprobs[5]))]
    assert nxt.token_logprobs[0] == pytest.approx(next(iter(lp.top_logprobs[5].values())), abs=1e-4)


def test_generated_logprobs_shape(server, client, model_id):
    r = greedy(client, model_id, max_tokens=5, logprobs=3, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    for _tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and max(top.values()) == pytest.approx(val, abs=1e-5)  # greedy = the top one
    assert lp.text_offset == sorted(lp.text_offset)


def test_stop_strings(server, client, model_id):
    ref = greedy(client, model_id, max_tokens=24, extra_body={"ignore_eos": True}).choices[0].text
    at = next(i for i in range(3, len(ref) - 2) if ref.find(ref[i : i + 2]) == i)
    r = greedy(client, model_id, max_tokens=24, stop=[ref[at : at + 2]], extra_body={"ignore_eos": True})
    assert r.choices[0].text == ref[:at] and r.choices[0].finish_reason == "stop"
    streamed = greedy(
        client, model_id, max_tokens=24, stop=ref[at : at + 2], stream=True, extra_body={"ignore_eos": True}
    )
    assert "".join(c.choices[0].text for c in streamed) == ref[:at]


def test_seed_reproducibility(client, model_id):
    def sample(seed):
        return (
            client.completions.create(
                model=model_id,
                prompt=PROMPT,
                max_tokens=12,
                temperature=1.5,
                seed=seed,
                extra_body={"ignore_eos": True},
            )
            .choices[0]
            .text
        )

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


# ---- chat -----------------------------------------------------------------------------------------


def test_chat_plain_and_streamed(client, model_id):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    full = client.chat.completions.create(
        model=model_id,
        messages=messages,
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    msg = full.choices[0].message
    assert msg.role == "assistant" and full.usage.completion_tokens == 8 and full.choices[0].finish_reason == "length"
    content = full.choices[0].logprobs.content
    assert len(content) == 8 and all(len(c.top_logprobs) == 2 for c in content)
    assert "".join(c.token for c in content) == msg.content

    stream = client.chat.completions.create(
        model=model_id,
        messages=messages,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == msg.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


# ---- batching, disconnects, metrics ------------------------------------------------------------------


def test_concurrent_requests_equal_sequential_ones(server, client, model_id):
    base = server
    prompts = ["hello world", "night and day", "a b c d", "the lazy dog", "fox over dog"]
    single = [
        greedy(client, model_id, prompt=p, max_tokens=10, extra_body={"ignore_eos": True}).choices[0].text
        for p in prompts
    ]
    before = metrics(base)
    out: dict[int, str] = {}

    def one(i, p):
        out[i] = greedy(client, model_id, prompt=p, max_tokens=10, extra_body={"ignore_eos": True}).choices[0].text

    threads = [threading.Thread(target=one, args=(i, p)) for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert [out.get(i) for i in range(len(prompts))] == single
    after = metrics(base)
    assert after["llamacpp:tokens_predicted_total"] - before["llamacpp:tokens_predicted_total"] == 50
    # 5 requests x 10 tokens over 2 slots in clearly fewer forward steps than tokens
    assert after["llamacpp:n_decode_total"] - before["llamacpp:n_decode_total"] < 50


def test_disconnect_frees_the_slot(server):
    base = server
    body = {"prompt": PROMPT, "max_tokens": N_CTX - 40, "stream": True, "ignore_eos": True, "temperature": 0}
    with httpx.Client(timeout=30) as h:
        with h.stream("POST", f"{base}/v1/completions", json=body) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["choices"][0]["finish_reason"] is None
            assert any(s["state"] == "processing" for s in HTTP.get(f"{base}/slots").json())
    deadline = time.monotonic() + 60  # a wait: the server notices at its next write, later on a loaded machine
    while time.monotonic() < deadline:
        if all(s["state"] == "idle" for s in HTTP.get(f"{base}/slots").json()):
            break
        time.sleep(0.05)
    assert all(s["state"] == "idle" for s in HTTP.get(f"{base}/slots").json())
    m = metrics(base)
    assert m["llamacpp:requests_processing"] == 0 and m["llamacpp:requests_deferred"] == 0


def test_metrics_names_and_counters_move(server, client, model_id):
    base = server
    before = metrics(base)
    greedy(client, model_id, max_tokens=4, extra_body={"ignore_eos": True})
    after = metrics(base)
    for name in (
        "prompt_tokens_total",
        "prompt_seconds_total",
        "tokens_predicted_total",
        "tokens_predicted_seconds_total",
        "requests_processing",
        "requests_deferred",
        "spec_decode_num_draft_tokens_total",
        "spec_decode_num_accepted_tokens_total",
        "spec_decode_num_drafts_total",
    ):
        assert f"llamacpp:{name}" in after
    assert after["llamacpp:tokens_predicted_total"] - before["llamacpp:tokens_predicted_total"] == 4
    assert after["llamacpp:prompt_tokens_total"] > before["llamacpp:prompt_tokens_total"]
    assert after["llamacpp:prompt_seconds_total"] > before["llamacpp:prompt_seconds_total"]
    assert after["hydra_startup_stage"] == 5


def test_status_document(server, client, model_id):
    base = server
    greedy(client, model_id, max_tokens=2)  # the steps below need one, whichever tests ran before
    doc = HTTP.get(f"{base}/status").json()
    assert doc["role"] == "head" and doc["pid"] > 0 and doc["state"] == "ok" and doc["startup_stage"] == 5
    assert doc["model"]["arch"] == "llama" and doc["model"]["n_layers"] == 2 and len(doc["model"]["fingerprint"]) == 32
    [stage] = doc["stages"]
    assert stage.pop("kv_bytes") > 0 and stage.pop("weight_bytes") > 0
    assert stage.pop("steps")["eager: no graphs"] > 0  # CPU: every pass over the layers eager
    assert stage == {"role": "head", "addr": None, "layers": [0, 2], "device": "cpu", "state": "ok"}
    assert doc["devices"] and doc["devices"][0]["memory_total"] > 0
    assert doc["throughput"]["decode_tokens_total"] > 0
    assert [s["id"] for s in doc["slots"]] == list(range(N_SLOTS))
    assert doc["speculative"]["type"] == "off"


ROUNDING_S = 2e-4  # /status's seconds are rounded to 4 decimals: two differences of them compared


def test_the_steps_wall_time_is_split_by_phase(server, client, model_id):
    """/status `throughput.step_phase_s`: where the steps' wall time went (schedule, forward, read,
    emit), totals that grow with the steps and never count a second twice; the steps that held the
    prompt apart (`prompt_steps_total`, `prompt_step_phase_s`), so a decode step's average is known."""
    before = HTTP.get(f"{server}/status").json()["throughput"]
    t0 = time.perf_counter()
    greedy(client, model_id, max_tokens=12, extra_body={"ignore_eos": True, "cache_prompt": False})
    elapsed = time.perf_counter() - t0
    after = HTTP.get(f"{server}/status").json()["throughput"]
    grew = {k: after["step_phase_s"][k] - before["step_phase_s"][k] for k in before["step_phase_s"]}
    assert set(grew) == {"schedule", "forward", "read", "emit"} and min(grew.values()) >= 0
    assert after["steps_total"] >= before["steps_total"] + 12
    assert grew["forward"] > 0 and 0 < sum(grew.values()) <= elapsed  # on a CPU the forward runs in it
    prompt_steps = after["prompt_steps_total"] - before["prompt_steps_total"]
    prompt = {k: after["prompt_step_phase_s"][k] - before["prompt_step_phase_s"][k] for k in grew}
    assert prompt_steps >= 1 and after["steps_total"] - before["steps_total"] - prompt_steps >= 11
    # /status rounds each total to 0.1 ms (monotone, so no difference is negative), two differences
    # compared are off by up to 0.2 ms
    assert prompt["forward"] > 0 and all(0 <= prompt[k] <= grew[k] + ROUNDING_S for k in grew)
    decode = Throughput.from_json(after).step_ms_since(Throughput.from_json(before), decode_only=True)
    assert set(decode) == set(grew) and min(decode.values()) >= -ROUNDING_S * 1e3


# ---- errors ---------------------------------------------------------------------------------------


def test_over_context_prompt_is_a_400(client, model_id):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model_id, prompt="word " * 300, max_tokens=5)
    assert e.value.status_code == 400
    err = e.value.body
    assert set(err) >= {"message", "type", "param", "code"} and "context" in err["message"]


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
        ("/v1/completions", {"prompt": "x", "logprobs": 50}, "logprobs"),
        ("/v1/completions", {"prompt": [5, 10**9]}, "prompt"),
        ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
        ("/v1/completions", {"max_tokens": 3}, "prompt"),
        ("/v1/completions", {"prompt": "x", "stop": [""]}, "stop"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/tokenize", {"content": 5}, "content"),
    ],
)
def test_bad_requests_get_openai_errors(server, path, body, param):
    base = server
    r = HTTP.post(f"{base}{path}", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    bad_json = HTTP.post(f"{base}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert bad_json.status_code == 400 and "error" in bad_json.json()
    assert HTTP.get(f"{base}/nope").json()["error"]["code"] == "not_found"


# ---- overlap ------------------------------------------------------------------------------------------


def test_overlap_through_http_and_a_peer_streams_what_the_synchronous_server_does(
    server, client, model_id, tiny_model, tmp_path
):
    """`serve --overlap --no-mixed-steps` (a GPU's defaults, here on a CPU; a head with one peer: the
    split path too), streamed through the openai client, concurrent requests: greedy with a stop
    string and logprobs, and seeded sampling, give what the synchronous, mixed-step solo server gives."""
    model = tiny_model("llama")
    with (
        running(peer(model, tmp_path, "--dtype", "float32")) as p,
        running(
            head(
                model, tmp_path, [p], "--dtype", "float32", "--overlap", "--no-mixed-steps", parallel=N_SLOTS, ctx=N_CTX
            )
        ) as w,
    ):
        other = openai.OpenAI(base_url=f"{w.url}/v1", api_key="none", max_retries=0, timeout=60)
        ref = greedy(client, model_id, max_tokens=24, extra_body={"ignore_eos": True}).choices[0].text
        at = next(i for i in range(3, len(ref) - 2) if ref.find(ref[i : i + 2]) == i)
        asks = [
            dict(prompt=PROMPT, temperature=0, max_tokens=24, stop=[ref[at : at + 2]], logprobs=2),
            dict(prompt="night and day", temperature=1.5, seed=11, max_tokens=12),
            dict(prompt="hello world", temperature=0, max_tokens=9),
        ]

        def streamed(c, ask):
            chunks = list(c.completions.create(model=model_id, stream=True, extra_body={"ignore_eos": True}, **ask))
            lps = [t for ch in chunks if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.tokens]
            return (
                "".join(ch.choices[0].text for ch in chunks if ch.choices),
                [ch.choices[0].finish_reason for ch in chunks][-1],
                lps,
            )

        want = [streamed(client, a) for a in asks]
        assert want[0][:2] == (ref[:at], "stop")
        got: dict[int, tuple] = {}
        threads = [
            threading.Thread(target=lambda i=i, a=a: got.__setitem__(i, streamed(other, a))) for i, a in enumerate(asks)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert [got.get(i) for i in range(len(asks))] == want
        config = w.status()["config"]
        assert config["overlap"] is True and config["mixed_steps"] is False


@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", "text/plain", "multipart/form-data"])
@pytest.mark.parametrize(
    "path, body, answered",
    [
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 3}, lambda a: a["usage"]["completion_tokens"] == 3),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "ignore_eos": True},
            lambda a: a["usage"]["completion_tokens"] == 3,
        ),
        ("/completion", {"prompt": PROMPT, "n_predict": 3, "ignore_eos": True}, lambda a: a["tokens_predicted"] == 3),
        ("/tokenize", {"content": PROMPT}, lambda a: len(a["tokens"]) > 3),
    ],
)
def test_a_json_body_is_read_as_json_whatever_its_content_type(server, path, body, answered, content_type):
    """curl's `-d` without `-H 'Content-Type: application/json'` sends form-urlencoded: llama-server
    reads the body as JSON anyway, and so do we. A body that is not JSON stays a 400 in OpenAI's shape."""
    r = HTTP.post(f"{server}{path}", content=json.dumps(body).encode(), headers={"content-type": content_type})
    assert r.status_code == 200 and answered(r.json()), r.text
    bad = HTTP.post(f"{server}{path}", content=b"prompt=hi&max_tokens=3", headers={"content-type": content_type})
    assert bad.status_code == 400, bad.text
    err = bad.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] is None, err
    assert err["message"] == "the request body is not valid JSON: Expecting value at character 0"
