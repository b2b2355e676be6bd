"""The NIXL backend names a composition may ask for.

vLLM hands ``kv_connector_extra_config["backends"]`` to ``nixl_agent_config(backends=...)``
unchanged, and NIXL *skips* a name it has no plugin for with only a log warning
("Skipping backend registration ... due to the missing plugin", ``nixl/_api.py``). A typo
therefore starts an engine that cannot transfer. kvcompose rejects unknown names up front.

A backend name is the ``NAME`` of the plugin library ``libplugin_NAME.so`` (NIXL's plugin
manager composes the path from the name, ``src/core/nixl_plugin_manager.cpp``), and it is
case-sensitive: the Mooncake plugin is ``Mooncake``, not ``MOONCAKE``.

The accepted set is the union of the names NIXL's source tree builds and the plugins found on
this machine, found by listing files, without importing NIXL (whose import loads CUDA
libraries and which need not be installed where ``kvcompose check`` runs).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from pathlib import Path

#: Backend plugins built by NIXL's ``src/plugins/*/meson.build`` (library name = backend name).
KNOWN_BACKENDS: frozenset[str] = frozenset(
    {
        "UCX",
        "UCX_MO",
        "LIBFABRIC",
        "UCCL",
        "GPUNETIO",
        "TCPXO",
        "Mooncake",
        "GDS",
        "GDS_MT",
        "POSIX",
        "OBJ",
        "AZURE_BLOB",
        "HF3FS",
        "INFINIA",
        "GUSLI",
    }
)

#: Backends that move data between engines' memories (as opposed to file/object storage
#: plugins). P/D transfer of KV blocks needs one of them.
NETWORK_BACKENDS: frozenset[str] = frozenset({"UCX", "UCX_MO", "LIBFABRIC", "UCCL", "GPUNETIO", "TCPXO", "Mooncake"})

#: The NIXL Python packages whose wheels ship plugin libraries (see ``nixl/__init__.py``).
_NIXL_DISTS = ("nixl_cu13", "nixl_cu12", "nixl_rocm")
_PREFIX, _SUFFIX = "libplugin_", ".so"


def _plugin_dirs() -> list[Path]:
    """Directories that may hold ``libplugin_*.so`` on this machine."""
    dirs: list[Path] = []
    env = os.environ.get("NIXL_PLUGIN_DIR")
    if env:
        dirs.append(Path(env))
    for dist in _NIXL_DISTS:
        try:
            spec = importlib.util.find_spec(dist)  # locates, does not import
        except (ImportError, ValueError):
            continue
        if spec is None or not spec.submodule_search_locations:
            continue
        site = Path(next(iter(spec.submodule_search_locations))).parent
        # Wheels keep the plugins next to the package: auditwheel's `<dist>.libs/nixl/` and
        # meson-python's `.<dist>.mesonpy.libs/plugins/`.
        dirs.append(site / f"{dist}.libs" / "nixl")
        dirs.append(site / f".{dist}.mesonpy.libs" / "plugins")
    return dirs


@functools.cache
def installed_backends() -> frozenset[str]:
    """Backend names of the NIXL plugin libraries present on this machine (maybe none)."""
    names: set[str] = set()
    for d in _plugin_dirs():
        if not d.is_dir():
            continue
        for f in d.glob(f"{_PREFIX}*{_SUFFIX}"):
            names.add(f.name[len(_PREFIX) : -len(_SUFFIX)])
    return frozenset(names)


def backend_names() -> tuple[str, ...]:
    """Every name a composition may list under ``backends``, sorted."""
    return tuple(sorted(KNOWN_BACKENDS | installed_backends()))
