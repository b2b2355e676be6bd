"""The package's layout: no import cycles in the core, no core import of a plugin, no dead paths.

Imports are read with :mod:`ast`, not by importing, so every import counts: module level,
inside functions, and under ``if TYPE_CHECKING:``. A function-level import hides a cycle from
Python at runtime but not from a reader, and a ``TYPE_CHECKING`` one still makes two modules
depend on each other's shape.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).parents[2]
CORE = ROOT / "kvcompose"
#: The plugin packages shipped beside the core; the core reaches them only through entry points.
PLUGIN_PACKAGES = ("kvcompose_nixl", "kvcompose_cpu_offload")
#: Where the repository's own text lives (a virtual environment or build output is not ours).
SEARCHED = ("kvcompose", "plugins", "docs", "tests")
TEXT_SUFFIXES = {".py", ".md", ".toml", ".yaml", ".yml", ".json", ".txt", ".cfg", ".ini", ".sh"}


def module_name(path: Path) -> str:
    """The dotted name of a file under the repository root (a package is its ``__init__``)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def core_modules() -> dict[str, Path]:
    """Every module of the core package, by dotted name."""
    return {module_name(p): p for p in sorted(CORE.rglob("*.py"))}


def imported_names(path: Path, name: str) -> Iterator[str]:
    """Every dotted name ``path`` imports, wherever the import statement is (relative ones resolved).

    For ``from a.b import c`` both ``a.b`` and ``a.b.c`` are yielded: ``c`` may be a submodule,
    and the caller keeps only names that are modules.
    """
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                # A package's own name is its base for level 1; a module's is its package's.
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            yield target
            yield from (f"{target}.{alias.name}" for alias in node.names)


def import_graph() -> dict[str, set[str]]:
    """Core module -> the core modules it names in an import (parent packages not implied)."""
    modules = core_modules()
    return {
        name: {t for t in imported_names(path, name) if t in modules and t != name} for name, path in modules.items()
    }


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path that returns to its start, or None (depth-first, deterministic)."""
    WHITE, GREY, BLACK = 0, 1, 2
    colour = dict.fromkeys(graph, WHITE)
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        colour[node] = GREY
        stack.append(node)
        for nxt in sorted(graph[node]):
            if colour[nxt] == GREY:
                return stack[stack.index(nxt) :] + [nxt]
            if colour[nxt] == WHITE and (found := visit(nxt)):
                return found
        stack.pop()
        colour[node] = BLACK
        return None

    for start in sorted(graph):
        if colour[start] == WHITE and (found := visit(start)):
            return found
    return None


def test_the_cycle_finder_reports_a_path() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_imports_are_read_wherever_they_are(tmp_path: Path) -> None:
    """Module level, in a function, under TYPE_CHECKING, and relative ones resolved."""
    source = tmp_path / "mod.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "import kvcompose.config\n"
        "if TYPE_CHECKING:\n    from kvcompose.catalog import Plan\n"
        "def f():\n    from kvcompose.testing import harness\n"
        "from . import units\n"
        "from ..rules.load import x\n"
    )
    names = set(imported_names(source, "kvcompose.vllm.mod"))
    assert {
        "kvcompose.config",
        "kvcompose.catalog",
        "kvcompose.testing.harness",
        "kvcompose.vllm.units",
        "kvcompose.rules.load",
    } <= names


def test_no_import_cycle_among_core_modules() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_core_does_not_import_a_plugin_package() -> None:
    offenders = sorted(
        {
            f"{name} imports {target}"
            for name, path in core_modules().items()
            for target in imported_names(path, name)
            if target.split(".")[0] in PLUGIN_PACKAGES
        }
    )
    assert not offenders, "the core must reach plugins through entry points only: " + "; ".join(offenders)


def test_nothing_refers_to_a_reference_folder() -> None:
    """The notes once kept in a ``reference/`` folder are not in this repository: a pointer there is dead."""
    this = Path(__file__).resolve()
    hits = [
        f"{path.relative_to(ROOT)}:{number}"
        for folder in SEARCHED
        for path in sorted((ROOT / folder).rglob("*"))
        if path.is_file()
        and path.suffix in TEXT_SUFFIXES
        and path.resolve() != this
        and not any(part.endswith(".egg-info") or part == "__pycache__" for part in path.parts)
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if "reference/" in line
    ]
    assert not hits, "refers to a reference/ folder: " + ", ".join(hits)
