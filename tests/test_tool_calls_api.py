"""Tool calls through `hydra-engine serve` (a real process on a tiny synthetic GGUF, its chat
template a Hermes-style one given with --chat-template-file) and the official openai client:
`tool_choice` required / named forces calls that come back as `message.tool_calls` (streamed as
`delta.tool_calls`) with `finish_reason: tool_calls`; `none` leaves text; bad tools are 400s; a
conversation carrying calls and their results renders."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from rpc_workers import head, running
from test_tool_calls import HERMES, SUCCESS, WEATHER

MESSAGES = [
    {"role": "system", "content": "You call tools."},
    {"role": "user", "content": "What is the weather in Oslo?"},
]
# a short call for a random model: one argument out of two values, no other keys
PICK = {
    "type": "function",
    "function": {
        "name": "pick",
        "parameters": {
            "type": "object",
            "properties": {"color": {"enum": ["red", "green"]}},
            "required": ["color"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("tool-calls")
    template = logs / "hermes.jinja"
    template.write_text(HERMES)
    with running(
        head(
            tiny_model("llama"),
            logs,
            (),
            "--dtype",
            "float32",
            "--chat-template-file",
            str(template),
            parallel=2,
            ctx=512,
        )
    ) as w:
        yield w.url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=120)


def test_required_and_named_tool_choice_come_back_as_tool_calls(client):
    r = client.chat.completions.create(
        model="m",
        messages=MESSAGES,
        tools=[SUCCESS, PICK],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=60,
        temperature=0,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content in ("", None)
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name in ("test", "pick") and len(call.id) == 32
    args = json.loads(call.function.arguments)
    assert args == {"success": True} if call.function.name == "test" else args["color"] in ("red", "green")

    named = {"type": "function", "function": {"name": "pick"}}
    r = client.chat.completions.create(
        model="m",
        messages=MESSAGES,
        tools=[SUCCESS, PICK],
        tool_choice=named,
        parallel_tool_calls=False,
        max_tokens=60,
        temperature=0.9,
        seed=3,
    )
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "pick"
    assert json.loads(call.function.arguments)["color"] in ("red", "green")


def test_streamed_tool_calls_arrive_as_deltas(client):
    stream = client.chat.completions.create(
        model="m",
        messages=MESSAGES,
        tools=[PICK],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=60,
        temperature=0,
        stream=True,
    )
    chunks = list(stream)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name == "pick" and calls[0].id
    assert json.loads(calls[0].function.arguments)["color"] in ("red", "green")
    assert "".join(d.content or "" for d in deltas) == ""  # the call's text is not content
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # the same call as the one the non-streamed request makes
    r = client.chat.completions.create(
        model="m",
        messages=MESSAGES,
        tools=[PICK],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=60,
        temperature=0,
    )
    assert r.choices[0].message.tool_calls[0].function.arguments == calls[0].function.arguments


def test_tool_choice_none_answers_in_text(client):
    r = client.chat.completions.create(
        model="m", messages=MESSAGES, tools=[WEATHER], tool_choice="none", max_tokens=8, temperature=0
    )
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("length", "stop")
    assert isinstance(r.choices[0].message.content, str)


def test_bad_tools_are_400s_naming_the_field(server):
    def post(**body) -> httpx.Response:
        return httpx.post(
            f"{server}/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4, **body}, timeout=60
        )

    for body, param in [
        ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
        ({"tools": [WEATHER], "grammar": 'root ::= "x"'}, "grammar"),
    ]:
        r = post(**body)
        assert r.status_code == 400, body
        assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"
    assert post(tools=[WEATHER], tool_choice="none", grammar='root ::= "x"').status_code == 200  # no calls: no clash


def test_a_conversation_with_calls_and_results_renders_them(server, client):
    turn = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
        ],
    }
    result = {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"}
    messages = [*MESSAGES, turn, result]
    prompt = httpx.post(f"{server}/apply-template", json={"messages": messages, "tools": [WEATHER]}).json()["prompt"]
    # the template reads arguments as an object: JSON text from the client is given to it parsed
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in prompt
    r = client.chat.completions.create(model="m", messages=messages, tools=[WEATHER], max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")


def test_anthropic_messages_answer_calls_as_tool_use_blocks(server):
    import anthropic

    client = anthropic.Anthropic(base_url=server, api_key="none", max_retries=0, timeout=120)
    tool = {"name": "pick", "description": "pick a color", "input_schema": PICK["function"]["parameters"]}
    kw = {
        "model": "m",
        "max_tokens": 60,
        "extra_body": {"temperature": 0},
        "tools": [tool],
        "tool_choice": {"type": "tool", "name": "pick", "disable_parallel_tool_use": True},
        "messages": [{"role": "user", "content": "Pick a color."}],
    }
    msg = client.messages.create(**kw)
    assert msg.stop_reason == "tool_use"
    (block,) = msg.content
    assert block.type == "tool_use" and block.name == "pick" and block.input["color"] in ("red", "green") and block.id
    # streamed: the same call, its input as one input_json_delta the client assembles
    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and [b.input for b in final.content] == [block.input]


def test_responses_answer_calls_as_function_call_items(client):
    tool = {"type": "function", **PICK["function"]}
    kw = {
        "model": "m",
        "input": "Pick a color.",
        "tools": [tool],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_output_tokens": 60,
        "temperature": 0,
    }
    res = client.responses.create(**kw)
    (item,) = res.output
    assert item.type == "function_call" and item.name == "pick" and item.call_id.startswith("call_")
    assert json.loads(item.arguments)["color"] in ("red", "green")
    events = list(client.responses.create(**kw, stream=True))
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [(i.type, i.arguments) for i in done] == [("function_call", item.arguments)]
    assert events[-1].type == "response.completed" and events[-1].response.output[0].name == "pick"
