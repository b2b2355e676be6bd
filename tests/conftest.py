from __future__ import annotations

import pytest

from kvcompose.plugins import get_plugins


def pytest_configure(config: pytest.Config) -> None:
    import kvcompose.testing.types

    plugins = get_plugins()
    if not plugins.pm.is_registered(kvcompose.testing.types):
        plugins.register(kvcompose.testing.types, name="kvcompose.testing.types")
