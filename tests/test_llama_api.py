"""llama-server's native endpoints and shapes, against `hydra-engine serve` as a real process on a
real port (raw httpx and the official openai client), started with llama-server's flag names."""

from __future__ import annotations

import json
import socket

import httpx
import openai
import pytest
from rpc_workers import HTTP, Worker, free_ports, running

from hydra_console.engine.cli import build_parser
from hydra_console.engine.cli_config import head_config
from hydra_console.engine.synth import FIM_TOKENS
from hydra_console.engine.text.tokenizer import Tokenizer, fim_tokens

N_CTX, N_SLOTS, N_PREDICT, SEED = 256, 2, 6, 7
PROMPT = "the quick brown fox jumps over the lazy dog"
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the quick brown fox"}]


def llama_head(model, log_dir, *extra: str, n_ctx: int = N_CTX) -> Worker:
    """A head started as llama-server would be: -c is the total context of the -np slots."""
    port, rpc = free_ports(2)
    argv = [
        "-m",
        str(model),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "-np",
        str(N_SLOTS),
        "-c",
        str(n_ctx * N_SLOTS),
        "-n",
        str(N_PREDICT),
        "--temp",
        "0",
        "--seed",
        str(SEED),
        "--jinja",
        "--chat-template",
        "chatml",
        *extra,
    ]
    return Worker("serve", argv, log_dir, port, rpc)


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    with running(llama_head(tiny_model("llama"), tmp_path_factory.mktemp("llama-api"))) as w:
        yield w.url


def post(base: str, path: str, body: dict) -> httpx.Response:
    return HTTP.post(f"{base}{path}", json=body, timeout=60)


