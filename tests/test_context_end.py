"""Without context shift, a request whose max_tokens runs past its slot's context is served as
llama-server serves it: 200, generation stops where the context is full, finish_reason "length"
(`truncated`), on every generation route, streamed or not; only a prompt that leaves no room is
refused (400 exceed_context_size_error, in OpenAI's shape). A real head on a tiny model, the
official openai and anthropic clients."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest
from rpc_workers import head, running, wait_for

N_CTX = 64
PROMPT = "the quick brown fox jumps over the lazy dog"
FAR = 100_000  # max_tokens far past the context
LONG = "word " * 100  # a prompt past the context


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    model = tiny_model("llama", n_layers=1)
    flags = ("--dtype", "float32", "--temp", "0", "--chat-template", "chatml")
    with running(head(model, tmp_path_factory.mktemp("ctxend"), (), *flags, parallel=1, ctx=N_CTX)) as w:
        yield w


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)


def _predicted_total(server) -> float:
    for line in httpx.get(f"{server.url}/metrics", timeout=30).text.splitlines():
        if line.startswith("llamacpp:tokens_predicted_total "):
            return float(line.split()[1])
    raise AssertionError("no llamacpp:tokens_predicted_total")


def _idle(server) -> bool:
    return all(s["state"] == "idle" for s in server.status()["slots"])


def test_completions_end_at_the_context_streamed_or_not(server, client):
    """Every token the context held, counted apart from usage in the stream (one logprobs entry
    each); the same text both ways; /metrics counts them and the slot is idle after."""
    before = _predicted_total(server)
    kw = dict(model="m", prompt=PROMPT, max_tokens=FAR, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw)
    n_gen = N_CTX - whole.usage.prompt_tokens
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == n_gen > 0
    chunks = list(client.completions.create(**kw, logprobs=1, stream=True, stream_options={"include_usage": True}))
    choices = [c.choices[0] for c in chunks if c.choices]
    assert [c.finish_reason for c in choices][-1] == "length"
    assert all(c.finish_reason is None for c in choices[:-1])
    assert sum(len(c.logprobs.tokens) for c in choices if c.logprobs) == n_gen
    assert "".join(c.text for c in choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == n_gen
    assert _predicted_total(server) - before == 2 * n_gen
    wait_for(lambda: _idle(server), 60, "the slot to be idle")


def test_a_prompt_one_short_of_the_context_gets_one_token(client):
    """llama-server's bounds: a prompt of n_ctx - 1 tokens generates one; n_ctx tokens are refused."""
    one = client.completions.create(model="m", prompt=list(range(10, 10 + N_CTX - 1)), max_tokens=FAR)
    assert one.choices[0].finish_reason == "length" and one.usage.completion_tokens == 1
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="m", prompt=list(range(10, 10 + N_CTX)), max_tokens=1)
    assert e.value.body["type"] == "exceed_context_size_error" and e.value.body["n_prompt_tokens"] == N_CTX


def test_chat_ends_at_the_context_streamed_or_not(client):
    kw = dict(
        model="m",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=FAR,
        extra_body={"ignore_eos": True},
    )
    whole = client.chat.completions.create(**kw)
    n_gen = N_CTX - whole.usage.prompt_tokens
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == n_gen > 0
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    choices = [c.choices[0] for c in chunks if c.choices]
    assert choices[-1].finish_reason == "length" and all(c.finish_reason is None for c in choices[:-1])
    assert "".join(c.delta.content or "" for c in choices) == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == n_gen
    # max_completion_tokens, the newer name, alike
    newer = client.chat.completions.create(**{**kw, "max_tokens": None}, max_completion_tokens=FAR)
    assert newer.choices[0].finish_reason == "length" and newer.usage.completion_tokens == n_gen


def test_responses_end_at_the_context_streamed_or_not(client):
    """ "completed" (llama-server's Responses status when the length cut the output)."""
    kw = dict(model="m", input=PROMPT, max_output_tokens=FAR, extra_body={"ignore_eos": True})
    whole = client.responses.create(**kw)
    n_gen = N_CTX - whole.usage.input_tokens
    assert whole.status == "completed" and whole.usage.output_tokens == n_gen > 0
    done = list(client.responses.create(**kw, stream=True))[-1].response
    assert done.usage.output_tokens == n_gen and done.output_text == whole.output_text


def test_messages_end_at_the_context_streamed(server):
    claude = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=60)
    kw = dict(
        model="m", max_tokens=FAR, messages=[{"role": "user", "content": PROMPT}], extra_body={"ignore_eos": True}
    )
    with claude.messages.stream(**kw) as stream:
        msg = stream.get_final_message()
    n_prompt = msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0)  # Anthropic's split of the prompt
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == N_CTX - n_prompt > 0


def test_native_completion_ends_at_the_context_streamed_or_not(server):
    """/completion: truncated, stop_type "limit", and n_predict reported as asked (llama-server's)."""
    body = {"prompt": PROMPT, "n_predict": FAR, "ignore_eos": True}
    whole = httpx.post(f"{server.url}/completion", json=body, timeout=60).json()
    n_gen = N_CTX - whole["tokens_evaluated"]
    assert whole["tokens_predicted"] == n_gen > 0 and whole["truncated"] and whole["stop_type"] == "limit"
    assert whole["generation_settings"]["n_predict"] == FAR
    with httpx.stream("POST", f"{server.url}/completion", json={**body, "stream": True}, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert sum(len(c["tokens"]) for c in chunks) == n_gen
    assert chunks[-1]["stop"] and chunks[-1]["truncated"] and chunks[-1]["tokens_predicted"] == n_gen


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"prompt": LONG, "max_tokens": 4}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}], "max_tokens": 4}),
        ("/v1/responses", {"input": LONG, "max_output_tokens": 4}),
        ("/v1/messages", {"messages": [{"role": "user", "content": LONG}], "max_tokens": 4}),
        ("/completion", {"prompt": LONG, "n_predict": 4}),
    ],
)
def test_a_prompt_past_the_context_is_a_400_on_every_route(server, path, body):
    r = httpx.post(f"{server.url}{path}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "exceed_context_size_error" and err["param"] == "prompt"
    assert err["n_ctx"] == N_CTX and err["n_prompt_tokens"] > N_CTX
    assert "exceeds the available context size" in err["message"]
