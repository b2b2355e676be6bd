"""The plugin API (:mod:`kvcompose.api`): the one module a plugin or rule package imports from
kvcompose. The built-in plugins' and the example rule packages' code is parsed, not imported: each
``import``/``from`` of kvcompose in it must name ``kvcompose.api``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import kvcompose.api as api

REPO = Path(__file__).parents[2]

#: The package code that must import kvcompose only through the API (their tests are not in it).
PACKAGES = sorted(
    [p for p in (REPO / "plugins").glob("*/kvcompose_*") if p.is_dir()]
    + [p for p in (REPO / "examples").glob("*/kvcompose_*") if p.is_dir()]
)
#: A plugin's own test kit (a ``testing`` module or package) may also use kvcompose's test kit.
KIT = "kvcompose.testing"


def kvcompose_imports(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` of every import of kvcompose or one of its modules in ``path``."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "kvcompose":  # ``from kvcompose import api`` is the API too
                found += [(node.lineno, f"kvcompose.{a.name}") for a in node.names]
            else:
                found.append((node.lineno, node.module))
    return [(line, m) for line, m in found if m == "kvcompose" or m.startswith("kvcompose.")]


def package_files() -> list[Path]:
    return [f for p in PACKAGES for f in sorted(p.rglob("*.py"))]


def test_the_packages_are_found() -> None:
    names = {p.name for p in PACKAGES}
    assert {"kvcompose_nixl", "kvcompose_cpu_offload", "kvcompose_prefer"} <= names


@pytest.mark.parametrize("path", package_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_plugin_code_imports_kvcompose_only_through_the_api(path: Path) -> None:
    kit = "testing" in path.relative_to(path.parents[1]).with_suffix("").parts
    wrong = [
        f"{path.relative_to(REPO)}:{line}: imports {module}"
        for line, module in kvcompose_imports(path)
        if module != "kvcompose.api" and not (kit and (module == KIT or module.startswith(KIT + ".")))
    ]
    assert not wrong, "import these through kvcompose.api (or add them to it):\n" + "\n".join(wrong)


def test_the_example_rule_package_uses_the_api() -> None:
    [plugin] = [f for f in package_files() if f.parent.name == "kvcompose_prefer" and f.name == "plugin.py"]
    assert [m for _, m in kvcompose_imports(plugin)] == ["kvcompose.api"]


def test_every_exported_name_exists_once() -> None:
    assert len(api.__all__) == len(set(api.__all__))
    assert [n for n in api.__all__ if not hasattr(api, n)] == []


def test_the_api_carries_what_a_rule_package_needs() -> None:
    needed = {"hookimpl", "Rule", "Child", "Plan", "LoadRule", "StoreRule", "FaultsRule", "CompositionError"}
    assert needed | {"Problem", "FirstWins", "ChildrenParams", "index", "indices"} <= set(api.__all__)


def test_the_api_imports_no_vllm() -> None:
    code = textwrap.dedent(
        """
        import sys
        import kvcompose.api
        print(sorted(m for m in sys.modules if m == "vllm" or m.startswith("vllm.")))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
