"""No module of the package imports itself back through others: every import counts, those under
`if TYPE_CHECKING:` and those inside functions too (a cycle dodged by either is still a cycle in
what a reader must hold in their head)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("app", "contracts", "engine")


def _modules() -> dict[str, Path]:
    mods = {}
    for top in PACKAGES:
        for path in (ROOT / top).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """The package modules `name` imports, by any import statement anywhere in it."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            elif (node.module or "").startswith("hydra_console."):
                base = node.module.removeprefix("hydra_console.")
            else:
                continue
            named = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in mods]
            out |= set(named) or ({base} if base in mods else set())
        elif isinstance(node, ast.Import):
            out |= {a.name.removeprefix("hydra_console.") for a in node.names} & set(mods)
    return out - {name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
                on.discard(comp[-1])
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


@pytest.mark.unit
def test_the_package_has_no_import_cycles():
    mods = _modules()
    graph = {name: _imports(name, path, mods) for name, path in mods.items()}
    assert "engine.model.stage" in graph["engine.model"]  # the walk sees imports at all
    assert _cycles(graph) == []


@pytest.mark.unit
def test_a_cycle_through_a_type_only_import_is_found():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
