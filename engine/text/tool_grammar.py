"""Pieces of the tool-call grammars (`tool_calls.ToolFormat.grammar`, Lark run by llguidance): the
JSON style templates write, tools' schemas as llama.cpp reads them, a call's schema from the probe's
shape, and literal text with its control tokens by id."""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING

from .tool_probe import ARGS, IDS, NAMES

if TYPE_CHECKING:
    from .tokenizer import Tokenizer

# JSON as templates write it (Python's json.dumps separators): the grammar asks for the same
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def closed_schema(schema):
    """The schema with llama.cpp's reading of objects: one that lists `properties` and says nothing
    of `additionalProperties` has no others (JSON Schema would allow any; a model then pads forever)."""
    if isinstance(schema, list):
        return [closed_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in ("properties", "$defs", "definitions", "patternProperties") and isinstance(value, dict):
            out[key] = {name: closed_schema(sub) for name, sub in value.items()}
        elif key in ("const", "enum", "default", "examples"):  # values, not schemas
            out[key] = value
        else:
            out[key] = closed_schema(value)
    if isinstance(out.get("properties"), dict) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def call_schema(shape, name: str, params: dict) -> dict:
    """JSON schema of a call to `name` shaped as the probe's object: its constant parts as constants."""
    if shape == ARGS[0]:
        return params
    if isinstance(shape, dict):
        props = {k: call_schema(v, name, params) for k, v in shape.items()}
        return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}
    if shape == NAMES[0]:
        return {"const": name}
    if shape == IDS[0]:
        return {"type": "string", "pattern": "^[a-zA-Z0-9]{9}$"}
    if shape == json.dumps(ARGS[0]):
        return {"type": "string"}
    if isinstance(shape, list):
        return {"type": "array", "prefixItems": [call_schema(v, name, params) for v in shape], "items": False}
    return {"const": shape}


def control_tokens(text: str, tok: Tokenizer) -> dict[str, int]:
    """The control tokens written in `text` (by their text)."""
    ids = tok.encode(text, add_special=False, parse_special=True) if text else []
    return {tok.token_text(t): t for t in ids if tok.is_special(t)}


def lark_literal(text: str, tok: Tokenizer) -> str:
    """A Lark piece for `text`: its control tokens by id (the model writes each as one token, never
    as text), the rest as quoted strings."""
    specials = control_tokens(text, tok)
    if not specials:
        return json.dumps(text, ensure_ascii=False)
    pieces = re.split("(" + "|".join(map(re.escape, specials)) + ")", text)
    return " ".join(f"<[{specials[p]}]>" if p in specials else json.dumps(p, ensure_ascii=False) for p in pieces if p)
