"""A third-party plugin that fails to load: every command exits 1 with one line naming the
distribution, the entry point and what to do, never a traceback.

The distribution is a ``.dist-info`` folder beside its module on the subprocess's ``PYTHONPATH``,
found through the ``kvcompose`` entry-point group as an installed one is; this test run's own
plugin manager never sees it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).parents[2] / "examples" / "pd-decode.yaml"


def run(root: Path, *args: str, plugins: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("KVCOMPOSE_PLUGINS", "KVCOMPOSE_TRACE")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH")) if p)
    if plugins is not None:
        env["KVCOMPOSE_PLUGINS"] = plugins
    return subprocess.run(
        [sys.executable, "-m", "kvcompose.cli", *args], cwd=root, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.fixture
def broken(tmp_path: Path) -> Path:
    (tmp_path / "kvcompose_gpu_tier.py").write_text("import kvcompose_gpu_tier_runtime  # not installed\n")
    info = tmp_path / "kvcompose_gpu_tier-0.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvcompose-gpu-tier\nVersion: 0.3\n")
    (info / "entry_points.txt").write_text("[kvcompose]\ngpu-tier = kvcompose_gpu_tier\n")
    return tmp_path


@pytest.mark.parametrize("command", [["plugins"], ["check", str(EXAMPLE)], ["schema"]], ids=lambda c: c[0])
def test_a_plugin_that_fails_to_import_exits_1_naming_its_distribution(broken: Path, command: list[str]) -> None:
    proc = run(broken, *command)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert proc.stderr == (
        "kvcompose: plugin error: plugin 'gpu-tier' (kvcompose_gpu_tier) of the distribution kvcompose-gpu-tier 0.3 "
        "failed to load: ModuleNotFoundError: No module named 'kvcompose_gpu_tier_runtime' (fix or reinstall "
        "kvcompose-gpu-tier, uninstall it, or skip it with KVCOMPOSE_PLUGINS=-gpu-tier)\n"
    )


def test_skipping_it_as_the_error_says_works(broken: Path) -> None:
    proc = run(broken, "check", str(EXAMPLE), plugins="-gpu-tier")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"{EXAMPLE}: ok")
