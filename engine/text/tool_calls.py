"""Tool calls: how a chat template writes an assistant's calls, learned by rendering one, and the
parser / grammar that follow it.

llama.cpp (common/chat-auto-parser*.cpp) learns a template's tool-call format by rendering
assistant turns that differ in one part and reading the difference; this module does the same for
the two shapes that cover the common templates (Hermes / Qwen 2.5, Llama 3.x, Mistral Nemo,
firefunction, Command R7B, functionary v3.1, DeepSeek R1, ...):

- JSON calls: `{"name": ..., "arguments": {...}}` (any key names and nesting, `id` included), with
  whatever text the template puts before, between and after them (`<tool_call>\\n`, `[TOOL_CALLS][`,
  `, `, `]`, or nothing at all);
- tagged calls: text, the function's name, text, its JSON arguments, text
  (`<function=NAME>{...}</function>`, `function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n````).

`ToolFormat.learn(template)` renders a probe conversation three ways (text content, one call, two
calls): the common prefix and suffix are the turn's frame, the rest how calls are written. A
template that writes no call this way (it ignores `tool_calls`, or writes arguments as tags) has no
format: its requests are answered as text, as llama-server does for templates without tools.

Generated text is parsed back into content and calls (`ToolFormat.parse`); `tool_choice: required`
(or a named function) constrains generation to calls with a Lark grammar over the tools' JSON
schemas (`ToolFormat.grammar`, run by engine/structured.py), and `auto` constrains a call once its
start marker is written (llama.cpp's lazy grammar).
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from .tool_choice import ToolChoice
from .tool_grammar import JSON_STYLE, call_schema, closed_schema, control_tokens, lark_literal
from .tool_probe import (
    ARGS,
    CONTENT,
    IDS,
    NAMES,
    PROBE_TOOLS,
    cut_at,
    holds,
    json_at,
    probe_call,
    region_of,
    shape_fields,
)

if TYPE_CHECKING:
    from .chat import ChatTemplate
    from .tokenizer import Tokenizer

_ID_CHARS = string.ascii_letters + string.digits


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str

    def to_json(self) -> dict:
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}, "id": self.id}


def new_call_id() -> str:
    """A call id for a call the model wrote without one (llama-server's: 32 random alphanumerics)."""
    return "".join(secrets.choice(_ID_CHARS) for _ in range(32))


def arguments_as_objects(messages: list[dict]) -> list[dict]:
    """Assistant tool calls with JSON-text arguments given as objects, as templates read them
    (llama.cpp does the same for templates that take object arguments)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if isinstance(calls, list):
            fixed = []
            for c in calls:
                fn = c.get("function") if isinstance(c, dict) else None
                if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                    try:
                        c = {**c, "function": {**fn, "arguments": json.loads(fn["arguments"])}}
                    except ValueError:
                        pass
                fixed.append(c)
            m = {**m, "tool_calls": fixed}
        out.append(m)
    return out


# ---- the format --------------------------------------------------------------------------------


def reply_parts(fmt: ToolFormat | None, text: str) -> tuple[str, list[ToolCall]]:
    """A finished reply's content and tool calls (`fmt`: the template's call format, None when the
    request has no tools); beside calls the content loses its surrounding whitespace."""
    if fmt is None:
        return text, []
    content, calls = fmt.parse(text)
    return (content.strip() if calls else content), calls


@dataclass(frozen=True)
class ToolFormat:
    """How one template writes calls: `start` + call + (`sep` + call)* + `end`, each call either a
    JSON object shaped as `shape` (the probe call's object: where the name, arguments and id go)
    or, tagged, the name + `before_args` + the arguments as JSON."""

    start: str
    end: str
    sep: str | None  # None: the template writes one call per turn
    shape: Any | None  # JSON calls: the probe's decoded object
    before_args: str  # tagged calls: text between the name and the arguments
    object_arguments: bool = True  # the template reads a call's arguments as an object, not JSON text
    # what text starts with where calls start with nothing (functionary v3.2's recipient `all\n`):
    # text and calls are told apart by it, and calls may follow the text after `sep`
    text_prefix: str = ""

    @staticmethod
    def learn(template: ChatTemplate) -> ToolFormat | None:
        return _learn(template.source, template.bos_token, template.eos_token, template.strip_bos, template.name)

    # ---- parsing ----

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content, calls) of a finished generation; text that is not a well-formed call stays content."""
        if self.text_prefix:  # recipient formats: text (after its prefix) up to the separator, then calls
            if not text.startswith(self.text_prefix):
                calls = self._calls_from(text, 0)
                return ("", calls) if calls else (text, [])
            body = text[len(self.text_prefix) :]
            at = body.find(self.sep) if self.sep else -1
            calls = self._calls_from(body, at + len(self.sep)) if at >= 0 else None
            return (body[:at], calls) if calls else (body, [])
        start = self.start.strip()
        if start:
            at = text.find(start)
            if at < 0:
                return text, []
            content, pos = text[:at], at + len(start)
        else:  # calls written bare: the message is calls only, or it is text
            content, pos = "", len(text) - len(text.lstrip())
            if not text[pos:].startswith("{"):
                return text, []
        calls = self._calls_from(text, pos)
        return (content, calls) if calls else (text, [])

    def _calls_from(self, text: str, pos: int) -> list[ToolCall] | None:
        """The calls written from `pos` to the end of `text` (their end marker optional), or None."""
        calls = []
        while True:
            call, pos = self._call_at(text, pos)
            if call is None:
                return None
            calls.append(call)
            rest = text[pos:].lstrip()
            nxt = self._next_call(rest)
            if nxt is None:
                break
            pos = len(text) - len(rest) + nxt
        tail = text[pos:].strip()
        end = self.end.strip()
        if end and tail.startswith(end):
            tail = tail[len(end) :].strip()
        return None if tail else calls  # something after the calls that is not their end: not calls after all

    def _next_call(self, rest: str) -> int | None:
        """Offset in `rest` where another call starts, None if the calls end here."""
        sep = (self.sep or "").strip()
        if sep and rest.startswith(sep):
            return len(rest) - len(rest[len(sep) :].lstrip())
        end, start = self.end.strip(), self.start.strip()
        if end and start and rest.startswith(end) and rest[len(end) :].lstrip().startswith(start):
            after = rest[len(end) :].lstrip()[len(start) :]
            return len(rest) - len(after.lstrip())
        return None

    def _call_at(self, text: str, pos: int) -> tuple[ToolCall | None, int]:
        decoder = json.JSONDecoder()
        pos += len(text[pos:]) - len(text[pos:].lstrip())
        if self.shape is not None:
            try:
                obj, pos = decoder.raw_decode(text, pos)
            except ValueError:
                return None, pos
            return _from_shape(self.shape, obj), pos
        sep = self.before_args.strip()
        at = text.find(sep, pos) if sep else text.find("{", pos)
        name = text[pos:at].strip() if at >= 0 else ""
        if not name or any(c.isspace() for c in name):
            return None, pos
        pos = at + len(sep)
        pos += len(text[pos:]) - len(text[pos:].lstrip())
        try:
            args, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return None, pos
        if not isinstance(args, dict):
            return None, pos
        return ToolCall(name, json.dumps(args, ensure_ascii=False), new_call_id()), pos

    def content_span(self, text: str) -> tuple[int, int]:
        """The part of streamed `text` that is surely content, as (from, to): up to where a call
        may be starting (the rest is held back until the generation ends and `parse` decides)."""
        if self.text_prefix:
            if not text.startswith(self.text_prefix):  # a call, or its prefix not complete yet
                return 0, 0
            n = len(self.text_prefix)
            return n, n + _before_marker(text[n:], self.sep or "")
        start = self.start.strip()
        if not start:
            return 0, (0 if not text.strip() or text.lstrip().startswith("{") else len(text))
        return 0, _before_marker(text, start)

    def stream(self) -> StreamedCalls:
        return StreamedCalls(self)

    # ---- the grammars of tool_choice required / auto ----

    def preserved(self, tok: Tokenizer) -> frozenset[int]:
        """The control tokens the calls are written with: kept in the generated text for `parse`."""
        return frozenset(
            t
            for part in (self.start, self.sep or "", self.before_args, self.end)
            for t in control_tokens(part, tok).values()
        )

    @property
    def triggers(self) -> bool:
        """Whether calls start with a marker, so that text before one can be told from it."""
        return bool(self.start.strip())

    def grammar(self, choice: ToolChoice, tok: Tokenizer, lazy: bool = False) -> str:
        """Lark source (llguidance) of a turn made of calls only: one call, or with `parallel` as
        many as the model writes, to the tools (or the named one) with arguments per their schema.
        `lazy` (tool_choice auto, llama.cpp's lazy grammar): any text without the calls' start
        marker, or such text, the marker, and calls as above."""
        tools = [t["function"] for t in choice.tools if choice.name is None or t["function"]["name"] == choice.name]
        rules = []
        for i, fn in enumerate(tools):
            params = (
                closed_schema({"type": "object", **fn["parameters"]}) if fn.get("parameters") else {"type": "object"}
            )
            if self.shape is not None:
                schema = {**call_schema(self.shape, fn["name"], params), "x-guidance": JSON_STYLE}
                rules.append(f"call_{i}: %json {json.dumps(schema)}")
            else:
                args = {**params, "x-guidance": JSON_STYLE}
                rules.append(f"call_{i}: {lark_literal(fn['name'] + self.before_args, tok)} %json {json.dumps(args)}")
        calls = " | ".join(f"call_{i}" for i in range(len(tools)))
        more = f" ({lark_literal(self.sep, tok)} call)*" if choice.parallel and self.sep is not None else ""
        end = f" {lark_literal(self.end, tok)}" if self.end else ""
        if not lazy:
            start = f"{lark_literal(self.start, tok)} " if self.start else ""
            return "\n".join([f"start: {start}call{more}{end}", f"call: {calls}", *rules])
        marker = self.start.strip()
        lead = self.start[self.start.index(marker) :]  # the whitespace before the marker is the text's
        text = f"TEXT: /(?s:.*)/ & ~/(?s:.*{re.escape(marker).replace('/', chr(92) + '/')}.*)/"
        tid = tok.find_token(marker)
        if tid is not None and tok.is_special(tid):  # text cannot hold the token: no lexing ambiguity
            head = [f"start: TEXT | TEXT {lark_literal(lead, tok)} call{more}{end}"]
        else:  # one lexeme for text + marker: the text lexeme alone would swallow the marker's first bytes
            head = [f"start: TEXT | OPENING call{more}{end}", f"OPENING: TEXT {json.dumps(lead, ensure_ascii=False)}"]
        return "\n".join([*head, text, f"call: {calls}", *rules])


class StreamedCalls:
    """One streamed choice: its text is sent as content as it comes, except from where a call may
    be starting; `finish` parses the whole generation and gives what is left to send."""

    def __init__(self, fmt: ToolFormat):
        self.fmt, self.text = fmt, ""
        self.sent = 0  # chars of content sent so far: always a prefix of what `parse` gives in the end

    def push(self, piece: str) -> str:
        """The content that may be sent now."""
        self.text += piece
        lo, hi = self.fmt.content_span(self.text)
        out = self.text[lo + self.sent : hi]
        self.sent += len(out)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content not sent yet, the calls)."""
        content, calls = self.fmt.parse(self.text)
        rest = content[self.sent :]
        return (rest.rstrip() if calls else rest), calls


def _before_marker(text: str, marker: str) -> int:
    """Where `marker` starts in `text`, or a piece of it cut by the end of `text`; else its length."""
    if not marker:
        return len(text)
    at = text.find(marker)
    if at >= 0:
        return at
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return len(text) - k
    return len(text)


def _from_shape(shape, obj) -> ToolCall | None:
    """The call in `obj` if it has the probe's shape (name, arguments and id where the probe has them)."""
    found = shape_fields(shape, obj)
    if found is None:
        return None
    args = json.dumps(found.get("arguments", {}), ensure_ascii=False)
    return ToolCall(found["name"], args, found.get("id") or new_call_id())


