"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) as llama-server serves it,
against `hydra-engine serve` as a real process on a tiny synthetic GGUF: the official `anthropic`
client and raw httpx."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest
from rpc_workers import Worker, free_ports, running

N_CTX, SEED = 512, 7
USER = [{"role": "user", "content": "the quick brown fox"}]


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
        str(SEED),
        "--chat-template",
        "chatml",
    ]
    with running(Worker("serve", argv, tmp_path_factory.mktemp("anthropic"), port, rpc)) as w:
        yield w.url


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server, api_key="none", max_retries=0, timeout=60)


def post(server: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server}{path}", json=body, timeout=60)


def chat_prompt(server: str, messages: list[dict], **extra) -> str:
    return post(server, "/apply-template", {"messages": messages, **extra}).json()["prompt"]


def test_message_shape_and_usage(server, client):
    msg = client.messages.create(model="m", max_tokens=5, messages=USER, extra_body={"ignore_eos": True})
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert msg.stop_reason == "max_tokens" and msg.stop_sequence is None
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text
    assert msg.usage.output_tokens == 5
    # the same text as the OpenAI chat route gives for the same conversation
    same = post(server, "/v1/chat/completions", {"messages": USER, "max_tokens": 5, "ignore_eos": True}).json()
    assert same["choices"][0]["message"]["content"] == msg.content[0].text
    n_prompt = same["usage"]["prompt_tokens"]
    # the same prompt again: all but its last token comes from the prompt cache
    again = client.messages.create(model="m", max_tokens=5, messages=USER)
    assert again.usage.cache_read_input_tokens == n_prompt - 1 and again.usage.input_tokens == 1
    raw = post(server, "/v1/messages", {"max_tokens": 2, "messages": USER}).json()
    assert "timings" not in raw and set(raw["usage"]) == {"cache_read_input_tokens", "input_tokens", "output_tokens"}


def test_max_tokens_past_the_context_stop_at_its_end(server, client):
    """Anthropic clients send large max_tokens (and llama-server defaults it to 4096): generation
    stops where the slot's context ends, as llama-server's, instead of a 400."""
    n_prompt = client.messages.count_tokens(model="m", messages=USER).input_tokens
    msg = client.messages.create(model="m", max_tokens=100_000, messages=USER, extra_body={"ignore_eos": True})
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == N_CTX - n_prompt


def test_stop_sequences_end_the_turn(server, client):
    free = client.messages.create(model="m", max_tokens=8, messages=USER, extra_body={"ignore_eos": True})
    text = free.content[0].text
    word = text[len(text) // 2 :].strip()[:3]
    assert word
    cut = client.messages.create(
        model="m", max_tokens=8, messages=USER, stop_sequences=[word], extra_body={"ignore_eos": True}
    )
    assert cut.stop_reason == "end_turn" and cut.stop_sequence == word
    assert text.startswith(cut.content[0].text) and word not in cut.content[0].text


def test_streamed_events(server, client):
    events = list(
        client.messages.create(model="m", max_tokens=6, messages=USER, stream=True, extra_body={"ignore_eos": True})
    )
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1
    start = events[0].message
    assert start.content == [] and start.usage.input_tokens + start.usage.cache_read_input_tokens > 0
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    unstreamed = client.messages.create(model="m", max_tokens=6, messages=USER, extra_body={"ignore_eos": True})
    assert text == unstreamed.content[0].text
    end = next(e for e in events if e.type == "message_delta")
    assert end.delta.stop_reason == "max_tokens" and end.usage.output_tokens == 6
    # on the wire: an `event:` line naming each data's type, and no timings
    with httpx.stream("POST", f"{server}/v1/messages", json={"max_tokens": 2, "messages": USER, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    data = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    assert names == [d["type"] for d in data] and not any("timings" in d for d in data)


def test_conversion_to_the_chat_prompt(server, client):
    """system (text or blocks), text blocks, tool_use and tool_result blocks and tools become the
    chat the template renders, as llama-server converts them."""
    tool = {"name": "weather", "description": "the weather", "input_schema": {"type": "object", "properties": {}}}
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": "the weather?"}]},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "t1", "name": "weather", "input": {"city": "Paris"}},
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "sunny"}]}],
        },
    ]
    chat = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "What is\nthe weather?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {"id": "t1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "t1", "content": "sunny"},
    ]
    tools = [
        {
            "type": "function",
            "function": {"name": "weather", "description": "the weather", "parameters": tool["input_schema"]},
        }
    ]
    n_tokens = post(server, "/tokenize", {"content": chat_prompt(server, chat, tools=tools), "add_special": True})
    for system in ("be brief", [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]):
        counted = client.messages.count_tokens(model="m", system=system, messages=messages, tools=[tool])
        assert counted.input_tokens == len(n_tokens.json()["tokens"])
    assert client.messages.create(model="m", max_tokens=2, system="be brief", messages=messages, tools=[tool]).content


@pytest.mark.parametrize(
    "body, status, words",
    [
        ({"max_tokens": 4}, 400, "messages"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
                        ],
                    }
                ]
            },
            400,
            "image input is not supported",
        ),
        ({"messages": USER, "max_tokens": -1}, 400, "max_tokens"),
        ({"messages": USER, "max_tokens": 4, "stop_sequences": [""]}, 400, "stop"),
    ],
)
def test_bad_requests_are_400(server, body, status, words):
    r = post(server, "/v1/messages", body)
    assert r.status_code == status and words in r.json()["error"]["message"], r.text