def sse_events(base: str, path: str, body: dict) -> tuple[list[dict], list[str]]:
    """The stream's JSON events and its raw data lines (to see whether a [DONE] came)."""
    with HTTP.stream("POST", f"{base}{path}", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
    return [json.loads(x) for x in lines if x != "[DONE]"], lines


def tokenize(base: str, text: str, add_special: bool = True) -> list[int]:
    return post(base, "/tokenize", {"content": text, "add_special": add_special}).json()["tokens"]


# ---- /completion ------------------------------------------------------------------------------------


def test_completion_native_shape_and_prompt_forms(server):
    r = post(server, "/completion", {"prompt": PROMPT, "n_predict": 4, "return_tokens": True, "ignore_eos": True})
    assert r.status_code == 200
    body = r.json()
    ids = tokenize(server, PROMPT)
    assert body["stop"] is True and body["stop_type"] == "limit" and body["truncated"] is False
    assert body["tokens_predicted"] == 4 and body["tokens_evaluated"] == len(ids) and len(body["tokens"]) == 4
    assert body["timings"]["predicted_n"] == 4 and body["timings"]["prompt_n"] + body["timings"]["cache_n"] == len(ids)
    assert isinstance(body["has_new_line"], bool) and body["id_slot"] in range(N_SLOTS)
    assert post(server, "/detokenize", {"tokens": body["tokens"]}).json()["content"] == body["content"]
    settings = body["generation_settings"]
    assert (settings["seed"], settings["temperature"], settings["n_predict"]) == (SEED, 0.0, 4)
    # without return_tokens the list is empty; /completions is the same endpoint
    same = post(server, "/completions", {"prompt": PROMPT, "n_predict": 4, "ignore_eos": True}).json()
    assert same["content"] == body["content"] and same["tokens"] == []
    # token ids, {"prompt_string"}, a list mixing ids and text: the same prompt
    for prompt in (ids, {"prompt_string": PROMPT}, [ids[0], PROMPT.split(" ", 1)[0], " " + PROMPT.split(" ", 1)[1]]):
        got = post(server, "/completion", {"prompt": prompt, "n_predict": 4, "ignore_eos": True}).json()
        assert got["content"] == body["content"], prompt
    # a list without ids at its top level is a list of prompts: a list of results, in order
    many = post(server, "/completion", {"prompt": [ids, PROMPT, "the lazy dog"], "n_predict": 4, "ignore_eos": True})
    assert [x["index"] for x in many.json()] == [0, 1, 2]
    assert many.json()[0]["content"] == many.json()[1]["content"] == body["content"]


def test_completion_n_predict_defaults_to_dash_n_and_the_request_overrides_it(server):
    """As llama-server (this version): the request's n_predict wins; absent or -1, the server's `-n`."""
    for n, want in ((None, N_PREDICT), (-1, N_PREDICT), (100, 100)):
        body = post(server, "/completion", {"prompt": PROMPT, "ignore_eos": True, **({"n_predict": n} if n else {})})
        assert body.json()["tokens_predicted"] == want


def test_completion_n_probs_and_response_fields(server):
    body = post(server, "/completion", {"prompt": PROMPT, "n_predict": 3, "n_probs": 4, "ignore_eos": True}).json()
    probs = body["completion_probabilities"]
    assert len(probs) == 3 and "".join(p["token"] for p in probs) == body["content"]
    for p in probs:
        assert p["logprob"] <= 0 and bytes(p["bytes"]).decode() == p["token"] and len(p["top_logprobs"]) == 4
        assert p["id"] == p["top_logprobs"][0]["id"]  # greedy: the chosen token is the most likely one
    only = post(
        server,
        "/completion",
        {"prompt": PROMPT, "n_predict": 2, "response_fields": ["content", "generation_settings/n_predict"]},
    ).json()
    assert set(only) == {"content", "generation_settings/n_predict"} and only["generation_settings/n_predict"] == 2


def test_completion_post_sampling_probs(server):
    """post_sampling_probs: probabilities of what the sampler drew from; top_k 3 leaves 3 tokens whose
    probabilities sum to 1, the chosen one among them."""
    body = {
        "prompt": PROMPT,
        "n_predict": 3,
        "n_probs": 5,
        "ignore_eos": True,
        "temperature": 1.0,
        "top_k": 3,
        "post_sampling_probs": True,
    }
    got = post(server, "/completion", body).json()
    assert got["generation_settings"]["post_sampling_probs"] is True
    for p in got["completion_probabilities"]:
        top = p["top_probs"]
        assert len(top) == 3 and sum(t["prob"] for t in top) == pytest.approx(1.0, abs=1e-5)
        assert p["id"] in [t["id"] for t in top] and 0 < p["prob"] <= 1 and "logprob" not in p


def test_completion_stream_is_one_chunk_per_token(server):
    body = {"prompt": PROMPT, "n_predict": 5, "ignore_eos": True, "n_probs": 2}
    plain = post(server, "/completion", body).json()
    events, lines = sse_events(server, "/completion", {**body, "stream": True})
    assert "[DONE]" not in lines  # llama-server's own stream has no [DONE]
    *parts, last = events
    assert all(e["stop"] is False and len(e["tokens"]) == 1 and len(e["completion_probabilities"]) == 1 for e in parts)
    assert [e["tokens_predicted"] for e in parts] == list(range(1, 6))
    assert last["stop"] is True and last["stop_type"] == "limit" and last["timings"]["predicted_n"] == 5
    assert "".join(e["content"] for e in events) == plain["content"]


def test_completion_stop_word_is_reported(server):
    text = post(server, "/completion", {"prompt": PROMPT, "n_predict": 6, "ignore_eos": True}).json()["content"]
    word = text.strip().split(" ")[0] if text.strip() else text
    got = post(server, "/completion", {"prompt": PROMPT, "n_predict": 6, "ignore_eos": True, "stop": [word]}).json()
    assert (got["stop_type"], got["stopping_word"]) == ("word", word) and word not in got["content"]


def test_completion_refuses_bad_prompts_and_samplers(server):
    assert post(server, "/completion", {"prompt": [[1, 2], {"x": 1}]}).status_code == 400
    assert post(server, "/completion", {"prompt": [5, 10**9]}).json()["error"]["param"] == "prompt"
    r = post(server, "/completion", {"prompt": "x", "samplers": ["mirostat"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "samplers"


# ---- context overflow ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path,body",
    [
        ("/completion", {"prompt": "word " * 300}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 300}]}),
        ("/v1/completions", {"prompt": "word " * 300}),
    ],
)
def test_context_overflow_is_exceed_context_size_error(server, path, body):
    r = post(server, path, body)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "exceed_context_size_error" and err["n_ctx"] == N_CTX and err["n_prompt_tokens"] > N_CTX
    assert "exceeds the available context size" in err["message"]


