"""JSON messages that never trust the wire: the RPC port's request and reply layouts
(`contracts/rpc.py`) are dataclasses of `Message`, read with `from_json` / `decode` and written with
`to_json` / `encode` by both ends.

`from_json(obj)` takes exactly the declared fields: a key that is missing (and has no default), one
that is not declared, a value of another JSON type (a bool is not an integer, an integer is a
number) or a number outside its bounds raises `WireError`, whose message names the op and the field
(`tokens[3]`, `shm.size`); the servers answer it as a refused request (compute ERROR, control
BAD_REQUEST). Field types: int, float, str, bool, `list[...]`, `dict[str, ...]`, another `Message`,
and `X | None` (absent or null: None, left out by `to_json`). Bounds and the words of a refusal come
from `spec(...)` in the field's default.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from typing import Any, ClassVar, TypeVar

M = TypeVar("M", bound="Message")
MAX_STR = 1 << 12  # characters of a string field unless its spec says otherwise


class WireError(ValueError):
    """A message that is not what its layout says; `field` is the path of the first bad field."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


def spec(
    default: Any = dataclasses.MISSING,
    *,
    lo: float | None = None,
    hi: float | None = None,
    length: tuple[int, int] | None = None,
    inner: int | None = None,
    choices: typing.Collection[str] | None = None,
    why: str | None = None,
):
    """A field's bounds: `lo`..`hi` for a number or a list's numbers, `length` (min, max) for a list
    or string, `inner`: the length of each inner list (pairs: 2), `choices` for strings, and `why`:
    the refusal's words in place of the generated "'name' must be ..."."""
    meta = {"lo": lo, "hi": hi, "length": length, "inner": inner, "choices": choices, "why": why}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _join(names: list[str]) -> str:
    quoted = [repr(n) for n in names]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " and " + quoted[-1]


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class Message:
    """Base of the wire's JSON layouts (subclasses are dataclasses); `OP` names the op in errors."""

    OP: ClassVar[str] = ""

    @classmethod
    def _hints(cls) -> dict[str, Any]:
        hints = cls.__dict__.get("_hints_cache")
        if hints is None:
            hints = typing.get_type_hints(cls)
            cls._hints_cache = hints
        return hints

    @classmethod
    def from_json(cls: type[M], obj: Any, *, path: str = "") -> M:
        what = cls.OP or cls.__name__
        if not isinstance(obj, dict):
            raise WireError(f"{what}: {path or 'payload'} must be a JSON object (got {_short(obj)})", path or None)
        declared = [f.name for f in dataclasses.fields(cls)]
        extra = sorted(str(k) for k in obj.keys() - set(declared))
        if extra:
            name = f"{path}.{extra[0]}" if path else extra[0]
            raise WireError(f"{what} takes {_join(declared)} (got unknown {extra})", name)
        hints, values = cls._hints(), {}
        for f in dataclasses.fields(cls):
            name = f"{path}.{f.name}" if path else f.name
            if f.name not in obj:
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    raise WireError(f"{what}: '{name}' missing", name)
                continue
            values[f.name] = _check(what, name, obj[f.name], hints[f.name], f.metadata)
        self = cls(**values)
        self.validate()
        return self

    def validate(self) -> None:
        """Checks across fields (a subclass's); raise WireError naming the field."""

    @classmethod
    def decode(cls: type[M], payload) -> M:
        """From a JSON payload (empty: `{}`)."""
        try:
            obj = json.loads(bytes(payload) or b"{}")
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise WireError(f"{cls.OP or cls.__name__}: payload is not JSON: {e}") from None
        return cls.from_json(obj)

    def to_json(self) -> dict:
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None:
                out[f.name] = _plain(value)
        return out

    def encode(self) -> bytes:
        return json.dumps(self.to_json(), separators=(",", ":")).encode()


def _plain(value: Any) -> Any:
    if isinstance(value, Message):
        return value.to_json()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _check(what: str, name: str, value: Any, tp: Any, meta: dict) -> Any:
    """`value` as type `tp`, or WireError naming `name`."""
    lo, hi, length, choices = meta.get("lo"), meta.get("hi"), meta.get("length"), meta.get("choices")

    def refuse(desc: str):
        why = meta.get("why") or f"'{name}' must be {desc}"
        raise WireError(f"{what}: {why} (got {name}={_short(value)})", name)

    def bounds() -> str:
        if lo is not None and hi is not None:
            return f" {lo}..{hi}"
        return f" >= {lo}" if lo is not None else (f" <= {hi}" if hi is not None else "")

    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (types.UnionType, typing.Union):  # X | None
        if value is None:
            return None
        (tp,) = [a for a in args if a is not type(None)]
        return _check(what, name, value, tp, meta)
    if isinstance(tp, type) and issubclass(tp, Message):
        return tp.from_json(value, path=name)
    if tp is bool:
        if not isinstance(value, bool):
            refuse("true or false")
        return value
    if tp in (int, float):
        kind = "an integer" if tp is int else "a number"
        ok = isinstance(value, int) or (tp is float and isinstance(value, float) and math.isfinite(value))
        if isinstance(value, bool) or not ok:
            refuse(kind + bounds())
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            refuse(kind + bounds())
        return value
    if tp is str:
        most = length[1] if length else MAX_STR
        if not isinstance(value, str) or len(value) > most or (length and len(value) < length[0]):
            refuse(f"a string of at most {most} characters")
        if choices is not None and value not in choices:
            refuse(f"one of {sorted(choices)}")
        return value
    if origin is list:
        if not isinstance(value, list):
            refuse("a list")
        if length and not length[0] <= len(value) <= length[1]:
            refuse(f"a list of {length[0] if length[0] == length[1] else '%d..%d' % length} items")
        inner = meta.get("inner")
        item_meta = {**meta, "length": (inner, inner) if inner else None, "inner": None}
        return [_check(what, f"{name}[{i}]", v, args[0], item_meta) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            refuse("an object")
        return {str(k): _check(what, f"{name}.{k}", v, args[1], meta) for k, v in value.items()}
    if tp is dict:  # an object passed on as it is (its own layout reads it)
        if not isinstance(value, dict):
            refuse("an object")
        return value
    raise TypeError(f"{what}.{name}: no wire check for {tp!r}")  # a layout's bug, not the wire's
