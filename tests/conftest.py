from __future__ import annotations

import pytest

from kvcompose.plugins import Plugins


@pytest.fixture(autouse=True)
def _test_types(kvcompose_plugins: Plugins) -> None:
    """The project's own tests compose the kit's test types (record, record-pd, faulty) freely."""
