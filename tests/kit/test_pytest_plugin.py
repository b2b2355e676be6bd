"""The kit's pytest plugin is loaded into every pytest run: it must be cheap and inert."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points

import kvcompose.testing.types as types
from kvcompose.plugins import get_plugins


def test_registered_as_a_pytest11_entry_point() -> None:
    (ep,) = [ep for ep in entry_points(group="pytest11") if ep.name == "kvcompose"]
    assert ep.value == "kvcompose.testing.pytest_plugin"


def test_importing_the_plugin_imports_neither_vllm_nor_torch() -> None:
    code = (
        "import sys, kvcompose.testing.pytest_plugin; "
        "print(sorted(m for m in ('vllm', 'torch', 'nixl', 'kvcompose.plugins') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_test_types_live_only_while_a_test_asks_for_them() -> None:
    # This module's tests run under tests/conftest.py's autouse fixture, so they are registered
    # now; the pytester tests check that a plain test run sees none of them.
    assert get_plugins().pm.is_registered(types)
    assert {"record", "record-pd", "faulty"} <= set(get_plugins().connector_types)