# ---- /props, /apply-template, input_tokens -----------------------------------------------------------------


def test_props(server):
    props = HTTP.get(f"{server}/props").json()
    assert props["total_slots"] == N_SLOTS and props["default_generation_settings"]["n_ctx"] == N_CTX
    params = props["default_generation_settings"]["params"]
    assert (params["temperature"], params["seed"], params["n_predict"]) == (0.0, SEED, N_PREDICT)
    assert props["modalities"] == {"vision": False, "video": False, "audio": False}
    assert "<|im_start|>" in props["chat_template"] and props["model_path"].endswith(".gguf")
    assert props["build_info"].startswith("b")
    r = HTTP.post(f"{server}/props", json={})
    assert r.status_code == 501 and r.json()["error"]["type"] == "not_supported_error"


def test_apply_template_and_input_tokens(server):
    prompt = post(server, "/apply-template", {"messages": CHAT}).json()["prompt"]
    assert (
        prompt == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nthe quick brown fox<|im_end|>\n"
        "<|im_start|>assistant\n"
    )  # --chat-template chatml
    bare = post(server, "/apply-template", {"messages": CHAT, "add_generation_prompt": False}).json()["prompt"]
    assert prompt.startswith(bare) and not bare.endswith("assistant\n")
    for path in ("/chat/completions/input_tokens", "/v1/chat/completions/input_tokens"):
        count = post(server, path, {"messages": CHAT}).json()
        assert count == {"object": "response.input_tokens", "input_tokens": len(tokenize(server, prompt))}


def test_assistant_prefill_and_continue_final_message(server, tiny_model):
    prefill = CHAT + [{"role": "assistant", "content": "the lazy"}]
    prompt = post(server, "/apply-template", {"messages": prefill}).json()["prompt"]
    assert prompt.endswith("<|im_start|>assistant\nthe lazy")  # the turn stays open, no generation prompt
    explicit = post(
        server, "/apply-template", {"messages": prefill, "add_generation_prompt": False, "continue_final_message": True}
    ).json()["prompt"]
    assert explicit == prompt
    closed = post(server, "/apply-template", {"messages": prefill, "continue_final_message": False}).json()["prompt"]
    assert closed.endswith("the lazy<|im_end|>\n<|im_start|>assistant\n")
    # text parts of the continued message join with a blank line (llama-server's render_content)
    parts = CHAT + [
        {"role": "assistant", "content": [{"type": "text", "text": "the"}, {"type": "text", "text": "lazy"}]}
    ]
    assert (
        post(server, "/apply-template", {"messages": parts})
        .json()["prompt"]
        .endswith("<|im_start|>assistant\nthe\n\nlazy")
    )
    # the chat generates from that open turn: its usage counts the prefilled prompt
    r = post(
        server, "/v1/chat/completions", {"messages": prefill, "max_tokens": 2, "ignore_eos": True, "verbose": True}
    ).json()
    ids = tokenize(server, prompt)
    assert r["usage"]["prompt_tokens"] == len(ids)
    # __verbose shows the prompt as the model saw it (llama-server's): its tokens as text, BOS first
    seen = post(server, "/detokenize", {"tokens": ids}).json()["content"]
    assert r["__verbose"]["prompt"] == seen and seen.startswith("<bos>") and seen.endswith(prompt)
    for bad in (
        {"messages": prefill + [{"role": "assistant", "content": "x"}]},
        {"messages": prefill, "add_generation_prompt": True, "continue_final_message": True},
    ):
        for path in ("/apply-template", "/v1/chat/completions"):
            r = post(server, path, bad)
            assert r.status_code == 400 and r.json()["error"]["message"].startswith("Cannot")


