"""Chat prompts: the model's own jinja template (`tokenizer.chat_template`) or a built-in one.

Rendering follows Hugging Face / llama.cpp: a sandboxed jinja2 environment with `trim_blocks` and
`lstrip_blocks`, `raise_exception`, `strftime_now`, and `bos_token` / `eos_token` / `date_string` / `datetime` variables.
Models without a template get a built-in one by architecture (gemma turns, ChatML, Llama 3 headers).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import cached_property, lru_cache
from typing import TYPE_CHECKING

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import UserError

if TYPE_CHECKING:
    from .tokenizer import Tokenizer

ROLES = ("system", "developer", "user", "assistant", "tool")
MEDIA_PARTS = {"image_url": "image", "input_audio": "audio"}  # OpenAI's content parts we cannot take

# Gemma has no system turn: the system text goes in front of the first user turn (as llama.cpp and
# Gemma's own template do); "assistant" is "model"; contents are trimmed.
GEMMA_TEMPLATE = """\
{%- set ns = namespace(system='') -%}
{%- for message in messages -%}
  {%- if message.role == 'system' -%}
    {%- set ns.system = ns.system + (message.content | trim) -%}
  {%- else -%}
    {%- set role = 'model' if message.role == 'assistant' else message.role -%}
    {{- '<start_of_turn>' + role + '\\n' -}}
    {%- if ns.system and role != 'model' -%}
      {{- ns.system + '\\n\\n' -}}
      {%- set ns.system = '' -%}
    {%- endif -%}
    {{- (message.content | trim) + '<end_of_turn>\\n' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}
"""

CHATML_TEMPLATE = """\
{%- for message in messages -%}
  {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}
"""

LLAMA3_TEMPLATE = """\
{%- for message in messages -%}
  {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + (message.content | trim) + '<|eot_id|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif -%}
"""

# llama.cpp's built-in `command-r` (Cohere): system, user and chatbot turns, contents trimmed.
COMMAND_R_TEMPLATE = """\
{%- set tokens = {'system': '<|SYSTEM_TOKEN|>', 'user': '<|USER_TOKEN|>', 'assistant': '<|CHATBOT_TOKEN|>'} -%}
{%- for message in messages -%}
  {{- '<|START_OF_TURN_TOKEN|>' + tokens[message.role] + (message.content | trim) + '<|END_OF_TURN_TOKEN|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>' }}{%- endif -%}
"""

FALLBACK_TEMPLATES = {
    "gemma": GEMMA_TEMPLATE,
    "chatml": CHATML_TEMPLATE,
    "llama3": LLAMA3_TEMPLATE,
    "command-r": COMMAND_R_TEMPLATE,
}
_FALLBACK_BY_ARCH = {
    "gemma": "gemma",
    "gemma2": "gemma",
    "gemma3": "gemma",
    "gemma3n": "gemma",
    "llama": "llama3",
    "qwen2": "chatml",
    "qwen3": "chatml",
    "qwen2moe": "chatml",
    "qwen3moe": "chatml",
}
# A token each format needs: a vocab without it gets the format whose token it has.
_MARKERS = {"gemma": "<start_of_turn>", "chatml": "<|im_start|>", "llama3": "<|start_header_id|>"}


class ChatError(UserError):
    """A message list that cannot be rendered (the HTTP layer answers 400 with this message)."""


def _raise_exception(message: str):
    raise ChatError(f"chat template: {message}")


def _tojson(value, indent=None, ensure_ascii=False, sort_keys=False, separators=None):
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys, separators=separators)


class _Undefined(jinja2.Undefined):
    """As llama.cpp's jinja: an undefined name joins a string as the empty string (templates such as
    firefunction's concatenate variables only their own tool-calling code path sets)."""

    def __add__(self, other):
        return other if isinstance(other, str) else super().__add__(other)

    def __radd__(self, other):
        return other if isinstance(other, str) else super().__radd__(other)


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"], undefined=_Undefined
    )
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.filters["tojson"] = _tojson
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatError(f"the model's chat template does not parse (line {e.lineno}): {e.message}") from None


class ChatTemplate:
    """A jinja chat template with the special-token texts of one vocabulary."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "", strip_bos: bool = True, name: str = ""):
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        # The tokenizer adds BOS itself when it tokenizes the prompt; a template's own `bos_token`
        # would make it twice (llama.cpp strips it the same way).
        self.strip_bos = strip_bos
        self.name = name

    @classmethod
    def for_model(cls, tok: Tokenizer, g, override: str | None = None, source: bool = False) -> ChatTemplate:
        """`override` (`--chat-template`: a built-in name or jinja source), else the GGUF's
        `tokenizer.chat_template`, else the built-in one for its architecture. Without `source`
        (`--jinja`), an override with no "{" must be a built-in name: a typo is an error, not a
        template that renders the typo."""
        bos = tok.token_text(tok.bos_id) if tok.bos_id is not None else ""
        eos = tok.token_text(tok.eos_id) if tok.eos_id is not None else ""
        strip = bool(tok.add_bos and bos)
        if override in FALLBACK_TEMPLATES:
            return cls(FALLBACK_TEMPLATES[override], bos, eos, strip, name=override)
        if override and not source and "{" not in override:  # a name, not jinja source
            raise ChatError(
                f"--chat-template {override!r}: unknown template name (built-in: "
                f"{', '.join(FALLBACK_TEMPLATES)}; or give jinja source or --chat-template-file)"
            )
        if override:
            _compile(override)  # a template that does not parse fails at start, not on the first chat
            return cls(override, bos, eos, strip, name="--chat-template")
        source = g.metadata.get("tokenizer.chat_template")
        if isinstance(source, str) and source.strip():
            return cls(source, bos, eos, strip, name="gguf")
        name = fallback_name(g.architecture, tok)
        return cls(FALLBACK_TEMPLATES[name], bos, eos, strip, name=name)

    def render(self, messages, add_generation_prompt: bool = True, **extra) -> str:
        template = _compile(self.source)
        now = datetime.now()
        context = {
            "messages": normalize_messages(messages),
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            # today's date, under the names llama.cpp gives templates (Llama 3.x, firefunction)
            "date_string": now.strftime("%d %b %Y"),
            "datetime": now.strftime("%b %d %Y"),
            **extra,
        }
        if "enable_thinking" not in extra:  # llama-server's --reasoning auto: on where the template has thinking
            context["enable_thinking"] = self.supports_thinking
        try:
            text = template.render(context)
        except ChatError:
            raise
        except Exception as e:  # the template is foreign code: any failure is about it and these messages
            raise ChatError(f"chat template failed on these messages: {type(e).__name__}: {e}") from None
        if self.strip_bos and self.bos_token and text.startswith(self.bos_token):
            text = text[len(self.bos_token) :]
        return text

    @cached_property
    def supports_thinking(self) -> bool:
        """Whether `enable_thinking` changes what this template renders for a user turn (llama-server
        passes true to such templates unless `--reasoning off`, false to all others)."""
        probe = [{"role": "user", "content": "test"}]
        try:
            return self.render(probe, True, enable_thinking=True) != self.render(probe, True, enable_thinking=False)
        except ChatError:
            return False

    def prompt(
        self, messages, add_generation_prompt: bool = True, continue_final_message: bool | None = None, **extra
    ) -> str:
        """The prompt text for a chat request, with llama-server's assistant prefill: a last
        assistant message is continued (its turn left open, no generation prompt) unless
        `continue_final_message` is False; two assistant messages at the end are refused."""
        last = messages[-1] if messages else None
        ends_with_assistant = isinstance(last, Mapping) and last.get("role") == "assistant"
        if continue_final_message is None and ends_with_assistant:
            if len(messages) >= 2 and isinstance(messages[-2], Mapping) and messages[-2].get("role") == "assistant":
                raise ChatError("Cannot have 2 or more assistant messages at the end of the list.")
            continue_final_message, add_generation_prompt = True, False
        if not continue_final_message:
            return self.render(messages, add_generation_prompt, **extra)
        if add_generation_prompt:
            raise ChatError("Cannot set both add_generation_prompt and continue_final_message to true.")
        if not ends_with_assistant:
            raise ChatError("continue_final_message needs an assistant message at the end of the list")
        if last.get("tool_calls"):
            raise ChatError("Cannot continue an assistant message that contains tool calls.")
        if isinstance(last.get("content"), list):  # llama-server continues text parts joined by a blank line
            last = {**last, "content": _join_parts(last["content"], len(messages) - 1, "\n\n")}
            messages = [*messages[:-1], last]
        text = self.render(messages, False, **extra)
        # The rendered turn ends with the template's closing text: cut right after the message's own
        # content (templates may trim it), so that generation continues it (as transformers does).
        content = normalize_messages([last])[0]["content"]
        needle = content.strip() or content
        at = text.rfind(needle) if needle else len(text)
        if at < 0:
            raise ChatError("chat template: the final assistant message does not appear in the rendered prompt")
        return text[: at + len(needle)]


def fallback_name(arch: str, tok: Tokenizer | None = None) -> str:
    """Built-in template for a model without one: by architecture (ChatML when unknown, as llama.cpp),
    unless the vocab lacks that format's turn token and has another's (a ChatML-tuned llama)."""
    name = _FALLBACK_BY_ARCH.get(arch, "chatml")
    if tok is not None and tok.find_token(_MARKERS[name]) is None:
        name = next((other for other, marker in _MARKERS.items() if tok.find_token(marker) is not None), name)
    return name


def normalize_messages(messages) -> list[dict]:
    """Checked copies of OpenAI-style messages, content flattened to one string.

    Content may be a string or a list of {"type": "text", "text": ...} parts; an assistant message
    carrying tool_calls may have no content."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise ChatError("messages must be a list of {role, content} objects")
    if not messages:
        raise ChatError("messages must not be empty")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ChatError(f"messages[{i}] must be an object with role and content, not {type(m).__name__}")
        role = m.get("role")
        if role is None:
            raise ChatError(f"messages[{i}] has no role")
        if role not in ROLES:
            raise ChatError(f"messages[{i}] has unknown role {role!r} (expected one of {', '.join(ROLES)})")
        content = m.get("content")
        if content is None:
            if not (role == "assistant" and m.get("tool_calls")):
                raise ChatError(f"messages[{i}] ({role}) has no content")
            content = ""
        elif isinstance(content, list):
            content = _join_parts(content, i)
        elif not isinstance(content, str):
            raise ChatError(f"messages[{i}].content must be a string or a list of text parts")
        # OpenAI's "developer" is the newer name of "system", which is all that templates know
        out.append({**m, "role": "system" if role == "developer" else role, "content": content})
    return out


def _join_parts(parts: list, i: int, sep: str = "\n") -> str:
    texts = []
    for j, part in enumerate(parts):
        if isinstance(part, Mapping) and part.get("type") in MEDIA_PARTS:
            raise ChatError(
                f"messages[{i}].content[{j}]: {MEDIA_PARTS[part['type']]} input is not supported "
                "(the model is text-only)"
            )
        if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise ChatError(f"messages[{i}].content[{j}]: only text parts are supported (got {kind!r})")
        texts.append(part["text"])
    return sep.join(texts)


def apply_chat_template(tok: Tokenizer, g, messages, add_generation_prompt: bool = True, **extra) -> str:
    """The prompt text for `messages` (encode it with add_special=True, parse_special=True)."""
    return ChatTemplate.for_model(tok, g).render(messages, add_generation_prompt, **extra)
