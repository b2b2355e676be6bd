from __future__ import annotations

import pytest

from kvcompose.plugins import Plugins


@pytest.fixture(autouse=True)
def _test_types(kvcompose_plugins: Plugins) -> None:
    """The tools' tests, like the project's own (tests/conftest.py), compose the kit's test types
    (record, record-pd, faulty) freely."""