# ---- chat as llama-server streams it ---------------------------------------------------------------------


def test_chat_stream_shape_usage_and_timings(server):
    body = {"messages": CHAT, "max_tokens": 3, "ignore_eos": True, "stream": True}
    events, lines = sse_events(server, "/v1/chat/completions", body)
    assert lines[-1] == "[DONE]"
    first, *middle, finish = events
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": None} and "timings" not in first
    assert all("role" not in e["choices"][0]["delta"] and "timings" not in e for e in middle)
    assert finish["choices"][0]["delta"] == {} and finish["choices"][0]["finish_reason"] == "length"
    assert finish["timings"]["predicted_n"] == 3 and "usage" not in finish  # no usage chunk unless asked
    events, _ = sse_events(
        server, "/v1/chat/completions", {**body, "timings_per_token": True, "stream_options": {"include_usage": True}}
    )
    first, *middle, finish, usage = events
    assert "timings" not in first and all("predicted_per_second" in e["timings"] for e in middle)
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 3 and usage["timings"]["predicted_n"] == 3


def test_chat_openai_client_stream_and_cached_tokens(server):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=60)
    chunks = list(
        client.chat.completions.create(
            model="x", messages=CHAT, max_tokens=3, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content is None
    assert chunks[-1].usage.completion_tokens + 0 >= 1
    # the same prompt again: all but its last token comes from the slot's prompt cache
    again = client.chat.completions.create(model="x", messages=CHAT, max_tokens=3)
    n = again.usage.prompt_tokens
    assert again.usage.prompt_tokens_details.cached_tokens == n - 1
    assert again.model_extra["timings"]["cache_n"] == n - 1


def test_chat_without_max_tokens_stops_at_dash_n(server):
    r = post(server, "/v1/chat/completions", {"messages": CHAT, "ignore_eos": True}).json()
    assert r["usage"]["completion_tokens"] == N_PREDICT and r["choices"][0]["finish_reason"] == "length"


def test_server_seed_and_temperature_are_the_defaults(tiny_model, tmp_path):
    """--temp 1 --seed S: requests without them sample alike (the seed is the server's), and a
    request's own seed still wins; --reasoning is the template's enable_thinking."""
    thinking = "{{ 'T' if enable_thinking is defined and enable_thinking else 'F' }}"
    with running(
        llama_head(
            tiny_model("llama"),
            tmp_path,
            "--temp",
            "1",
            "--seed",
            "123",
            "--reasoning",
            "off",
            "--chat-template",
            thinking,
        )
    ) as w:
        # --reasoning off sets the template's enable_thinking; a request's chat_template_kwargs wins
        assert post(w.url, "/apply-template", {"messages": CHAT}).json()["prompt"] == "F"
        on = {"messages": CHAT, "chat_template_kwargs": {"enable_thinking": True}}
        assert post(w.url, "/apply-template", on).json()["prompt"] == "T"
        body = {"prompt": PROMPT, "n_predict": 8, "ignore_eos": True, "cache_prompt": False}
        a, b = (post(w.url, "/completion", body).json() for _ in range(2))
        assert a["content"] == b["content"] and a["generation_settings"]["seed"] == 123
        assert a["generation_settings"]["temperature"] == 1.0
        own = post(w.url, "/completion", {**body, "seed": 5}).json()
        assert own["generation_settings"]["seed"] == 5


def test_listens_on_every_comma_separated_host(tiny_model, tmp_path):
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    with running(llama_head(tiny_model("llama"), tmp_path, "--host", "127.0.0.1,::1")) as w:
        for host in ("127.0.0.1", "[::1]"):
            assert HTTP.get(f"http://{host}:{w.port}/health", timeout=10).status_code == 200


# ---- /infill -----------------------------------------------------------------------------------------------


def test_infill_without_fim_tokens_is_501(server):
    r = post(server, "/infill", {"input_prefix": "a", "input_suffix": "b"})
    assert r.status_code == 501 and "prefix token is missing" in r.json()["error"]["message"]


def test_infill_lays_out_fim_tokens(tiny_model, tmp_path):
    model = tiny_model("llama", fim=True)
    # room for extra context: llama-server gives it what the context leaves beyond a batch and 2 x -n
    with running(llama_head(model, tmp_path, n_ctx=1024)) as w:
        pre, suf, mid = (tokenize(w.url, t, add_special=False)[0] for t in FIM_TOKENS)
        body = {
            "input_prefix": "the quick",
            "prompt": " brown",
            "input_suffix": "lazy dog",
            "n_predict": 2,
            "ignore_eos": True,
            "return_tokens": True,
        }
        r = post(w.url, "/infill", body)
        assert r.status_code == 200, r.text
        out = r.json()
        enc = lambda t: tokenize(w.url, t, add_special=False)  # noqa: E731
        bos = tokenize(w.url, "")
        expected = bos + [pre, *enc("the quick"), *enc(" brown"), suf, *enc("lazy dog"), mid]
        assert out["tokens_evaluated"] == len(expected) and out["timings"]["predicted_n"] == 2
        # the same tokens as a plain completion give the same text
        plain = post(w.url, "/completion", {"prompt": expected, "n_predict": 2, "ignore_eos": True}).json()
        assert plain["content"] == out["content"]
        for extra in ([{}], [{"filename": 1, "text": "x"}], [{"text": 3}]):
            assert post(w.url, "/infill", {**body, "input_extra": extra}).status_code == 400
        assert post(w.url, "/infill", {"input_prefix": "a"}).status_code == 400  # input_suffix is required
        with_extra = post(w.url, "/infill", {**body, "input_extra": [{"filename": "f", "text": "the dog"}]}).json()
        assert with_extra["tokens_evaluated"] > len(expected)


@pytest.mark.unit
def test_fim_tokens_from_metadata_or_vocabulary(tiny_model):
    from hydra_console.engine.gguf_file import GGUFFile

    md = dict(GGUFFile(tiny_model("llama", fim=True)).metadata)
    tok = Tokenizer.from_metadata(md)
    found = fim_tokens(tok, md)
    assert [found[k] for k in ("pre", "suf", "mid")] == [tok.find_token(t) for t in FIM_TOKENS]
    assert found["rep"] is None and found["sep"] is None
    md["tokenizer.ggml.fim_pre_token_id"] = 5  # the metadata key wins over the text
    assert fim_tokens(Tokenizer.from_metadata(md), md)["pre"] == 5


# ---- flags -----------------------------------------------------------------------------------------------


@pytest.mark.unit
def test_llama_server_flag_names(tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0].content }}")
    args = build_parser().parse_args(
        [
            "serve",
            "-m",
            "x.gguf",
            "-c",
            "1024",
            "-np",
            "4",
            "-n",
            "32",
            "--temp",
            "0.5",
            "--seed",
            "9",
            "--top-k",
            "20",
            "--jinja",
            "--chat-template-file",
            str(template),
            "--api-key",
            "k",
            "--slot-save-path",
            str(tmp_path),
            "-b",
            "64",
        ]
    )
    cfg = head_config(args, {})
    assert (cfg.model.model, cfg.model.ctx, cfg.parallel, cfg.n_predict, cfg.batch_tokens) == ("x.gguf", 256, 4, 32, 64)
    assert cfg.sampling.given() == {"temperature": 0.5, "seed": 9, "top_k": 20}
    assert cfg.chat_template == "{{ messages[0].content }}" and cfg.api_key == "k" and cfg.slot_save_path == tmp_path
    assert head_config(build_parser().parse_args(["serve", "--seed", "-1"]), {}).sampling.seed is None
    assert cfg.chat_template_kwargs == {} and not cfg.verbose
    assert head_config(build_parser().parse_args(["serve", "--verbose"]), {}).verbose
    off = head_config(build_parser().parse_args(["serve", "--reasoning", "off"]), {})
    assert off.chat_template_kwargs == {"enable_thinking": False}
    for bad, flag in (
        (["--ctx", "64", "-c", "128"], "--ctx"),
        (["--temp", "-1"], "--temperature"),
        (["--chat-template", "x", "--chat-template-file", "y"], "--chat-template"),
        (["-b", "0"], "--batch-size"),
    ):
        with pytest.raises(Exception, match=flag):
            head_config(build_parser().parse_args(["serve", *bad]), {})


