"""OpenAI's Responses API (/v1/responses) as llama-server serves it, against `hydra-engine serve` as
a real process on a tiny synthetic GGUF: the official openai client and raw httpx."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from rpc_workers import Worker, free_ports, running

N_CTX = 256
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the quick brown fox"}]


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    port, rpc = free_ports(2)
    argv = [
        "-m",
        str(tiny_model("llama")),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "-np",
        "1",
        "-c",
        str(N_CTX),
        "--temp",
        "0",
        "--seed",
        "7",
        "--chat-template",
        "chatml",
        "-b",
        "16",
    ]
    with running(Worker("serve", argv, tmp_path_factory.mktemp("responses"), port, rpc)) as w:
        yield w.url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=60)


def chat_text(server: str, messages: list[dict], n: int) -> dict:
    return httpx.post(
        f"{server}/v1/chat/completions", json={"messages": messages, "max_tokens": n, "ignore_eos": True}, timeout=60
    ).json()


def test_response_is_the_chat_answer(server, client):
    """instructions + input items are the chat's system + messages: the same text, in a response object."""
    chat = chat_text(server, CHAT, 6)
    res = client.responses.create(
        model="m", instructions="be brief", input=[CHAT[1]], max_output_tokens=6, extra_body={"ignore_eos": True}
    )
    assert res.id.startswith("resp_") and res.status == "completed" and res.object == "response"
    assert [(o.type, o.role, o.id[:4]) for o in res.output] == [("message", "assistant", "msg_")]
    assert res.output_text == chat["choices"][0]["message"]["content"]
    assert res.usage.input_tokens == chat["usage"]["prompt_tokens"] and res.usage.output_tokens == 6
    assert res.usage.input_tokens_details.cached_tokens == chat["usage"]["prompt_tokens"] - 1  # the chat left it cached
    # a plain string input is one user message; content parts and earlier output_text turns are taken too
    plain = client.responses.create(
        model="m", input=CHAT[1]["content"], max_output_tokens=4, extra_body={"ignore_eos": True}
    )
    assert plain.output_text == chat_text(server, CHAT[1:], 4)["choices"][0]["message"]["content"]
    turns = [
        {"role": "user", "content": [{"type": "input_text", "text": "the quick brown fox"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "jumps"}]},
        {"role": "user", "content": "over"},
    ]
    as_chat = [
        {"role": "user", "content": "the quick brown fox"},
        {"role": "assistant", "content": "jumps"},
        {"role": "user", "content": "over"},
    ]
    got = client.responses.create(model="m", input=turns, max_output_tokens=4, extra_body={"ignore_eos": True})
    assert got.output_text == chat_text(server, as_chat, 4)["choices"][0]["message"]["content"]


def test_input_tokens_counts_the_prompt_without_generating(server):
    """llama-server's /v1/responses/input_tokens: the prompt tokens the same request would take."""
    body = {"instructions": "be brief", "input": [CHAT[1]]}
    r = httpx.post(f"{server}/v1/responses/input_tokens", json=body, timeout=60)
    assert r.status_code == 200, r.text
    chat = chat_text(server, CHAT, 1)
    assert r.json() == {"object": "response.input_tokens", "input_tokens": chat["usage"]["prompt_tokens"]}


def test_stream_events(server, client):
    events = list(
        client.responses.create(
            model="m", input=CHAT[1]["content"], max_output_tokens=5, stream=True, extra_body={"ignore_eos": True}
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert kinds.index("response.output_item.added") < kinds.index("response.output_text.delta")
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = events[-1].response
    assert text == done.output_text and done.usage.output_tokens == 5
    assert all(e.item_id == done.output[0].id for e in events if e.type == "response.output_text.delta")


def test_llama_server_progress_and_timings(server):
    """llama-server's extensions: return_progress sends response.in_progress with prompt_progress per
    prompt batch (-b 16), timings_per_token puts timings on each delta and the completed event."""
    body = {
        "input": "the quick brown fox " * 8,
        "max_output_tokens": 3,
        "stream": True,
        "return_progress": True,
        "timings_per_token": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", f"{server}/responses", json=body, timeout=60) as r:
        data = [json.loads(line[len("data: ") :]) for line in r.iter_lines() if line.startswith("data: ")]
    progress = [d for d in data if "prompt_progress" in d]
    assert all(d["type"] == "response.in_progress" for d in progress) and len(progress) > 2
    assert progress[-1]["prompt_progress"]["processed"] == progress[-1]["prompt_progress"]["total"]
    deltas = [d for d in data if d["type"] == "response.output_text.delta"]
    assert deltas and all("predicted_per_second" in d["timings"] for d in deltas)
    assert data[-1]["type"] == "response.completed" and data[-1]["timings"]["predicted_n"] == 3


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": [{"type": "web_search_call"}]}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]}, "input"),
        ({"max_output_tokens": 4}, "input"),
    ],
)
def test_bad_requests_are_400(server, body, param):
    r = httpx.post(f"{server}/v1/responses", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