# ---- learning a template's format ------------------------------------------------------------


@lru_cache(maxsize=8)
def _learn(source: str, bos: str, eos: str, strip_bos: bool, name: str) -> ToolFormat | None:
    from .chat import ChatError, ChatTemplate

    template = ChatTemplate(source, bos, eos, strip_bos, name)
    user = {"role": "user", "content": "hydra_probe_user"}

    def render(assistant: dict) -> str | None:
        try:
            return template.render([user, {"role": "assistant", **assistant}], False, tools=PROBE_TOOLS)
        except ChatError:
            return None

    text = render({"content": CONTENT})
    if text is None:
        return None
    for as_text in (False, True):  # templates read arguments as objects, a few as JSON text
        one = render({"content": None, "tool_calls": [probe_call(0, as_text)]})
        region = region_of(text, one) if one is not None else ""
        # what the text turn writes before its text where calls start with nothing (a recipient)
        written = region_of(one, text) if one is not None else ""
        prefix = written[: -len(CONTENT)] if written.endswith(CONTENT) else ""
        fmt = _read_one(region, eos, bool(prefix))
        if fmt is not None or NAMES[0] in region:  # written, but not as JSON: not a format we read
            break
    if fmt is not None and fmt.start.strip():
        prefix = ""
    if fmt is None or [(c.name, c.arguments) for c in replace(fmt, text_prefix=prefix).parse(region)[1]] != [
        (NAMES[0], json.dumps(ARGS[0]))
    ]:
        return None
    fmt = replace(fmt, text_prefix=prefix)
    two = render({"content": None, "tool_calls": [probe_call(0, as_text), probe_call(1, as_text)]})
    sep = _read_sep(fmt, region_of(text, two)) if two is not None else None
    if sep is not None and len(replace(fmt, sep=sep).parse(region_of(text, two))[1]) != 2:
        sep = None
    return replace(fmt, sep=sep, object_arguments=not as_text)


