"""Tool calls below the API: a template's call format learned by rendering it (llama.cpp's
differential approach), generated text parsed back into content and calls, streamed text held back
where a call may start, `tools` / `tool_choice` checked, and the grammar of `tool_choice: required`
run by llguidance over a real tokenizer."""

from __future__ import annotations

import json

import pytest

from hydra_console.engine.gguf_file import GGUFFile
from hydra_console.engine.text.chat import ChatTemplate
from hydra_console.engine.text.stream_decoder import StreamDecoder
from hydra_console.engine.text.structured import Grammars, compile_grammar
from hydra_console.engine.text.tokenizer import Tokenizer
from hydra_console.engine.text.tool_calls import ToolFormat, arguments_as_objects
from hydra_console.engine.text.tool_choice import ToolError, tool_choice_of

_TURNS = """{%- for m in messages -%}
{{- '<|im_start|>' + m.role + '\\n' -}}
{%- if m.tool_calls -%}{%- for c in m.tool_calls -%}CALL{%- endfor -%}{%- else -%}{{- m.content -}}{%- endif -%}
{{- '<|im_end|>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"""


def _template(call: str, join: str = "") -> str:
    """A ChatML template whose assistant turns write each call as `call` (jinja, `c` the call), and
    `join` (jinja) between calls."""
    body = _TURNS.replace("CALL", call)
    if join:
        body = body.replace(
            "{%- endfor -%}{%- else", f"{{%- if not loop.last -%}}{join}{{%- endif -%}}{{%- endfor -%}}{{%- else", 1
        )
    return body


HERMES = _template(
    "{{- '<tool_call>\\n' + {'name': c.function.name, 'arguments': c.function.arguments} | tojson + '\\n</tool_call>' -}}",
    "{{- '\\n' -}}",
)
LLAMA3 = _template(
    "{{- '{\"name\": \"' + c.function.name + '\", \"parameters\": ' + c.function.arguments | tojson + '}' -}}"
)
MISTRAL = _TURNS.replace(
    "{%- for c in m.tool_calls -%}CALL{%- endfor -%}",
    "{{- '[TOOL_CALLS][' -}}{%- for c in m.tool_calls -%}{{- {'name': c.function.name, "
    "'arguments': c.function.arguments, 'id': c.id} | tojson -}}{%- if not loop.last -%}, "
    "{%- endif -%}{%- endfor -%}{{- ']' -}}",
)
FUNCTIONARY = _template("{{- '<function=' + c.function.name + '>' + c.function.arguments | tojson + '</function>' -}}")
PLAIN = _TURNS.replace(
    "{%- if m.tool_calls -%}{%- for c in m.tool_calls -%}CALL{%- endfor -%}{%- else -%}", "{%- if false -%}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
        },
    },
}
SUCCESS = {
    "type": "function",
    "function": {
        "name": "test",
        "parameters": {
            "type": "object",
            "properties": {"success": {"type": "boolean", "const": True}},
            "required": ["success"],
            "additionalProperties": False,
        },
    },
}


def learn(source: str) -> ToolFormat | None:
    return ToolFormat.learn(ChatTemplate(source, "<s>", "</s>", True, "test"))


def calls_of(fmt: ToolFormat, text: str) -> tuple[str, list[tuple[str, dict]]]:
    content, calls = fmt.parse(text)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.unit
def test_learns_each_shape_of_call_from_the_template():
    hermes = learn(HERMES)
    assert (hermes.start, hermes.end, hermes.sep) == (
        "<tool_call>\n",
        "\n</tool_call>",
        "\n</tool_call>\n<tool_call>\n",
    )
    assert hermes.shape is not None and hermes.object_arguments
    llama = learn(LLAMA3)
    assert (llama.start, llama.end) == ("", "") and set(llama.shape) == {"name", "parameters"}
    mistral = learn(MISTRAL)
    assert (mistral.start, mistral.end, mistral.sep) == ("[TOOL_CALLS][", "]", ",") and "id" in mistral.shape
    functionary = learn(FUNCTIONARY)
    assert (functionary.start, functionary.before_args, functionary.shape) == ("<function=", ">", None)
    assert (functionary.end, functionary.sep) == ("</function>", "</function><function=")
    assert learn(PLAIN) is None  # a template that never writes calls: answers stay text


