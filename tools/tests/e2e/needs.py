"""What the tests that make hosts share: the skip where the kit cannot make them."""

from __future__ import annotations

import pytest

from kvcompose_tools.e2e.hosts import skip_reason


def hosts_or_skip() -> None:
    """Skip the calling test, with the kit's own one-line reason, where hosts cannot be made
    (under ``$KVCOMPOSE_REQUIRE_HOSTS=1``, as in CI, it runs and fails instead)."""
    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)
