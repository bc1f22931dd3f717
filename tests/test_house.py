"""House rules that hold for the whole tree, checked so they cannot regress: no file of the package
over MAX_LINES lines (issue 36: a file that long holds more than one concept; split it by concept), and
engine/ no wider than 20 top-level modules."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("app", "contracts", "engine")
MAX_LINES = 450


def _lines(path: Path) -> int:
    """As `wc -l` counts them."""
    return path.read_bytes().count(b"\n")


def _too_long(root: Path, limit: int = MAX_LINES) -> dict[str, int]:
    """Every .py file under the packages of `root` with more than `limit` lines, by path."""
    return {
        str(path.relative_to(root)): n
        for top in PACKAGES
        for path in sorted((root / top).rglob("*.py"))
        if (n := _lines(path)) > limit
    }


@pytest.mark.unit
def test_no_file_of_the_package_is_over_450_lines():
    assert len(list((ROOT / "engine").rglob("*.py"))) > 50  # the walk sees the tree at all
    assert _too_long(ROOT) == {}


@pytest.mark.unit
def test_a_file_over_the_limit_is_found(tmp_path):
    (tmp_path / "engine" / "model").mkdir(parents=True)
    (tmp_path / "engine" / "model" / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (tmp_path / "engine" / "short.py").write_text("x = 1\n" * MAX_LINES)
    assert _too_long(tmp_path) == {"engine/model/long.py": MAX_LINES + 1}


@pytest.mark.unit
def test_engine_keeps_at_most_20_top_level_modules():
    """Issue 36: a concept that grows gets a package (http/, spec/, serving/, ...), not more flat files."""
    modules = sorted(p.name for p in (ROOT / "engine").glob("*.py") if p.name != "__init__.py")
    assert 10 < len(modules) <= 20, modules
