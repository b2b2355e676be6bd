"""What the tests that make hosts share: the skip where the kit cannot make them."""

from __future__ import annotations

import pytest

from kvcompose_tools.e2e.hosts import unavailable


def hosts_or_skip() -> None:
    """Skip the calling test, with the kit's own one-line reason, where hosts cannot be made."""
    reason = unavailable()
    if reason is not None:
        pytest.skip(reason)
