"""The probe conversation a chat template is rendered with to learn how it writes tool calls
(`tool_calls.ToolFormat.learn`), and reading its renderings: the region where the calls sit, JSON
found in it, and the parts of a call shaped as the probe's object."""

from __future__ import annotations

import json
from typing import Any

NAMES = ("hydra_probe_fn", "hydra_probe_fn_two")
ARGS = ({"hydra_probe_key": "hydra_probe_value"}, {"hydra_probe_key": "hydra_probe_value_two"})
IDS = ("hydra0001", "hydra0002")  # nine alphanumerics: Mistral's templates refuse other ids
CONTENT = "hydra_probe_content"
PROBE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": n,
            "description": "probe",
            "parameters": {"type": "object", "properties": {"hydra_probe_key": {"type": "string"}}},
        },
    }
    for n in NAMES
]


def probe_call(i: int, as_text: bool) -> dict:
    args = json.dumps(ARGS[i]) if as_text else ARGS[i]
    return {"id": IDS[i], "type": "function", "function": {"name": NAMES[i], "arguments": args}}


def shape_fields(shape, obj) -> dict[str, Any] | None:
    """The call's parts in `obj` ({name, arguments, id: what the probe has}) if it has the probe's
    shape `shape` (name, arguments and id where the probe has them), else None."""
    found: dict[str, Any] = {}

    def walk(s, o) -> bool:
        if s == ARGS[0] or s == json.dumps(ARGS[0]):  # the arguments: an object, or JSON text of one
            if isinstance(o, str):
                try:
                    o = json.loads(o)
                except ValueError:
                    return False
            found["arguments"] = o
            return isinstance(o, dict)
        if isinstance(s, dict):
            return isinstance(o, dict) and all(
                walk(v, o[k]) if k in o else v == IDS[0]  # an id may be left out
                for k, v in s.items()
                if _is_part(v)
            )
        if s == NAMES[0]:
            found["name"] = o
            return isinstance(o, str)
        if s == IDS[0]:
            found["id"] = o
            return isinstance(o, str)
        if isinstance(s, list):
            return isinstance(o, list) and len(o) == len(s) and all(walk(a, b) for a, b in zip(s, o))
        return True

    if not walk(shape, obj) or "name" not in found or not isinstance(found.get("arguments", {}), dict):
        return None
    return found


def _is_part(value) -> bool:
    """Whether a probe value is one the parser needs (name, arguments, id, or holds one)."""
    if value in (NAMES[0], IDS[0], json.dumps(ARGS[0])) or value == ARGS[0]:
        return True
    if isinstance(value, dict):
        return any(_is_part(v) for v in value.values())
    if isinstance(value, list):
        return any(_is_part(v) for v in value)
    return False


def region_of(content_turn: str, call_turn: str) -> str:
    """What the call turn has where the content turn has its text: the common prefix and suffix
    (the turn's frame) cut away, never through a `<...>` marker the two turns only partly share."""
    n = min(len(content_turn), len(call_turn))
    p = 0
    while p < n and content_turn[p] == call_turn[p]:
        p += 1
    s = 0
    while s < n - p and content_turn[-1 - s] == call_turn[-1 - s]:
        s += 1
    head, tail = call_turn[:p], call_turn[len(call_turn) - s :]
    if head.rfind("<") > head.rfind(">"):
        p = head.rfind("<")
    close, open_ = tail.find(">"), tail.find("<")
    if close >= 0 and (open_ < 0 or close < open_):
        s -= close + 1
    return call_turn[p : len(call_turn) - s]


def json_at(text: str, at: int):
    try:
        return json.JSONDecoder().raw_decode(text, at)
    except ValueError:
        return None, at


def holds(obj, target) -> bool:
    if obj == target:
        return True
    if isinstance(obj, dict):
        return any(holds(v, target) for v in obj.values())
    if isinstance(obj, list):
        return any(holds(v, target) for v in obj)
    return False


def cut_at(end: str, eos: str) -> str:
    """The calls' end without what follows the end of the turn (a template may open the next one)."""
    return end[: end.index(eos)] if eos and eos in end else end
