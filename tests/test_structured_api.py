"""Structured output, logit_bias and n > 1 through `hydra-engine serve` (a real process on a tiny
synthetic GGUF, n-gram speculation on by default) and the official openai client."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from rpc_workers import head, running
from test_structured import SCHEMA, YES_NO  # the same schema and grammar, engine-level and over HTTP

N_CTX, N_SLOTS = 384, 4
PROMPT = 'the quick brown fox {"flag": true, "count": 12, "word": "cat"} {"flag": false, "count": 3, "word": "dog"}'
MESSAGES = [{"role": "user", "content": PROMPT}]


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    extra = ("--dtype", "float32", "--spec-type", "ngram", "--draft-max", "4")
    with running(
        head(tiny_model("llama"), tmp_path_factory.mktemp("structured"), (), *extra, parallel=N_SLOTS, ctx=N_CTX)
    ) as w:
        yield w.url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=120)


def _chat(client, **kw):
    kw = {"max_tokens": 80, "temperature": 0, **kw}
    return client.chat.completions.create(model="m", messages=MESSAGES, **kw)


def _check_schema(value):
    assert set(value) == {"flag", "count", "word"} and isinstance(value["flag"], bool)
    assert type(value["count"]) is int and 0 <= value["count"] <= 99
    assert isinstance(value["word"], str) and len(value["word"]) <= 6


def _piece_ids(server, text: str) -> dict[str, int]:
    pieces = httpx.post(f"{server}/tokenize", json={"content": text, "with_pieces": True}).json()["tokens"]
    return {p["piece"]: p["id"] for p in pieces}


def test_json_object_and_schema_in_chat_and_completions(server, client):
    # any object: a random model would write one endless key, so a bias on '"' and '}' keeps it short
    ids = _piece_ids(server, '"}')
    r = _chat(client, response_format={"type": "json_object"}, logit_bias={str(ids['"']): 30, str(ids["}"]): 30})
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)

    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
    r = _chat(client, response_format=fmt)
    assert r.choices[0].finish_reason == "stop"
    _check_schema(json.loads(r.choices[0].message.content))
    # streamed: the same text, chunk by chunk
    chunks = list(_chat(client, response_format=fmt, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "stop"

    # completions: llama-server's top-level json_schema and its {"type": "json_object", "schema"} form
    for extra in ({"json_schema": SCHEMA}, {"response_format": {"type": "json_object", "schema": SCHEMA}}):
        c = client.completions.create(model="m", prompt=PROMPT, temperature=0, max_tokens=80, extra_body=extra)
        assert c.choices[0].finish_reason == "stop"
        _check_schema(json.loads(c.choices[0].text))


def test_native_completion_follows_the_structured_fields(server):
    """llama-server's /completion takes the same fields: json_schema, response_format, grammar;
    streamed too, and each prompt of a list follows the grammar on its own."""

    def complete(**body) -> httpx.Response:
        return httpx.post(
            f"{server}/completion", json={"prompt": PROMPT, "n_predict": 80, "temperature": 0, **body}, timeout=120
        )

    for extra in (
        {"json_schema": SCHEMA},
        {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
    ):
        r = complete(**extra).json()
        assert r["stop_type"] == "eos" and r["stop"] is True
        _check_schema(json.loads(r["content"]))
    with httpx.stream(
        "POST",
        f"{server}/completion",
        timeout=120,
        json={"prompt": PROMPT, "n_predict": 80, "temperature": 0, "json_schema": SCHEMA, "stream": True},
    ) as r:
        events = [json.loads(line[len("data: ") :]) for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1]["stop"] is True
    _check_schema(json.loads("".join(e["content"] for e in events)))
    many = complete(prompt=[PROMPT, "the lazy dog"], grammar=YES_NO, temperature=0.9, seed=3, n_predict=10).json()
    assert [x["content"] in ("yes", "no") for x in many] == [True, True]


def test_gbnf_grammar_gives_one_of_its_words(client):
    for stream in (False, True):
        r = _chat(client, extra_body={"grammar": YES_NO}, stream=stream)
        if stream:
            chunks = list(r)
            text, finish = (
                "".join(c.choices[0].delta.content or "" for c in chunks),
                chunks[-1].choices[0].finish_reason,
            )
        else:
            text, finish = r.choices[0].message.content, r.choices[0].finish_reason
        assert text in ("yes", "no") and finish == "stop"
    c = client.completions.create(
        model="m", prompt=PROMPT, temperature=0.9, seed=3, max_tokens=10, extra_body={"grammar": YES_NO}
    )
    assert c.choices[0].text in ("yes", "no")


@pytest.mark.parametrize(
    "body, field",
    [
        ({"grammar": 'root ::= ("yes" | '}, "grammar"),
        ({"grammar": "root ::= nowhere"}, "grammar"),
        ({"json_schema": {"type": "nope"}}, "json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"$ref": "#/none"}}}},
            "response_format",
        ),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"json_schema": SCHEMA, "grammar": YES_NO}, "grammar"),
        ({"logit_bias": {"5": "much"}}, "logit_bias"),
        ({"logit_bias": {"999999": 1}}, "logit_bias"),
        ({"n": 0}, "n"),
    ],
)
def test_bad_structured_fields_are_400_naming_the_field(server, client, body, field):
    for path, base in (
        ("/v1/chat/completions", {"messages": MESSAGES}),
        ("/v1/completions", {"prompt": PROMPT}),
        ("/completion", {"prompt": PROMPT}),
    ):
        r = httpx.post(f"{server}{path}", json={**base, "max_tokens": 4, **body}, timeout=60)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == field and r.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError):
        _chat(client, extra_body=body)


def test_constrained_greedy_is_the_same_with_speculation(client):
    """The server drafts with n-grams by default; the prompt's JSON gives the drafter material."""
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
    spec = _chat(client, response_format=fmt)
    plain = _chat(client, response_format=fmt, extra_body={"speculative": {"type": "off"}})
    assert spec.choices[0].message.content == plain.choices[0].message.content
    assert spec.model_extra["timings"]["draft_n"] > 0 and plain.model_extra["timings"]["draft_n"] == 0
    c_spec = client.completions.create(
        model="m", prompt=PROMPT, temperature=0, max_tokens=80, extra_body={"json_schema": SCHEMA}
    )
    c_plain = client.completions.create(
        model="m",
        prompt=PROMPT,
        temperature=0,
        max_tokens=80,
        extra_body={"json_schema": SCHEMA, "speculative": {"type": "off"}},
    )
    assert c_spec.choices[0].text == c_plain.choices[0].text and c_spec.model_extra["timings"]["draft_n"] > 0


