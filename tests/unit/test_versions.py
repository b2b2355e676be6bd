"""The supported-versions policy: the declared ranges, the warning outside them, and vLLM's
connector API read from its source (docs/versions.md)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from kvcompose import versions
from kvcompose.cli import main
from kvcompose.versions import NIXL, VLLM, parse_connector_api, release

ROOT = Path(__file__).parents[2]


@pytest.mark.parametrize(
    ("text", "numbers"),
    [("0.32.0", (0, 32, 0)), ("0.33.0+cpu", (0, 33, 0)), ("0.34.0rc1", (0, 34, 0)), ("1.5", (1, 5))],
)
def test_a_version_compares_by_its_release_numbers(text: str, numbers: tuple[int, ...]) -> None:
    assert release(text) == numbers


def test_not_a_version_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="not a version: 'dev'"):
        release("dev")


@pytest.mark.parametrize(
    ("version", "inside"),
    [("0.31.9", False), ("0.32.0", True), ("0.32.0+cpu", True), ("0.33.5", True), ("0.34.0", False), ("1.0", False)],
)
def test_vllm_range_includes_its_lowest_and_excludes_its_bound(version: str, inside: bool) -> None:
    assert VLLM.contains(version) is inside


def test_pyproject_extras_declare_the_ranges_of_the_code() -> None:
    """pyproject.toml's extras and kvcompose.versions say the same, for every build's name."""
    declared: dict[str, str] = {}
    for path in (ROOT / "pyproject.toml", ROOT / "plugins/nixl/pyproject.toml"):
        extras = tomllib.loads(path.read_text())["project"]["optional-dependencies"]
        for requirements in extras.values():
            for req in requirements:
                name, sep, spec = req.partition(">=")
                if sep:
                    declared[name] = ">=" + spec
    for runtime in (VLLM, NIXL):
        for dist in runtime.distributions:
            assert declared.get(dist) == runtime.specifier, (dist, declared.get(dist))


def test_the_installed_runtimes_are_inside_the_ranges() -> None:
    assert versions.version_warnings() == []


def test_version_warns_on_stderr_outside_the_range(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    installed = versions.distribution_version
    monkeypatch.setattr(
        versions,
        "distribution_version",
        lambda name: "0.35.0" if name in VLLM.distributions else installed(name),
    )
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0  # a warning, not a refusal: the composite forwards what it can
    out, err = capsys.readouterr()
    assert "vLLM 0.35.0 (" in out
    assert out.splitlines()[-1] == "supported: vLLM >=0.32.0,<0.34, NIXL >=1.5.0,<1.6 (docs/versions.md)"
    assert "warning: vLLM 0.35.0 (vllm" in err
    assert "is outside the range kvcompose supports (>=0.32.0,<0.34); see docs/versions.md" in err


BASE = """
class KVConnectorBase_V1(ABC):
    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config) -> bool:
        return True

    @property
    def role(self):
        return self._role

    @abstractmethod
    def start_load_kv(self, forward_context, **kwargs) -> None: ...

    def _private(self) -> None: ...
"""


def test_the_connector_api_is_read_from_source_without_importing_it() -> None:
    api = parse_connector_api(BASE)
    assert api.methods == {"start_load_kv"}
    assert api.classmethods == {"supports_sleep_mode"}
    assert api.properties == {"role"}
    assert api.sleep_mode and api.kind("role") == "property"


def test_a_source_without_the_base_class_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="x.py defines no class KVConnectorBase_V1"):
        parse_connector_api("class Other: pass\n", "x.py")