@pytest.mark.unit
def test_parses_calls_back_and_leaves_everything_else_as_content():
    hermes, llama, mistral, functionary = learn(HERMES), learn(LLAMA3), learn(MISTRAL), learn(FUNCTIONARY)
    one = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert calls_of(hermes, one) == ("", [("get_weather", {"city": "Oslo"})])
    two = one + '\n<tool_call>\n{"name": "test", "arguments": {"success": true}}\n</tool_call>'
    assert calls_of(hermes, "Let me check.\n" + two)[1] == [
        ("get_weather", {"city": "Oslo"}),
        ("test", {"success": True}),
    ]
    assert calls_of(hermes, "Let me check.\n" + two)[0] == "Let me check.\n"
    # arguments written as JSON text are read the same
    assert calls_of(hermes, '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>')[1] == [("f", {"a": 1})]
    assert calls_of(llama, ' {"name": "get_weather", "parameters": {"city": "Rome"}}') == (
        "",
        [("get_weather", {"city": "Rome"})],
    )
    assert calls_of(
        mistral, '[TOOL_CALLS][{"name": "a", "arguments": {}, "id": "abcDEF123"}, {"name": "b", "arguments": {"x": 2}}]'
    )[1] == [("a", {}), ("b", {"x": 2})]
    assert mistral.parse('[TOOL_CALLS][{"name": "a", "arguments": {}, "id": "abcDEF123"}]')[1][0].id == "abcDEF123"
    assert calls_of(functionary, '<function=get_weather>{"city": "Lima"}</function>') == (
        "",
        [("get_weather", {"city": "Lima"})],
    )
    assert calls_of(functionary, '<function=a>{}</function><function=b>{"x": [1]}</function>')[1] == [
        ("a", {}),
        ("b", {"x": [1]}),
    ]
    generated = hermes.parse(one)[1][0].id
    assert len(generated) == 32 and generated.isalnum()  # llama-server's ids for calls written without one

    for fmt, text in [
        (hermes, "No tools needed: the answer is 4."),
        (hermes, '<tool_call>\n{"name": "get_weather", "argu'),
        (hermes, '<tool_call>\n{"arguments": {}}\n</tool_call>'),
        (llama, 'The JSON is {"a": 1}.'),
        (llama, '{"name": "f", "parameters": {}} and then some prose'),
        (functionary, "<function=>{}</function>"),
    ]:
        assert fmt.parse(text) == (text, []), text


@pytest.mark.unit
def test_streamed_text_is_held_only_where_a_call_may_start():
    s = learn(HERMES).stream()
    assert s.push("Sure, ") == "Sure, " and s.push("checking <tool") == "checking " and s.push("_call>\n{") == ""
    s.push('"name": "test", "arguments": {"success": true}}\n</tool_call>')
    rest, calls = s.finish()
    assert rest == "" and [(c.name, c.arguments) for c in calls] == [("test", '{"success": true}')]
    s = learn(HERMES).stream()
    assert (
        s.push("a <tool") == "a " and s.push("box> b") == "<toolbox> b" and s.finish() == ("", [])
    )  # not a marker after all

    s = learn(LLAMA3).stream()  # bare JSON calls: held while the message could still be one
    assert s.push("  ") == "" and s.push('{"name"') == "" and s.push(': "f", "parameters": {}}') == ""
    assert [c.name for c in s.finish()[1]] == ["f"]
    s = learn(LLAMA3).stream()
    assert (
        s.push(" Hello") == " Hello"
        and s.push(' {"name": "f", "parameters": {}}') == ' {"name": "f", "parameters": {}}'
    )
    assert s.finish() == ("", [])


@pytest.mark.unit
def test_tool_choice_is_checked_with_the_field_named():
    choice = tool_choice_of([WEATHER], None, None)
    assert (choice.mode, choice.parses, choice.forces, choice.parallel) == ("auto", True, False, True)
    assert tool_choice_of([WEATHER], "none", False).parses is False
    named = tool_choice_of([WEATHER, SUCCESS], {"type": "function", "function": {"name": "test"}}, False)
    assert (named.mode, named.name, named.forces, named.parallel) == ("required", "test", True, False)
    assert tool_choice_of(None, "required", None).forces is False  # no tools: nothing to force
    bad = [
        ([WEATHER], "always", "tool_choice"),
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
        ([WEATHER], 3, "tool_choice"),
        ([{"type": "retrieval"}], None, "tools"),
        ([{"function": {"name": ""}}], None, "tools"),
        ([{"function": {"name": "f", "parameters": []}}], None, "tools"),
    ]
    for tools, tc, param in bad:
        with pytest.raises(ToolError) as e:
            tool_choice_of(tools, tc, None)
        assert e.value.param == param


