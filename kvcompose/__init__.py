"""kvcompose: compose vLLM KV-cache connectors from YAML, under declared rules, through plugins.

Plugins import :data:`hookimpl`, and everything else they need, from :mod:`kvcompose.api`::

    from kvcompose.api import hookimpl

    @hookimpl
    def kvcompose_connector_types():
        return [MyType()]
"""

from __future__ import annotations

import pluggy

__version__ = "0.1.0"

#: The pluggy project name, and the entry-point group third-party plugins register under.
NAME = "kvcompose"

#: Marker to be imported and used in plugins (and for kvcompose's own built-in plugins).
hookimpl = pluggy.HookimplMarker(NAME)

__all__ = ["NAME", "hookimpl", "__version__"]
