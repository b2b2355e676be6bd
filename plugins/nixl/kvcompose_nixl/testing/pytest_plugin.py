"""The nixl plugin's pytest plugin (entry point ``pytest11: kvcompose_nixl``): its test fixtures.

Loaded into every pytest run where the plugin is installed, so it imports nothing heavy at import.

``fake_nixl``
    vLLM's NIXL worker talks to a :class:`kvcompose_nixl.testing.fake_nixl.FakeNixlAgent` instead
    of the real agent during this test; the fixture's value controls the fakes, and its
    ``pair()`` gives a handshaken producer and consumer worker (shut down after the test).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from kvcompose_nixl.testing.fake_nixl import FakeNixl


@pytest.fixture
def fake_nixl(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeNixl]:
    """Swap the NIXL agent vLLM's NIXL worker creates for the kit's fake, for this test."""
    from kvcompose_nixl.testing.fake_nixl import FakeNixl

    fake = FakeNixl()
    fake.install(monkeypatch)
    yield fake
    fake.close()