@pytest.mark.unit
def test_json_text_arguments_become_objects_for_the_template():
    messages = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
                {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "not json"}},
            ],
        },
    ]
    out = arguments_as_objects(messages)
    assert [c["function"]["arguments"] for c in out[1]["tool_calls"]] == [{"a": 1}, "not json"]
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'  # the request's own copy is untouched


@pytest.fixture(scope="module")
def gemma(default_model):
    return Tokenizer.from_gguf(GGUFFile(default_model))


@pytest.mark.unit
def test_required_grammar_admits_exactly_calls_to_the_tools(gemma):
    grammars = Grammars(gemma)
    hermes, mistral, functionary = learn(HERMES), learn(MISTRAL), learn(FUNCTIONARY)

    def accepts(fmt, choice, text) -> bool:
        c = grammars.constraint(compile_grammar("lark", fmt.grammar(choice, gemma), "tools"), "tools")
        ids = gemma.encode(text, add_special=False, parse_special=False)
        if c.valid_prefix(ids) != len(ids):
            return False
        for t in ids:
            c.advance(t)
        return c.matcher.is_accepting()

    required = tool_choice_of([WEATHER, SUCCESS], "required", True)
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    other = '<tool_call>\n{"name": "test", "arguments": {"success": true}}\n</tool_call>'
    assert accepts(hermes, required, call) and accepts(hermes, required, other)
    assert accepts(hermes, required, call + "\n" + other)  # parallel calls
    assert not accepts(hermes, tool_choice_of([WEATHER, SUCCESS], "required", False), call + "\n" + other)
    assert not accepts(hermes, required, "Sure! " + call)  # required: a call straight away
    assert not accepts(hermes, required, call.replace("get_weather", "get_time"))
    assert not accepts(
        hermes, required, '<tool_call>\n{"arguments": {"city": "Oslo"}, "name": "get_weather"}\n</tool_call>'
    )
    assert not accepts(hermes, required, other.replace("true", "false"))  # the tool's own schema
    # as llama.cpp reads a tool's schema: listed properties and no others unless it says so
    padded = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "units": "C"}}\n</tool_call>'
    assert not accepts(hermes, required, padded)
    open_weather = {
        "type": "function",
        "function": {
            **WEATHER["function"],
            "parameters": {**WEATHER["function"]["parameters"], "additionalProperties": True},
        },
    }
    assert accepts(hermes, tool_choice_of([open_weather], "required", False), padded)
    named = tool_choice_of([WEATHER, SUCCESS], {"type": "function", "function": {"name": "test"}}, True)
    assert accepts(hermes, named, other) and not accepts(hermes, named, call)
    assert accepts(
        mistral, required, '[TOOL_CALLS][{"name": "test", "arguments": {"success": true}, "id": "abcDEF123"}]'
    )
    assert accepts(functionary, required, '<function=test>{"success": true}</function>')
    # what the grammar admits, the parser reads back
    assert [c.name for c in hermes.parse(call + "\n" + other)[1]] == ["get_weather", "test"]


@pytest.mark.unit
def test_grammars_can_write_gemmas_user_defined_whitespace_tokens(gemma):
    """Gemma's newline and space-run tokens are user-defined: text like any other to a grammar."""
    ids = gemma.encode("a\n\nb", add_special=False, parse_special=False)
    c = Grammars(gemma).constraint(compile_grammar("lark", 'start: "a\\n\\nb"', "grammar"), "grammar")
    assert c.valid_prefix(ids) == len(ids)


def _run(grammars: Grammars, grammar: str, ids: list[int]) -> tuple[int, bool]:
    """(how many of `ids` the grammar takes, whether it may end there)."""
    c = grammars.constraint(compile_grammar("lark", grammar, "tools"), "tools")
    n = c.valid_prefix(ids)
    for t in ids[:n]:
        c.advance(t)
    return n, c.matcher.is_accepting()


