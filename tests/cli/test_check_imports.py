"""``check``, ``explain`` and ``vllm-args`` import no module a composition names unless asked.

A ``vllm`` child's ``kv_connector_module_path`` is a module on ``sys.path``; importing it runs its
code. Without ``--import-modules`` the commands leave it unimported and say so in one line; with
it, the class is checked and whatever the import raises is a located error (exit 2), never a
traceback. The engine's plan (``composite_of``) still imports: that is where the class is used.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvcompose.cli import main

COMPOSITION = """\
version: 1
connectors:
  - name: mine
    type: vllm
    options:
      kv_connector: MyConnector
      kv_connector_module_path: {module}
"""
#: Where the module path's value starts in COMPOSITION (line 7, after the key).
MODULE_AT = "7:33"
#: A module that leaves a marker file when imported, and holds a vLLM connector class.
MARKER = """\
import pathlib
pathlib.Path({marker!r}).write_text("imported")
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector as MyConnector
"""
#: Modules whose import fails, by what they raise (CUDA-only modules raise RuntimeError or OSError).
FAILING = {
    "RuntimeError": 'raise RuntimeError("Found no NVIDIA driver on your system")',
    "OSError": 'raise OSError(2, "libcudart.so.12: cannot open shared object file")',
    "ValueError": 'raise ValueError("bad\\nsecond line")',
    "ImportError": "import kvcompose_no_such_package",
    "SyntaxError": "def broken(:\n",
    "SystemExit": "import sys\nsys.exit(3)",
}
_names = itertools.count()


@pytest.fixture
def modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory on ``sys.path`` to write modules into (each test names its own)."""
    folder = tmp_path / "mods"
    folder.mkdir()
    monkeypatch.syspath_prepend(str(folder))
    return folder


def module(folder: Path, source: str) -> str:
    """A module of its own name (no test sees another's import), holding ``source``."""
    name = f"kvc_named_module_{next(_names)}"
    (folder / f"{name}.py").write_text(source)
    return name


