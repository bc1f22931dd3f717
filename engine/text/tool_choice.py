"""What a request asks of tools: its `tools`, `tool_choice` and `parallel_tool_calls`, checked
(`ToolError`: 400 naming the field)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import UserError


class ToolError(UserError):
    """Bad `tools` / `tool_choice` (400 naming the field)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolChoice:
    """A request's tools and what it asks of them: `mode` none / auto / required; `name`: the one
    function a named tool_choice forces; `parallel`: more than one call allowed."""

    tools: tuple[dict, ...]
    mode: str
    name: str | None
    parallel: bool

    @property
    def parses(self) -> bool:
        return bool(self.tools) and self.mode != "none"

    @property
    def forces(self) -> bool:
        return bool(self.tools) and self.mode == "required"


def tool_choice_of(tools: list[dict] | None, tool_choice: Any, parallel: bool | None) -> ToolChoice:
    """The request's `tools`, `tool_choice` and `parallel_tool_calls`, checked."""
    tools = list(tools or [])
    names = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise ToolError(f'tools[{i}] must be {{"type": "function", "function": {{...}}}}', "tools")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ToolError(f"tools[{i}].function.name must be a non-empty string", "tools")
        if not isinstance(fn.get("parameters", {}), dict):
            raise ToolError(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        names.append(fn["name"])
    name = None
    if tool_choice is None:
        mode = "auto"
    elif isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise ToolError(
                f"tool_choice must be none, auto, required or a function, not {tool_choice!r}", "tool_choice"
            )
        mode = tool_choice
    elif isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict):
        name, mode = tool_choice["function"].get("name"), "required"
        if name not in names:
            raise ToolError(f"tool_choice names function {name!r}, which is not in tools", "tool_choice")
    else:
        raise ToolError(
            'tool_choice must be a string or {"type": "function", "function": {"name": ...}}', "tool_choice"
        )
    return ToolChoice(tuple(tools), mode, name, True if parallel is None else bool(parallel))
