"""The engine tests' one single-engine baseline, shared by every module of a session.

Every check of a composition against "what one engine without a connector answers" asks the
same engine: an offline vLLM engine on the seed-0 demo model with no ``--kv-transfer-config``.
Started once (an engine start is 35-50 s of this machine's two cores) and idle between
modules; each module gets it with an empty prefix cache, as a freshly started engine's, so that
which prompts an earlier module asked does not change how much of a prompt it computes.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvcompose_tools.e2e.model import make_model
from kvcompose_tools.e2e.node import EngineNode, wait_all_ready
from kvcompose_tools.e2e.spec import EngineSpec


@pytest.fixture(scope="session")
def session_baseline(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineNode]:
    node = EngineNode(EngineSpec("baseline", str(make_model(0))), tmp_path_factory.mktemp("baseline"))
    try:
        wait_all_ready([node])
        yield node
    finally:
        node.close()


@pytest.fixture(scope="module")
def baseline(session_baseline: EngineNode) -> EngineNode:
    """The session's baseline engine with an empty prefix cache, for this module."""
    assert session_baseline.reset_prefix_cache(), "the baseline engine did not drop its prefix cache"
    return session_baseline