def test_ignore_eos_bans_the_end_of_generation_tokens(server, tiny_model):
    """As llama-server: ignore_eos is a -inf logit bias on every end-of-generation token (listed in
    generation_settings.logit_bias, -inf as null), so even a forced EOS is never sampled."""
    from hydra_console.engine.gguf_file import GGUFFile

    tok = Tokenizer.from_gguf(GGUFFile(tiny_model("llama")))
    forced = {"prompt": PROMPT, "n_predict": 4, "return_tokens": True, "logit_bias": [[tok.eos_id, 100]]}
    plain = post(server, "/completion", forced).json()
    assert plain["stop_type"] == "eos" and plain["tokens_predicted"] == 1
    assert plain["generation_settings"]["logit_bias"] == [{"bias": 100.0, "token": tok.eos_id}]
    banned = post(server, "/completion", {**forced, "ignore_eos": True}).json()
    assert banned["stop_type"] == "limit" and len(banned["tokens"]) == 4
    assert not set(banned["tokens"]) & tok.eog_ids
    bias = banned["generation_settings"]["logit_bias"]
    assert {b["token"] for b in bias} == tok.eog_ids and all(b["bias"] is None for b in bias)
    assert (
        post(server, "/completion", {"prompt": PROMPT, "n_predict": 1}).json()["generation_settings"]["logit_bias"]
        == []
    )


