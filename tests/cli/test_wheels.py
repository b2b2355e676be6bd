"""The four distributions as a user gets them: wheels, installed into a fresh virtual environment,
used from a folder outside the checkout; and a production install, kvcompose and its plugins
without kvcompose-tools, in a second one.

The wheels are built offline from a copy of the sources (``pip wheel --no-deps
--no-build-isolation --no-index``), and installed with ``pip install --no-index`` from that folder
only, so pip resolves the plugins' ``kvcompose`` range and kvcompose's own dependencies for real.
The new environment reuses this one's vLLM, NIXL, torch, pluggy, pytest... without a second
install: a ``.pth`` file adds a folder of links to this environment's ``site-packages``, less
everything kvcompose (its editable finders, its ``.dist-info`` with their entry points), so the
one kvcompose the new environment can import, and the only entry points it sees, are the wheels'.
(``--system-site-packages`` would not do: this environment is itself a venv, and a venv's base
is the system Python.)
"""

from __future__ import annotations

import email.parser
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import kvcompose
from kvcompose.examples import all_examples
from kvcompose.versions import PLUGINS
from tests.kit.test_kit_pytester import PD_CPU_EXAMPLE

REPO = Path(__file__).parents[2]
#: Each distribution's source folder, by the name pip gives it.
SOURCES = {
    "kvcompose": REPO,
    "kvcompose-nixl": REPO / "plugins/nixl",
    "kvcompose-cpu-offload": REPO / "plugins/cpu_offload",
    "kvcompose-tools": REPO / "tools",
}
#: What a production install holds: what vLLM loads and what prepares its arguments, no tools.
PRODUCTION = ("kvcompose", *PLUGINS)
#: What a wheel is built from, in each source folder; the rest of the checkout stays behind.
BUILT_FROM = ("pyproject.toml", "README.md", "kvcompose", "kvcompose_nixl", "kvcompose_cpu_offload", "kvcompose_tools")
#: Names in this environment's site-packages that belong to kvcompose's own installation.
OWN = re.compile(r"(__editable__[._])?kvcompose.*|.*\.pth")


@dataclass(frozen=True)
class Venv:
    root: Path
    site: Path
    work: Path  # the folder every command runs in: outside the checkout and the sources
    env: dict[str, str]

    def run(self, *argv: str, timeout: float = 300, status: int = 0) -> subprocess.CompletedProcess[str]:
        out = subprocess.run(argv, cwd=self.work, env=self.env, capture_output=True, text=True, timeout=timeout)
        said = f"{' '.join(argv)}: rc={out.returncode}\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}"
        assert out.returncode == status, said
        return out

    def kvcompose(self, *args: str) -> str:
        return self.run(str(self.root / "bin" / "kvcompose"), *args).stdout