def test_logit_bias_bans_and_forces(server, client):
    def first(**kw) -> int:
        r = client.completions.create(
            model="m",
            prompt=PROMPT,
            temperature=0,
            max_tokens=1,
            logprobs=0,
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True, **kw},
        )
        return int(r.choices[0].logprobs.tokens[0].removeprefix("token_id:"))

    top = first()
    banned = first(logit_bias={str(top): -100})
    assert banned != top
    assert first(logit_bias=[[top, False]]) == banned  # llama-server's pairs: `false` bans
    tokenize = lambda text: httpx.post(f"{server}/tokenize", json={"content": text}).json()["tokens"]  # noqa: E731
    fox = tokenize("fox")
    assert len(fox) == 1
    forced = _chat(client, max_tokens=6, logit_bias={str(fox[0]): 100}, extra_body={"ignore_eos": True})
    assert forced.choices[0].message.content == "fox" * 6 or forced.choices[0].message.content.split() == ["fox"] * 6
    forced_text = _chat(client, max_tokens=6, extra_body={"ignore_eos": True, "logit_bias": [["fox", 100]]})
    assert forced_text.choices[0].message.content == forced.choices[0].message.content


def test_n_choices(client):
    greedy = client.completions.create(
        model="m", prompt=PROMPT, temperature=0, max_tokens=8, n=3, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    assert len({c.text for c in greedy.choices}) == 1
    one = client.completions.create(
        model="m", prompt=PROMPT, temperature=0, max_tokens=8, extra_body={"ignore_eos": True}
    )
    assert greedy.usage.prompt_tokens == one.usage.prompt_tokens and greedy.usage.completion_tokens == 3 * 8

    sampled = _chat(client, temperature=1.0, seed=11, n=3, max_tokens=12, extra_body={"ignore_eos": True})
    texts = [c.message.content for c in sampled.choices]
    assert len(set(texts)) > 1  # each choice its own seed
    again = _chat(client, temperature=1.0, seed=11, n=3, max_tokens=12, extra_body={"ignore_eos": True})
    assert [c.message.content for c in again.choices] == texts  # ... and each reproducible
    assert sampled.usage.completion_tokens == 36

    chunks = list(
        _chat(
            client,
            temperature=1.0,
            seed=11,
            n=3,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    streamed = ["", "", ""]
    for ch in chunks:
        for c in ch.choices:
            streamed[c.index] += c.delta.content or ""
    assert streamed == texts
    assert sum(1 for ch in chunks for c in ch.choices if c.finish_reason) == 3
    assert chunks[-1].usage.completion_tokens == 36

    # every choice follows the grammar
    r = _chat(client, temperature=1.0, n=3, extra_body={"grammar": YES_NO})
    assert len(r.choices) == 3 and all(c.message.content in ("yes", "no") for c in r.choices)
