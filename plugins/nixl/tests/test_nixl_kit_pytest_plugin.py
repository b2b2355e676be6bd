"""The nixl plugin's pytest plugin is loaded into every pytest run: it must be cheap and inert."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points


def test_registered_as_a_pytest11_entry_point() -> None:
    (ep,) = [ep for ep in entry_points(group="pytest11") if ep.name == "kvcompose_nixl"]
    assert ep.value == "kvcompose_nixl.testing.pytest_plugin"


def test_importing_the_plugin_imports_neither_vllm_nor_torch_nor_nixl() -> None:
    code = (
        "import sys, kvcompose_nixl.testing.pytest_plugin; "
        "print(sorted(m for m in ('vllm', 'torch', 'nixl', 'zmq', 'kvcompose.plugins') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