def _read_one(region: str, eos: str, told_apart: bool = False) -> ToolFormat | None:
    """The format of a turn holding the one probe call, if it is a JSON or a tagged call."""
    name = region.find(NAMES[0])
    if name < 0:
        return None
    for at in (i for i, c in enumerate(region[:name]) if c == "{"):  # outermost first
        obj, end = json_at(region, at)
        if isinstance(obj, dict) and holds(obj, NAMES[0]) and (holds(obj, ARGS[0]) or holds(obj, json.dumps(ARGS[0]))):
            return ToolFormat(region[:at], cut_at(region[end:], eos), None, obj, "")
    key = region.find('"hydra_probe_key"', name)
    args_at = region.rfind("{", name, key) if key >= 0 else -1
    args, end = json_at(region, args_at) if args_at >= 0 else (None, 0)
    if args != ARGS[0]:
        return None
    before = region[name + len(NAMES[0]) : args_at]
    if not (region[:name].strip() or told_apart) or IDS[0] in region[:args_at]:  # calls not told from text; ids in tags
        return None
    return ToolFormat(region[:name], cut_at(region[end:], eos), None, None, before)


def _read_sep(fmt: ToolFormat, region: str) -> str | None:
    """The text between the calls of a two-call turn; None unless the turn is start + call + text +
    call + end with no other probe text between them."""
    if not region.startswith(fmt.start):
        return None
    first = len(fmt.start)
    if fmt.shape is None:
        first += len(NAMES[0]) + len(fmt.before_args)
    _, first_end = json_at(region, first)
    if first_end == first:
        return None
    if fmt.shape is None:
        second = region.find(NAMES[1], first_end)
    else:
        second = next(
            (i for i in range(first_end, len(region)) if region[i] == "{" and holds(json_at(region, i)[0], NAMES[1])),
            -1,
        )
    sep = region[first_end:second] if second >= 0 else ""
    return sep if sep and "hydra_probe" not in sep and "{" not in sep else None