def composition(tmp_path: Path, module_path: str) -> Path:
    path = tmp_path / "compose.yaml"
    path.write_text(COMPOSITION.format(module=module_path))
    return path


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("command", ["check", "explain", "vllm-args"])
def test_a_named_module_is_not_imported_without_the_flag_and_the_output_says_so(
    command: str, tmp_path: Path, modules: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    marker = tmp_path / "marker"
    name = module(modules, MARKER.format(marker=str(marker)))
    path = composition(tmp_path, name)
    rc, out, err = run(capsys, command, str(path))
    assert rc == 0
    assert not marker.exists()
    said = (err if command == "vllm-args" else out).splitlines()
    [line] = [s for s in said if "not verified" in s]
    assert line == (
        f"{path}: not verified: the class of mine ({name}.MyConnector), not imported: importing a module runs "
        f"its code; `kvcompose {command} --import-modules {path}` imports and checks it"
    )
    if command == "vllm-args":  # the value alone on stdout, for "$(kvcompose vllm-args FILE)"
        assert json.loads(out)["kv_connector_extra_config"]["connectors"][0]["kv_connector_module_path"] == name


@pytest.mark.parametrize("command", ["check", "explain", "vllm-args"])
def test_with_the_flag_the_module_is_imported_and_its_class_checked(
    command: str, tmp_path: Path, modules: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    marker = tmp_path / "marker"
    name = module(modules, MARKER.format(marker=str(marker)))
    path = composition(tmp_path, name)
    rc, out, err = run(capsys, command, "--import-modules", str(path))
    assert rc == 0, err
    assert marker.read_text() == "imported"
    said = err if command == "vllm-args" else out
    assert f"{path}: imported and checked: the class of mine ({name}.MyConnector)" in said
    assert "not verified" not in out + err


def test_with_the_flag_a_missing_class_is_refused(
    tmp_path: Path, modules: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    name = module(modules, "class Other:\n    pass\n")
    rc, _, err = run(capsys, "check", "--import-modules", str(composition(tmp_path, name)))
    assert rc == 2
    assert f"connectors[0].options.kv_connector: {name} has no class 'MyConnector'" in err


@pytest.mark.parametrize("raised", sorted(FAILING))
def test_with_the_flag_any_failure_of_the_import_is_a_located_error(
    raised: str, tmp_path: Path, modules: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    name = module(modules, FAILING[raised])
    path = composition(tmp_path, name)
    assert run(capsys, "check", str(path))[0] == 0  # not imported: nothing to fail
    rc, out, err = run(capsys, "check", "--import-modules", str(path))
    assert rc == 2 and out == ""
    [line] = err.splitlines()  # one line, even for a message of several
    kind = {"ImportError": "ModuleNotFoundError", "OSError": "FileNotFoundError"}.get(raised, raised)
    assert line.startswith(
        f"{path}:{MODULE_AT}: connectors[0].options.kv_connector_module_path: importing {name} failed: {kind}"
    )
    assert line.endswith("(the engine imports it too; install what it needs, or check where vLLM serves)")


@pytest.mark.parametrize("flag", [[], ["--import-modules"]])
@pytest.mark.parametrize("bad", [".foo", "..pkg.mod", "pkg..mod", "pkg."])
def test_a_module_path_vllm_cannot_import_is_refused_with_or_without_the_flag(
    bad: str, flag: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A relative name would make vLLM's ``import_module`` raise TypeError at engine start."""
    path = composition(tmp_path, bad)
    rc, _, err = run(capsys, "check", *flag, str(path))
    assert rc == 2
    assert err.startswith(f"{path}:{MODULE_AT}: connectors[0].options.kv_connector_module_path: {bad!r} is ")
    assert "vLLM imports kv_connector_module_path by its full dotted name" in err


def test_a_registered_name_is_resolved_without_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM's own connectors are resolved through its registry: nothing is left unverified."""
    path = tmp_path / "compose.yaml"
    path.write_text(COMPOSITION.replace("      kv_connector_module_path: {module}\n", "").replace("My", "Example"))
    rc, out, err = run(capsys, "check", str(path))
    assert rc == 0
    assert "verified" not in out + err
    path.write_text(path.read_text().replace("ExampleConnector", "ExampelConnector"))
    assert run(capsys, "check", str(path))[0] == 2


def test_the_engine_still_imports_and_locates_a_failing_import(tmp_path: Path, modules: Path) -> None:
    """``composite_of`` (the composite's, in every engine process) checks with imports on."""
    from vllm.config.kv_transfer import KVTransferConfig

    from kvcompose.compose import load
    from kvcompose.errors import CompositionError
    from kvcompose.vllm.args import kv_transfer_config
    from kvcompose.vllm.children import composite_of

    marker = tmp_path / "marker"
    good = composition(tmp_path, module(modules, MARKER.format(marker=str(marker))))
    plan = composite_of(kv_transfer_config(load(good))["kv_connector_extra_config"]).plan
    assert plan.import_modules and marker.read_text() == "imported"

    failing = composition(tmp_path, module(modules, FAILING["RuntimeError"]))
    config = KVTransferConfig(**kv_transfer_config(load(failing)))
    with pytest.raises(CompositionError, match=r"kv_connector_module_path: importing .* failed: RuntimeError"):
        composite_of(config.kv_connector_extra_config, config.kv_role)


def test_no_traceback_reaches_stderr_from_a_real_process(tmp_path: Path, modules: Path) -> None:
    path = composition(tmp_path, module(modules, FAILING["OSError"]))
    env = {**os.environ, "PYTHONPATH": str(modules)}
    proc = subprocess.run(
        [sys.executable, "-m", "kvcompose.cli", "check", "--import-modules", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert re.search(
        rf"^{re.escape(str(path))}:{MODULE_AT}: .*importing .* failed: FileNotFoundError", proc.stderr, re.M
    )
