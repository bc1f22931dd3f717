"""Prompts of a request: llama-server's prompt forms (text, token ids, a list mixing both,
{"prompt_string": text}; a list of prompts), the chat prompt of a body with messages (tools,
chat_template_kwargs) and a chat request's tool plan (its checked tools, the template's call format)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel

from .bodies import ChatBody
from .errors import APIError

if TYPE_CHECKING:
    from ..text.tool_calls import ToolFormat
    from ..text.tool_choice import ToolChoice
    from .handle import Head

PROMPT_FORMS = (
    '"prompt" elements must be a string, a list of tokens, a JSON object containing a prompt string, '
    "or a list of mixed strings & tokens."
)  # llama-server's words


def check_token_ids(head: Head, ids: list[int], param: str = "prompt") -> list[int]:
    bad = next((t for t in ids if not 0 <= t < head.tok.vocab_size), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is outside the vocabulary of {head.tok.vocab_size}", param=param)
    return ids


def tokenize_mixed(head: Head, prompt, add_special: bool = True, parse_special: bool = True) -> list[int]:
    """llama-server's prompt forms in one: text, token ids, or a list mixing both (only the first
    element, if it is text, gets the BOS), or {"prompt_string": text}."""
    if isinstance(prompt, dict):
        if "multimodal_data" in prompt:
            raise APIError(
                400, "Multimodal data provided, but model does not support multimodal requests.", param="prompt"
            )
        if not isinstance(prompt.get("prompt_string"), str):
            raise APIError(400, "a prompt object must hold a prompt_string", param="prompt")
        prompt = prompt["prompt_string"]
    if isinstance(prompt, str):
        return head.tok.encode(prompt, add_special=add_special, parse_special=parse_special)
    if not isinstance(prompt, list):
        raise APIError(400, PROMPT_FORMS, param="prompt")
    ids: list[int] = []
    for i, part in enumerate(prompt):
        if isinstance(part, str):
            ids += head.tok.encode(part, add_special=add_special and i == 0, parse_special=parse_special)
        elif isinstance(part, int) and not isinstance(part, bool):
            ids.append(part)
        else:
            raise APIError(400, PROMPT_FORMS, param="prompt")
    return check_token_ids(head, ids)


def split_prompts(prompt) -> list:
    """llama-server's rule: a list that holds no token id at its top level is a list of prompts;
    anything else is one prompt."""
    if isinstance(prompt, list) and prompt and not any(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        return prompt
    return [prompt]


def tool_plan(head: Head, body: ChatBody) -> tuple[ToolChoice, ToolFormat | None]:
    """The request's checked tools and the chat template's tool-call format (None: the template
    writes no calls we can read)."""
    from ..text.tool_calls import ToolFormat
    from ..text.tool_choice import tool_choice_of

    choice = tool_choice_of(body.tools, body.tool_choice, body.parallel_tool_calls)
    if choice.parses and body.grammar is not None:  # llama-server's rule and words
        raise APIError(400, "Cannot use custom grammar constraints with tools.", param="grammar")
    return choice, ToolFormat.learn(head.chat_template) if choice.tools else None


# The chat prompt's own arguments (`chat_prompt`, `ChatTemplate.prompt`): chat_template_kwargs may not name them.
TEMPLATE_ARGUMENTS = frozenset({"head", "self", "messages", "add_generation_prompt", "continue_final_message"})


def template_prompt(head: Head, body) -> str:
    """The chat prompt of a body with `messages`, `add_generation_prompt`, `continue_final_message`,
    `tools` and `chat_template_kwargs` (a chat request, /apply-template, input_tokens)."""
    from ..text.tool_calls import ToolFormat, arguments_as_objects

    messages = [m.model_dump(exclude_none=True) if isinstance(m, BaseModel) else m for m in body.messages]
    fmt = (
        ToolFormat.learn(head.chat_template)
        if any(isinstance(m, dict) and m.get("tool_calls") for m in messages)
        else None
    )
    if fmt is not None and fmt.object_arguments:  # as llama.cpp: JSON-text arguments to templates that read objects
        messages = arguments_as_objects(messages)
    taken = sorted(TEMPLATE_ARGUMENTS & set(body.chat_template_kwargs or {}))
    if taken:  # the request's own fields (or our parameters): not template variables to override
        raise APIError(
            400,
            f"chat_template_kwargs must not set {', '.join(taken)}: the request's own fields say that",
            param=f"chat_template_kwargs.{taken[0]}",
        )
    extra = {**head.cfg.chat_template_kwargs, **(body.chat_template_kwargs or {})}
    if body.tools:
        extra["tools"] = body.tools
    from ..text.chat import ChatError

    try:
        return chat_prompt(head, messages, body.add_generation_prompt, body.continue_final_message, **extra)
    except ChatError as e:  # about the messages, or how they end (continue_final_message)
        field = "continue_final_message" if "continue_final_message" in str(e) else "messages"
        raise APIError(400, str(e), param=getattr(e, "param", None) or field) from None


def chat_prompt(
    head: Head,
    messages: list[dict],
    add_generation_prompt: bool = True,
    continue_final_message: bool | None = None,
    **extra,
) -> str:
    """The chat prompt text (tokenize it with add_special=True, parse_special=True)."""
    return head.chat_template.prompt(messages, add_generation_prompt, continue_final_message, **extra)
