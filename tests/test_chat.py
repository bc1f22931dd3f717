"""Chat templates: the GGUF's jinja template, the built-in fallbacks by architecture, bad messages."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest

from hydra_console.engine.default_model import default_model_path
from hydra_console.engine.errors import UserError
from hydra_console.engine.gguf_file import GGUFFile
from hydra_console.engine.synth import write_synthetic
from hydra_console.engine.text.bpe import BYTE_TO_UNICODE
from hydra_console.engine.text.chat import ChatError, ChatTemplate, apply_chat_template, normalize_messages
from hydra_console.engine.text.tokenizer import CONTROL, NORMAL, Tokenizer

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": " Hi there "},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": [{"type": "text", "text": "Why"}, {"type": "text", "text": "not?"}]},
]

# The classic ChatML template as shipped in many GGUFs.
CHATML_JINJA = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Gemma 3's own template (google/gemma-3-*-it), as its GGUFs carry it.
GEMMA3_JINJA = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""

GEMMA_CHAT = (
    "<start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n"
    "<start_of_turn>model\nHello.<end_of_turn>\n"
    "<start_of_turn>user\nWhy\nnot?<end_of_turn>\n"
    "<start_of_turn>model\n"
)

SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]


def write_model(
    path: Path, arch: str, template: str | None = None, add_bos: bool = False, specials=SPECIALS
) -> GGUFFile:
    """A vocabulary-only GGUF: byte-level BPE tokens plus the chat special tokens."""
    specials = [
        "<|endoftext|>",
        "<|begin_of_text|>",
        *(s for s in specials if s not in ("<|endoftext|>", "<|begin_of_text|>")),
    ]
    tokens = list(BYTE_TO_UNICODE) + specials
    w = gguf.GGUFWriter(str(path), arch)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([NORMAL] * 256 + [CONTROL] * len(specials))
    w.add_token_merges(["Ġ t"])
    w.add_bos_token_id(tokens.index("<|begin_of_text|>"))
    w.add_eos_token_id(tokens.index("<|endoftext|>"))
    w.add_add_bos_token(add_bos)
    if template is not None:
        w.add_chat_template(template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return GGUFFile(path)


def render(tmp_path, arch, messages=CHAT, template=None, add_bos=False, **kw) -> str:
    g = write_model(tmp_path / f"{arch}.gguf", arch, template, add_bos)
    return apply_chat_template(Tokenizer.from_gguf(g), g, messages, **kw)


@pytest.fixture(scope="module")
def gemma():
    g = GGUFFile(default_model_path())
    return g, Tokenizer.from_gguf(g)


def test_default_model_uses_gemma_turns(gemma):
    g, tok = gemma
    assert "tokenizer.chat_template" not in g.metadata
    prompt = apply_chat_template(tok, g, CHAT)
    assert prompt == GEMMA_CHAT
    ids = tok.encode(prompt)
    start = tok.token_to_id["<start_of_turn>"]
    assert ids[:2] == [tok.bos_id, start] and ids.count(start) == 4
    assert ids.count(tok.token_to_id["<end_of_turn>"]) == 3
    no_prompt = apply_chat_template(tok, g, CHAT[:2], add_generation_prompt=False)
    assert no_prompt == "<start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n"


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "some-new-arch"])
def test_chatml_fallback(tmp_path, arch):
    assert render(tmp_path, arch) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n Hi there <|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"
        "<|im_start|>user\nWhy\nnot?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_gguf_template_is_used_and_matches_chatml_fallback(tmp_path):
    assert render(tmp_path, "llama", template=CHATML_JINJA) == render(tmp_path, "qwen2")
    assert render(tmp_path, "llama", template=CHATML_JINJA, add_generation_prompt=False).endswith("not?<|im_end|>\n")


def test_gemma3_own_template_renders_like_the_fallback(tmp_path):
    assert render(tmp_path, "gemma3", CHAT, GEMMA3_JINJA, add_bos=True) == GEMMA_CHAT
    with pytest.raises(ChatError, match="roles must alternate"):
        render(tmp_path, "gemma3", [CHAT[1], CHAT[1]], GEMMA3_JINJA)


def test_llama3_fallback(tmp_path):
    assert render(tmp_path, "llama", CHAT[:2]) == (
        "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_fallback_follows_the_vocab_when_the_arch_format_has_no_tokens(tmp_path):
    g = write_model(tmp_path / "chatml-llama.gguf", "llama", specials=["<|im_start|>", "<|im_end|>"])
    prompt = apply_chat_template(Tokenizer.from_gguf(g), g, CHAT[1:2])
    assert prompt == "<|im_start|>user\n Hi there <|im_end|>\n<|im_start|>assistant\n"


# gemma folds the system prompt into the first user turn; ChatML gives it a turn of its own
@pytest.mark.parametrize("arch, turn, n_turns", [("gemma3", "<start_of_turn>", 4), ("qwen3", "<|im_start|>", 5)])
def test_synthetic_models_get_prompts_their_tokenizer_splits(tiny_model, arch, turn, n_turns):
    g = GGUFFile(tiny_model(arch))
    tok = Tokenizer.from_gguf(g)
    ids = tok.encode(apply_chat_template(tok, g, CHAT))
    assert ids.count(tok.find_token(turn)) == n_turns


def test_template_variables_and_bos_handling(tmp_path):
    template = (
        "{{ bos_token }}{% for m in messages %}{% if loop.index0 > 5 %}{% break %}{% endif %}"
        "[{{ m.role }}|{{ m.content | tojson }}]{% endfor %}{{ eos_token }}|{{ strftime_now('%Y') | length }}"
    )
    msgs = [{"role": "developer", "content": "ü"}, {"role": "user", "content": "x"}]
    # add_bos: the tokenizer adds BOS itself, so the template's one is dropped
    assert render(tmp_path, "qwen2", msgs, template, add_bos=True) == '[system|"ü"][user|"x"]<|endoftext|>|4'
    assert render(tmp_path, "qwen2", msgs, template, add_bos=False).startswith('<|begin_of_text|>[system|"ü"]')


def test_raise_exception_is_a_user_error(tmp_path):
    template = (
        "{% if messages[0].role != 'user' %}{{ raise_exception('first message must be from the user') }}{% endif %}ok"
    )
    with pytest.raises(ChatError, match="first message must be from the user") as e:
        render(tmp_path, "qwen2", CHAT, template)
    assert isinstance(e.value, UserError)
    assert render(tmp_path, "qwen2", CHAT[1:], template) == "ok"


@pytest.mark.parametrize(
    "template, error",
    [
        ("{% for m in messages %}", "does not parse"),
        ("{{ messages.__class__.__mro__[1].__subclasses__() }}", "failed"),
        ("{{ messages[0].content.nope() }}", "failed"),
        ("{{ messages[0].content + 5 }}", "TypeError"),
        ("{{ 1 / 0 }}", "ZeroDivisionError"),
    ],
)
def test_broken_or_unsafe_templates(tmp_path, template, error):
    with pytest.raises(ChatError, match=error):
        render(tmp_path, "qwen2", CHAT, template)


@pytest.mark.parametrize(
    "messages, error",
    [
        ([], "must not be empty"),
        ("hello", "must be a list"),
        ([{"content": "hi"}], r"messages\[0\] has no role"),
        ([{"role": "user"}], r"messages\[0\] \(user\) has no content"),
        (
            [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}],
            r"messages\[1\] has unknown role 'robot'",
        ),
        ([{"role": "user", "content": 5}], "must be a string or a list of text parts"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
            r"content\[0\]: image input is not supported",
        ),
        ([{"role": "user", "content": [{"type": "input_audio"}]}], "audio input is not supported"),
        ([{"role": "user", "content": [{"type": "file"}]}], "only text parts"),
        (["hi"], r"messages\[0\] must be an object"),
    ],
)
def test_invalid_messages(gemma, messages, error):
    g, tok = gemma
    with pytest.raises(ChatError, match=error):
        apply_chat_template(tok, g, messages)


def test_normalize_keeps_tool_calls_and_extra_keys():
    msgs = normalize_messages(
        [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}], "name": "a"},
        ]
    )
    assert msgs[1] == {"role": "assistant", "content": "", "tool_calls": [{"id": "1"}], "name": "a"}


def test_chat_template_object_reusable():
    t = ChatTemplate(CHATML_JINJA)
    assert t.render([{"role": "user", "content": "a"}]) == "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\n"
    assert (
        t.render([{"role": "user", "content": "b"}], add_generation_prompt=False) == "<|im_start|>user\nb<|im_end|>\n"
    )


@pytest.mark.unit
def test_chat_template_override_by_name_or_source(tmp_path):
    from hydra_console.engine.text.chat import CHATML_TEMPLATE

    g = GGUFFile(write_synthetic(tmp_path / "m.gguf", "llama"))
    tok = Tokenizer.from_gguf(g)
    assert ChatTemplate.for_model(tok, g, "chatml").source == CHATML_TEMPLATE
    assert ChatTemplate.for_model(tok, g, "{{ messages[0].content }}!").render(CHAT[:1]) == CHAT[0]["content"] + "!"
    # llama.cpp's built-in command-r, as its server test expects it rendered
    system_user = [{"role": "system", "content": "You are a test."}, {"role": "user", "content": "Hi there"}]
    assert ChatTemplate.for_model(tok, g, "command-r").render(system_user) == (
        "<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>You are a test.<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|USER_TOKEN|>"
        "Hi there<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>"
    )
    with pytest.raises(ChatError, match="unknown template name"):
        ChatTemplate.for_model(tok, g, "vicuna")
    # with --jinja (llama-server's rule) such text is a template: it renders as itself
    literal = ChatTemplate.for_model(tok, g, "This is not a chat template, it is", source=True)
    assert literal.render(CHAT[:1]) == "This is not a chat template, it is"
    assert ChatTemplate.for_model(tok, g, "chatml", source=True).source == CHATML_TEMPLATE  # names still win
    with pytest.raises(ChatError, match="does not parse"):
        ChatTemplate.for_model(tok, g, "{% if %}")


@pytest.mark.unit
def test_templates_see_todays_date_as_llama_cpp_names_it(tmp_path):
    from datetime import date

    g = GGUFFile(write_synthetic(tmp_path / "m.gguf", "llama"))
    tok = Tokenizer.from_gguf(g)
    text = ChatTemplate.for_model(tok, g, "{{ date_string }}|{{ datetime }}").render(CHAT[:1])
    today = date.today()
    assert text == f"{today:%d %b %Y}|{today:%b %d %Y}"


# A reasoning template in the style of DeepSeek R1 / QwQ: the turn opens a thinking block that
# `enable_thinking` false closes at once.
THINKING_JINJA = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|><think>\n{% if not enable_thinking %}</think>{% endif %}{% endif %}"
)


@pytest.mark.unit
def test_enable_thinking_defaults_to_whether_the_template_has_thinking():
    """As llama-server's --reasoning auto: true for a template that reacts to enable_thinking, false
    for one that does not; an explicit value (--reasoning on/off, chat_template_kwargs) wins."""
    thinking = ChatTemplate(THINKING_JINJA)
    assert thinking.supports_thinking
    assert thinking.prompt(CHAT[1:2]).endswith("<|assistant|><think>\n")
    assert thinking.prompt(CHAT[1:2], enable_thinking=False).endswith("<think>\n</think>")
    # this one shows the variable only without a generation prompt: no thinking, so false there
    plain = ChatTemplate(CHATML_JINJA + "{% if not add_generation_prompt %}{{ enable_thinking }}{% endif %}")
    assert not plain.supports_thinking
    assert plain.prompt(CHAT[1:2], add_generation_prompt=False).endswith("False")
    assert plain.prompt(CHAT[1:2], add_generation_prompt=False, enable_thinking=True).endswith("True")


@pytest.mark.unit
def test_an_undefined_name_joins_a_string_as_empty():
    """As llama.cpp's jinja (firefunction's template adds `functions`, which only its tool-calling
    path sets, to its system text); other uses of an undefined name still fail as a ChatError."""
    t = ChatTemplate("{{ 'tools:' + functions + '|' }}{{ messages[0].content }}")
    assert t.render(CHAT[:1]) == "tools:|" + CHAT[0]["content"]
    with pytest.raises(ChatError, match="undefined"):
        ChatTemplate("{{ functions.name.first }}").render(CHAT[:1])
