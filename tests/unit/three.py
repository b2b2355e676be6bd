"""The composition most rule tests resolve: three ``record`` children a, b, c (the test kit's
type, registered for every test by tests/conftest.py)."""

from __future__ import annotations

from kvcompose.catalog import Child
from kvcompose.compose import loads

THREE = """
version: 1
connectors:
  - {name: a, type: record}
  - {name: b, type: record}
  - {name: c, type: record}
"""


def three_children() -> tuple[Child, ...]:
    return loads(THREE).children