def _copy_sources(dest: Path) -> dict[str, Path]:
    copies = {}
    for name, source in SOURCES.items():
        copy = dest / name
        copy.mkdir(parents=True)
        for entry in BUILT_FROM:
            if (source / entry).is_dir():
                # Without the editable install's in-place build of the C helper: the wheel builds its own.
                shutil.copytree(source / entry, copy / entry, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
            elif (source / entry).is_file():
                shutil.copyfile(source / entry, copy / entry)
        copies[name] = copy
    return copies


def _shared_site(dest: Path) -> Path:
    """A folder of links to this environment's site-packages, less kvcompose's own entries."""
    dest.mkdir()
    here = Path(sysconfig.get_paths()["purelib"])
    for entry in here.iterdir():
        if not OWN.fullmatch(entry.name):
            (dest / entry.name).symlink_to(entry)
    return dest


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The four distributions' wheels, built offline from a copy of their sources."""
    tmp = tmp_path_factory.mktemp("wheels")
    sources = _copy_sources(tmp / "src")
    dist = tmp / "dist"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    build = subprocess.run(
        [
            *pip,
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-w",
            str(dist),
            *map(str, sources.values()),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    return dist


def _installed(tmp: Path, dist: Path, distributions: tuple[str, ...]) -> Venv:
    """A fresh virtual environment in ``tmp`` with ``distributions`` installed from ``dist`` only."""
    root = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    python = root / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    (site / "kvcompose-test-shared-runtime.pth").write_text(f"{_shared_site(tmp / 'shared-site')}\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env = {k: v for k, v in env.items() if not k.startswith("KVCOMPOSE_")}
    env["PATH"] = os.pathsep.join([str(root / "bin"), env.get("PATH", "")])
    work = tmp / "user"
    work.mkdir()
    v = Venv(root, site, work, env)
    # pip (from the shared folder) installs into the new environment, from the built wheels only.
    v.run(
        str(python),
        "-m",
        "pip",
        "--disable-pip-version-check",
        "install",
        "-q",
        "--no-index",
        "--find-links",
        str(dist),
        *distributions,
    )
    return v


@pytest.fixture(scope="module")
def venv(wheels: Path, tmp_path_factory: pytest.TempPathFactory) -> Venv:
    """All four distributions."""
    return _installed(tmp_path_factory.mktemp("all"), wheels, tuple(SOURCES))


@pytest.fixture(scope="module")
def production(wheels: Path, tmp_path_factory: pytest.TempPathFactory) -> Venv:
    """kvcompose and its two plugins, without kvcompose-tools: what a serving host installs."""
    return _installed(tmp_path_factory.mktemp("production"), wheels, PRODUCTION)


def test_the_wheels_are_what_the_new_environment_imports(venv: Venv) -> None:
    out = venv.run(
        str(venv.root / "bin" / "python"),
        "-c",
        "import json, kvcompose, kvcompose_nixl, kvcompose_cpu_offload, kvcompose_tools, kvcompose.examples as e; "
        "ms = (kvcompose, kvcompose_nixl, kvcompose_cpu_offload, kvcompose_tools, e); "
        "print(json.dumps([m.__file__ for m in ms]))",
    )
    for path in json.loads(out.stdout):
        assert Path(path).is_relative_to(venv.site), path
    for package in ("kvcompose", "kvcompose_nixl", "kvcompose_cpu_offload", "kvcompose_tools"):
        assert (venv.site / package / "py.typed").is_file(), package
    # The cpu-offload wheel carries its compiled streaming copy, built from the C source where a
    # compiler is (optional: without one the wheel installs without it).
    if shutil.which((sysconfig.get_config_var("CC") or "cc").split()[0]) is None:
        return
    helper = venv.run(
        str(venv.root / "bin" / "python"), "-c", "from kvcompose_cpu_offload import _streamcopy as s; print(s.__file__)"
    )
    assert Path(helper.stdout.strip()).is_relative_to(venv.site / "kvcompose_cpu_offload")


@pytest.mark.parametrize("distribution", list(SOURCES))
def test_what_a_package_index_shows(venv: Venv, distribution: str) -> None:
    """The installed metadata: the README as a Markdown long description, classifiers, the SPDX
    licence, the kvcompose range of a plugin, and no invented project URLs."""
    (info,) = venv.site.glob(f"{distribution.replace('-', '_')}-*.dist-info")
    meta = email.parser.Parser().parsestr((info / "METADATA").read_text())
    assert meta["Version"] == _declared_version(distribution)
    assert meta["Description-Content-Type"] == "text/markdown"
    assert meta.get_payload().strip() == (SOURCES[distribution] / "README.md").read_text().strip()
    classifiers = meta.get_all("Classifier") or []
    assert {"Typing :: Typed", "Programming Language :: Python :: 3.11"} <= set(classifiers)
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta["Requires-Python"] == ">=3.11"
    assert not meta.get_all("Project-URL") and not meta["Home-page"]
    declared = tomllib.loads((SOURCES[distribution] / "pyproject.toml").read_text())["project"]["dependencies"]
    assert {str(Requirement(r)) for r in meta.get_all("Requires-Dist") or [] if "extra ==" not in r} == {
        str(Requirement(r)) for r in declared
    }


def test_version_reports_the_installed_wheels(venv: Venv) -> None:
    lines = venv.kvcompose("--version").splitlines()
    versions = {name: _declared_version(name) for name in SOURCES}
    assert lines[:4] == [f"{name} {version}" for name, version in versions.items()]
    assert lines[4].startswith("vLLM 0.") and lines[5].startswith("NIXL ")
    assert "not installed" not in "\n".join(lines)
    print("\n$ kvcompose --version\n" + "\n".join(lines))


def test_plugins_finds_both_types_through_their_entry_points(venv: Venv) -> None:
    out = venv.kvcompose("plugins")
    for name in PLUGINS:
        kind = name.removeprefix("kvcompose-")
        row = next(line for line in out.splitlines() if line.startswith(f"type {kind} "))
        assert f"{name} {_declared_version(name)}" in row, row
    assert "load ranges" in out and "kvcompose (built-in)" in out
    print("\n$ kvcompose plugins\n" + out)


#: The two environments: every distribution, and the production install without the tools.
INSTALLS = ["venv", "production"]


@pytest.mark.parametrize("install", INSTALLS)
def test_packaged_examples_check_and_render_for_vllm(install: str, request: pytest.FixtureRequest) -> None:
    venv: Venv = request.getfixturevalue(install)
    listing = venv.kvcompose("examples")
    assert [line.split()[0] for line in listing.splitlines()] == [e.name for e in all_examples()]
    written = venv.kvcompose("examples", "--write", "compose").split()
    assert written == [f"compose/{e.path.name}" for e in all_examples()]
    for e in all_examples():
        assert (venv.work / "compose" / e.path.name).read_text() == e.text()
        assert venv.kvcompose("examples", e.name) == e.text()
    check = venv.kvcompose("check", "compose/pd-decode.yaml")
    assert check.startswith("compose/pd-decode.yaml: ok, 2 connectors\n")
    assert "host loads the prefix it holds; then pd pulls the rest from the prefill instance" in check
    args = venv.kvcompose("vllm-args", "compose/pd-decode.yaml")
    (venv.work / "kv.json").write_text(args)
    # vLLM, in the new environment, resolves the rendered config to the composite of the wheel.
    resolved = venv.run(
        str(venv.root / "bin" / "python"),
        "-c",
        "import inspect, json, pathlib\n"
        "from vllm.config import KVTransferConfig\n"
        "from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory\n"
        "ktc = KVTransferConfig(**json.loads(pathlib.Path('kv.json').read_text()))\n"
        "cls = KVConnectorFactory.get_connector_class(ktc)\n"
        "print(json.dumps([cls.__module__, cls.__qualname__, inspect.getfile(cls),\n"
        "    ktc.has_connector('NixlConnector'), ktc.has_connector('SimpleCPUOffloadConnector')]))",
    )
    module, name, path, nixl, cpu = json.loads(resolved.stdout.splitlines()[-1])
    assert (module, name, nixl, cpu) == ("kvcompose.vllm.connector", "KVComposeConnector", True, True)
    assert Path(path).is_relative_to(venv.site)
    print(f"\n$ kvcompose check compose/pd-decode.yaml\n{check}\nvLLM resolves vllm-args to {module}.{name} ({path})")


@pytest.mark.parametrize("install", INSTALLS)
def test_the_pytest_plugins_fixtures_in_a_fresh_test_file(install: str, request: pytest.FixtureRequest) -> None:
    venv: Venv = request.getfixturevalue(install)
    tests = venv.work / "kit-user"
    tests.mkdir()
    (tests / "test_my_composition.py").write_text(PD_CPU_EXAMPLE)
    out = venv.run(str(venv.root / "bin" / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests))
    assert re.search(r"^3 passed", out.stdout, flags=re.M), out.stdout
    print("\n$ pytest kit-user\n" + out.stdout[-300:])


def test_the_tools_commands_come_with_their_wheel(venv: Venv) -> None:
    """kvcompose-tools adds its commands through the kvcompose.commands entry points."""
    listed = venv.kvcompose("--help")
    for command in ("demo", "bench", "warmup", "soak"):
        assert re.search(rf"^    {command} ", listed, flags=re.M), listed
    bench = venv.kvcompose("bench", "--help")
    assert "run only this benchmark (repeatable): scheduler, worker, dispatch" in " ".join(bench.split()), bench
    refused = venv.run(str(venv.root / "bin" / "kvcompose"), "bench", "--only", "no-such", "--out", "out", status=2)
    assert refused.stderr.startswith("kvcompose bench: "), refused.stderr
    print("\n$ kvcompose bench --help\n" + bench)


def test_the_production_install_has_no_tools_and_says_where_they_are(production: Venv) -> None:
    """kvcompose and its plugins alone: a tool command names the distribution to install, in one
    line, exit status 2; --version does not list the tools; kvcompose_tools is not importable."""
    for command in ("demo", "bench", "warmup", "soak"):
        out = production.run(str(production.root / "bin" / "kvcompose"), command, "--http", status=2)
        assert out.stdout == "" and "Traceback" not in out.stderr, out.stderr
        assert out.stderr == (
            f"kvcompose {command}: a command of kvcompose-tools, which is not installed (pip install kvcompose-tools)\n"
        )
    lines = production.kvcompose("--version").splitlines()
    assert lines[:3] == [f"{name} {_declared_version(name)}" for name in PRODUCTION]
    assert lines[3].startswith("vLLM 0.") and "kvcompose-tools" not in "\n".join(lines)
    production.run(str(production.root / "bin" / "python"), "-c", "import kvcompose_tools", status=1)
    print(f"\n$ kvcompose demo  # kvcompose and its plugins only\n{out.stderr}")


def test_import_writes_a_composition_that_checks(production: Venv) -> None:
    """``kvcompose import`` of a MultiConnector config, then ``kvcompose check`` of what it wrote."""
    config = {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "connectors": [
                {"kv_connector": "NixlConnector", "kv_role": "kv_both"},
                {"kv_connector": "SimpleCPUOffloadConnector", "kv_role": "kv_both"},
            ]
        },
    }
    (production.work / "kv.json").write_text(json.dumps(config))
    production.kvcompose("import", "kv.json", "-o", "imported.yaml")
    check = production.kvcompose("check", "imported.yaml")
    assert check.startswith("imported.yaml: ok, 2 connectors\n"), check


def test_the_nixl_wheel_brings_its_own_fixtures(venv: Venv) -> None:
    out = venv.run(str(venv.root / "bin" / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider", "--fixtures")
    assert re.search(r"^-+ fixtures defined from kvcompose_nixl\.testing\.pytest_plugin -+$", out.stdout, flags=re.M)
    assert re.search(r"^fake_nixl\b", out.stdout, flags=re.M), out.stdout[-2000:]


def _declared_version(distribution: str) -> str:
    """The version a distribution's pyproject.toml takes, from the one place it is written."""
    project = tomllib.loads((SOURCES[distribution] / "pyproject.toml").read_text())["project"]
    assert project["dynamic"] == ["version"]
    attr = tomllib.loads((SOURCES[distribution] / "pyproject.toml").read_text())["tool"]["setuptools"]["dynamic"]
    module = attr["version"]["attr"].removesuffix(".__version__")
    text = (SOURCES[distribution] / module.replace(".", "/") / "__init__.py").read_text()
    found = re.search(r'^__version__ = "([^"]+)"$', text, flags=re.M)
    assert found is not None
    return found.group(1)


def test_kvcompose_is_the_version_of_this_checkout() -> None:
    assert _declared_version("kvcompose") == kvcompose.__version__


@pytest.mark.parametrize(
    "pyproject",
    [SOURCES[name] / "pyproject.toml" for name in (*PLUGINS, "kvcompose-tools")]
    + [REPO / "examples/prefer-rule/pyproject.toml"],
    ids=lambda p: p.parent.name,
)
def test_plugins_require_a_kvcompose_range_that_holds_this_version(pyproject: Path) -> None:
    requirements = [Requirement(r) for r in tomllib.loads(pyproject.read_text())["project"]["dependencies"]]
    (kv,) = [r for r in requirements if r.name == "kvcompose"]
    assert kv.specifier, f"{pyproject}: kvcompose without a version range"
    assert kv.specifier.contains(kvcompose.__version__), f"{pyproject}: {kv} excludes {kvcompose.__version__}"
    # The next release that may change the contract: 0.x's next minor, else the next major.
    major, minor, *_ = (int(part) for part in kvcompose.__version__.split("."))
    breaking = f"0.{minor + 1}.0" if major == 0 else f"{major + 1}.0.0"
    assert not kv.specifier.contains(breaking), f"{pyproject}: {kv} admits {breaking}"
