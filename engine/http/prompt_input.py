"""llama-server's prompt shapes, turned into token lists (its `tokenize_input_prompts`).

A request's prompt is one prompt or a list of them. One prompt is a string, a list of token ids,
a list mixing strings and token ids, or an object `{"prompt_string": ...}` holding one of the
first three. A list that holds any bare number is one prompt; a list of strings, lists or objects
is several. Strings are tokenized with the model's special tokens parsed; BOS is added to a
string, or to a mixed list whose first element is a string; token ids are taken as they are.
Anything else is an `InvalidParam` naming the field.
"""

from __future__ import annotations

from typing import Any, Callable

from ..serving.sampling_params import InvalidParam


def is_token(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def split_prompts(value: Any, param: str) -> list[Any]:
    """The prompts a request's field holds (each still in its JSON shape)."""
    if isinstance(value, list) and not any(is_token(x) for x in value):
        if not value:
            raise InvalidParam(f'"{param}" must not be empty', param)
        return value
    return [value]


def tokenize_prompt(value: Any, tok, param: str, object_prompt: Callable[[dict], list[int]] | None = None) -> list[int]:
    """One prompt's token ids. `object_prompt` reads an object shape other than `prompt_string`
    (the embeddings' `{"content": [parts]}`)."""
    if isinstance(value, str):
        return tok.encode(value, add_special=True, parse_special=True)
    if isinstance(value, list) and all(is_token(x) or isinstance(x, str) for x in value):
        ids: list[int] = []
        for i, part in enumerate(value):
            if isinstance(part, str):
                ids += tok.encode(part, add_special=i == 0, parse_special=True)
            else:
                ids.append(part)
        bad = next((t for t in ids if not 0 <= t < tok.vocab_size), None)
        if bad is not None:
            raise InvalidParam(f"token id {bad} is outside the vocabulary of {tok.vocab_size} tokens", param)
        return ids
    if isinstance(value, dict) and "prompt_string" in value:
        if "multimodal_data" in value:
            raise InvalidParam("multimodal data provided, but the model does not support multimodal requests", param)
        inner = value["prompt_string"]
        if isinstance(inner, dict):
            raise InvalidParam('"prompt_string" must be a string or a list of strings and token ids', param)
        return tokenize_prompt(inner, tok, param)
    if isinstance(value, dict) and object_prompt is not None:
        return object_prompt(value)
    raise InvalidParam(
        f'"{param}" elements must be a string, a list of tokens, a JSON object containing a prompt '
        "string, or a list of mixed strings & tokens",
        param,
    )