@pytest.mark.unit
def test_auto_grammar_leaves_text_free_until_a_call_starts(gemma):
    grammars, hermes = Grammars(gemma), learn(HERMES)
    lazy = hermes.grammar(tool_choice_of([WEATHER, SUCCESS], "auto", False), gemma, lazy=True)

    def enc(text: str) -> list[int]:
        return gemma.encode(text, add_special=False, parse_special=False)

    for text in ["It is sunny in Oslo.", "Use <tool> tags like <tool_call", ""]:
        assert _run(grammars, lazy, enc(text)) == (len(enc(text)), True), text  # any text, and it may end
    call = 'Checking.\n<tool_call>\n{"name": "test", "arguments": {"success": true}}\n</tool_call>'
    assert _run(grammars, lazy, enc(call)) == (len(enc(call)), True)
    started = enc('Checking. <tool_call>\n{"name": "test", "arguments": {')
    assert _run(grammars, lazy, started) == (len(started), False)  # a call begun must be finished
    wrong = enc('Checking. <tool_call>\n{"name": "get_time"')
    assert _run(grammars, lazy, wrong)[0] < len(wrong)  # and be one of the tools


@pytest.mark.unit
def test_control_token_markers_are_written_as_tokens_and_kept_in_the_text(gemma):
    """A template whose calls start with a control token of the vocabulary (Gemma's <unused0> here,
    as Mistral's [TOOL_CALLS]): the grammar asks for the token itself, and the generated text keeps
    it so that the call can be parsed."""
    fmt = ToolFormat.learn(
        ChatTemplate(
            _template("{{- '<unused0>' + {'name': c.function.name, 'arguments': c.function.arguments} | tojson -}}"),
            "<bos>",
            "<eos>",
            True,
            "t",
        )
    )
    marker = gemma.find_token("<unused0>")
    assert fmt.start == "<unused0>" and gemma.is_special(marker) and fmt.preserved(gemma) == {marker}
    ids = [marker, *gemma.encode('{"name": "test", "arguments": {"success": true}}', add_special=False)]
    grammars = Grammars(gemma)
    required = fmt.grammar(tool_choice_of([SUCCESS], "required", False), gemma)
    assert _run(grammars, required, ids) == (len(ids), True)
    spelled = gemma.encode('<unused0>{"name"', add_special=False, parse_special=False)  # the marker as plain text
    assert _run(grammars, required, spelled)[0] < len(spelled)
    lazy = fmt.grammar(tool_choice_of([SUCCESS], "auto", False), gemma, lazy=True)
    hi = gemma.encode("Hi ", add_special=False)
    assert _run(grammars, lazy, hi + ids) == (len(hi + ids), True)

    kept = StreamDecoder(gemma, keep=fmt.preserved(gemma))
    text = "".join(kept.push(t) for t in ids)
    assert [c.name for c in fmt.parse(text)[1]] == ["test"]
    assert "".join(StreamDecoder(gemma).push(t) for t in ids).startswith("{")  # other control tokens stay out


# functionary v3.2's recipients: the generation prompt ends with ">>>", text is written to "all"
RECIPIENTS = """{%- for m in messages -%}
{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' -}}
{%- if m.role == 'assistant' -%}
{%- if m.content -%}{{- '>>>all\\n' + m.content -}}{%- endif -%}
{%- for c in m.tool_calls or [] -%}{{- '>>>' + c.function.name + '\\n' + c.function.arguments -}}{%- endfor -%}
{%- else -%}{{- m.content -}}{%- endif -%}
{{- '<|eot_id|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n>>>' -}}{%- endif -%}"""


@pytest.mark.unit
def test_recipient_format_tells_text_from_calls_by_the_text_prefix(gemma):
    fmt = learn(RECIPIENTS)
    assert (fmt.start, fmt.text_prefix, fmt.sep, fmt.before_args, fmt.object_arguments) == (
        "",
        "all\n",
        ">>>",
        "\n",
        False,
    )
    assert calls_of(fmt, "all\nHello there") == ("Hello there", [])  # the recipient is not content
    assert calls_of(fmt, 'all\nLet me check.>>>test\n{"success": true}') == (
        "Let me check.",
        [("test", {"success": True})],
    )
    assert calls_of(fmt, 'test\n{"success": true}>>>get_weather\n{"city": "Oslo"}')[1] == [
        ("test", {"success": True}),
        ("get_weather", {"city": "Oslo"}),
    ]
    assert fmt.parse("Hello") == ("Hello", [])

    s = fmt.stream()
    assert (
        s.push("al") == ""
        and s.push("l\nHel") == "Hel"
        and s.push("lo>>") == "lo"
        and s.push('>test\n{"success": true}') == ""
    )
    rest, calls = s.finish()
    assert rest == "" and [c.name for c in calls] == ["test"]

    grammars = Grammars(gemma)
    ids = gemma.encode('test\n{"success": true}', add_special=False)
    assert _run(grammars, fmt.grammar(tool_choice_of([SUCCESS], "required", False), gemma), ids) == (len(ids), True)
