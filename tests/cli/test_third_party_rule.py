"""A third-party rule package (examples/prefer-rule), installed with pip and selected from YAML.

The package is installed into a folder of its own and every check runs in a subprocess whose
``PYTHONPATH`` holds that folder: kvcompose must find the rule through its ``kvcompose`` entry
point, exactly as it finds a package a user installed, and this test run's plugin manager and
``sys.path`` stay untouched.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).parents[2]
EXAMPLE = REPO / "examples" / "prefer-rule"
PROJECT = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())["project"]


@dataclass(frozen=True)
class Installed:
    root: Path  # the subprocesses' working folder: neither the package source nor the repo
    source: Path  # the copy of the example that pip installed
    env: dict[str, str]

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, *args], cwd=self.root, env=self.env, capture_output=True, text=True, timeout=120
        )


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    root = tmp_path_factory.mktemp("prefer")
    # pip builds in the source tree (build/, *.egg-info): build a copy, never the repo's files.
    source = root / "prefer-rule"
    shutil.copytree(EXAMPLE, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    site = root / "site"
    # Offline: the venv's setuptools builds it (no isolated build env to download into), and
    # kvcompose, its one dependency, is the one under test.
    pip = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--disable-pip-version-check"]
        + ["--no-deps", "--no-build-isolation", "--target", str(site), str(source)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert pip.returncode == 0, pip.stdout + pip.stderr
    env = {k: v for k, v in os.environ.items() if k not in ("KVCOMPOSE_PLUGINS", "KVCOMPOSE_TRACE")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH")) if p)
    return Installed(root, source, env)


def test_plugins_lists_the_rule_with_its_distribution(installed: Installed) -> None:
    out = installed.run("-m", "kvcompose.cli", "plugins")
    assert out.returncode == 0, out.stderr
    line = next(line for line in out.stdout.splitlines() if line.startswith("load prefer "))
    assert f"{PROJECT['name']} {PROJECT['version']}" in line


def test_check_explains_the_rule(installed: Installed) -> None:
    out = installed.run("-m", "kvcompose.cli", "check", str(installed.source / "composition.yaml"))
    assert out.returncode == 0, out.stderr
    assert (
        "  load: a request whose kv_transfer_params carry 'prefer_host' asks host first; otherwise the first "
        "child with a hit loads, in this order: pd > host; later children are not asked\n" in out.stdout
    )


def test_an_unknown_child_is_a_located_error(installed: Installed) -> None:
    text = (installed.source / "composition.yaml").read_text()
    assert "child: host," in text
    bad = installed.root / "bad.yaml"
    bad.write_text(text.replace("child: host,", "child: hots,"))
    line_no, line = next((n, t) for n, t in enumerate(text.splitlines(), 1) if "child: host," in t)
    out = installed.run("-m", "kvcompose.cli", "check", str(bad))
    assert out.returncode == 2
    assert out.stderr == (
        f"{bad}:{line_no}:{line.index('host,') + 1}: rules.load.child: "
        "no connector is named 'hots' (did you mean host?)\n"
    )


def test_the_packages_own_tests_pass(installed: Installed) -> None:
    out = installed.run("-m", "pytest", "-q", "-p", "no:cacheprovider", str(installed.source / "tests/test_prefer.py"))
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


def test_the_rule_in_vllms_scheduler(installed: Installed) -> None:
    tests = installed.source / "tests/test_prefer_scheduler.py"
    out = installed.run("-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests))
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


def test_the_walk_through_quotes_the_package_verbatim() -> None:
    """docs/rules.md's "Writing a rule" excerpts: a block opening with ``# <path>`` of a file of
    the example must be a verbatim part of that file, so the walk-through cannot drift from it."""
    text = (REPO / "docs" / "rules.md").read_text()
    quoted = 0
    for body in re.findall(r"^```(?:python|toml)\n(.*?)^```$", text, flags=re.M | re.S):
        first, _, rest = body.partition("\n")
        path = EXAMPLE / first.removeprefix("# ")
        if first.startswith("# ") and path.is_file():
            assert rest in path.read_text(), f"docs/rules.md quotes {first[2:]} inexactly:\n{rest}"
            quoted += 1
    assert quoted >= 5