def test_generation_rates_are_over_decode_steps(server):
    """As llama-server: the first token comes with the prompt's last batch, so the generation rate
    counts n - 1 decode steps (and one token alone has no rate)."""
    one = post(server, "/completion", {"prompt": PROMPT, "n_predict": 1, "ignore_eos": True}).json()["timings"]
    assert one["predicted_n"] == 1 and one["predicted_per_second"] == 0.0 and one["predicted_per_token_ms"] == 0.0
    five = post(server, "/completion", {"prompt": PROMPT, "n_predict": 5, "ignore_eos": True}).json()["timings"]
    assert five["predicted_per_second"] == pytest.approx(4 / five["predicted_ms"] * 1e3)
    assert five["predicted_per_token_ms"] == pytest.approx(five["predicted_ms"] / 4)


def test_vertex_ai_predict_route(tiny_model, tmp_path):
    """AIP_MODE=PREDICTION (Vertex AI's custom containers): POST /predict runs each instance on the
    route its @requestFormat names, with the caller's key, never streamed; predictions in order."""
    from hydra_console.engine.http.predict import request_format

    assert [request_format(p) for p in ("/v1/chat/completions", "/apply-template", "/completion")] == [
        "chatCompletions",
        "applyTemplate",
        "completion",
    ]
    port, rpc = free_ports(2)
    argv = [
        "-m",
        str(tiny_model("llama")),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "-np",
        "2",
        "-c",
        str(2 * N_CTX),
        "--temp",
        "0",
        "--chat-template",
        "chatml",
        "--api-key",
        "k",
    ]
    env = ("env", "AIP_MODE=PREDICTION", "AIP_PREDICT_ROUTE=infer")
    with running(Worker("serve", argv, tmp_path, port, rpc, launcher=env)) as w:
        key = {"Authorization": "Bearer k"}
        chat = {"messages": CHAT, "max_tokens": 3, "ignore_eos": True}
        instances = [
            {"@requestFormat": "chatCompletions", **chat, "stream": True},
            {"@requestFormat": "/completion", "prompt": PROMPT, "n_predict": 2},
            {"@requestFormat": "nowhere"},
            {"@requestFormat": "chatCompletions", "messages": []},
        ]
        r = HTTP.post(f"{w.url}/infer", json={"instances": instances}, headers=key, timeout=60)
        assert r.status_code == 200, r.text
        first, second, unknown, bad = r.json()["predictions"]
        direct = HTTP.post(f"{w.url}/v1/chat/completions", json=chat, headers=key, timeout=60).json()
        assert first["choices"][0]["message"] == direct["choices"][0]["message"]
        assert second.get("tokens_predicted") == 2, second
        assert "nowhere" in unknown["error"]["message"] and bad["error"]["param"] == "messages"
        assert HTTP.post(f"{w.url}/infer", json={"instances": instances[:1]}, timeout=60).status_code == 401
        assert HTTP.post(f"{w.url}/infer", json={"instances": "x"}, headers=key, timeout=60).status_code == 400


# ---- return_progress and --batch-size ---------------------------------------------------------------


def test_return_progress_reports_each_prompt_batch(tiny_model, tmp_path):
    """-b 16: the prompt is computed 16 tokens a step; a streamed request with return_progress gets
    llama-server's prompt_progress after taking its slot (only the cache) and after each batch."""
    long_chat = [{"role": "user", "content": PROMPT * 3}]
    with running(llama_head(tiny_model("llama"), tmp_path, "-b", "16")) as w:
        n_prompt = post(w.url, "/chat/completions/input_tokens", {"messages": long_chat}).json()["input_tokens"]
        assert n_prompt > 48

        def progress(path: str, body: dict) -> list[dict]:
            events, _ = sse_events(w.url, path, {**body, "stream": True, "return_progress": True, "max_tokens": 2})
            return [e["prompt_progress"] for e in events if "prompt_progress" in e]

        reports = progress("/v1/chat/completions", {"messages": long_chat, "cache_prompt": False})
        assert [(r["total"], r["cache"]) for r in reports] == [(n_prompt, 0)] * len(reports)
        assert [r["processed"] for r in reports] == [*range(0, n_prompt, 16), n_prompt]
        # the same prompt again: all but its last token is cached, so one batch of one token
        again = progress("/v1/chat/completions", {"messages": long_chat})
        assert [(r["cache"], r["processed"]) for r in again] == [(n_prompt - 1, n_prompt - 1), (n_prompt - 1, n_prompt)]
        # the native and the OpenAI completion streams report it too; without the flag or the stream, nothing
        native = progress("/completion", {"prompt": PROMPT * 3, "cache_prompt": False})
        assert native[-1]["processed"] == native[-1]["total"] and len(native) > 2
        # with timings_per_token each report carries timings of the prompt so far: none before the first batch
        timed, _ = sse_events(
            w.url,
            "/completion",
            {
                "prompt": PROMPT * 3,
                "cache_prompt": False,
                "n_predict": 2,
                "stream": True,
                "return_progress": True,
                "timings_per_token": True,
            },
        )
        timed = [e["timings"] for e in timed if "prompt_progress" in e]
        assert (timed[0]["prompt_n"], timed[0]["prompt_ms"], timed[0]["predicted_n"]) == (0, 0.0, 0)
        assert [t["prompt_n"] for t in timed] == [r["processed"] for r in native]
        assert all(a["prompt_ms"] <= b["prompt_ms"] for a, b in zip(timed, timed[1:]))
        oai = progress("/v1/completions", {"prompt": PROMPT * 3, "cache_prompt": False})
        assert [r["processed"] for r in oai] == [r["processed"] for r in native]
        events, _ = sse_events(w.url, "/v1/chat/completions", {"messages": long_chat, "stream": True, "max_tokens": 2})
        assert not any("prompt_progress" in e for e in events)
        body = post(w.url, "/v1/chat/completions", {"messages": long_chat, "max_tokens": 2, "return_progress": True})
        assert "prompt_progress" not in body.json()
