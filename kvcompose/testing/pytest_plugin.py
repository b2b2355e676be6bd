"""kvcompose's pytest plugin (entry point ``pytest11: kvcompose``): fixtures of the test kit.

pytest loads this module into every run in an environment where kvcompose is installed, the
real-engine tests included, so it imports nothing heavy (no vLLM, no torch: each fixture imports
what it needs when a test asks for it) and changes nothing for a test that uses none of its
fixtures: the test connector types are registered only for the tests that ask for them.

Fixtures:

``kvcompose_plugins``
    The process-wide plugin manager with the kit's test types (``record``, ``record-pd``,
    ``faulty``) registered for this test.
``kvcompose_scheduler``
    Factory: ``kvcompose_scheduler(yaml_text_or_path, num_blocks=100, ...)`` -> vLLM's
    ``Scheduler`` around the composed connector (``.connector``).
``kvcompose_worker``
    Factory: ``kvcompose_worker(yaml_text_or_path_or_kv_transfer_config, num_layers=2, ...)``
    -> a :class:`kvcompose.testing.worker.WorkerHarness`; shut down after the test.

The nixl plugin adds its own fixtures (``fake_nixl``: :mod:`kvcompose_nixl.testing.pytest_plugin`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from vllm.v1.core.sched.scheduler import Scheduler

    from kvcompose.plugins import Plugins
    from kvcompose.testing.worker import WorkerHarness


@pytest.fixture
def kvcompose_plugins() -> Iterator[Plugins]:
    """The global plugin manager (the one vLLM's composed connector uses) with the test types."""
    from kvcompose.testing.types import registered

    with registered() as plugins:
        yield plugins


@pytest.fixture
def kvcompose_scheduler(kvcompose_plugins: Plugins) -> Callable[..., Scheduler]:
    """Factory for vLLM's real ``Scheduler`` around a composition (YAML text or file)."""
    from kvcompose.testing.harness import scheduler_from_yaml

    def make(source: str | Path, **kw: Any) -> Scheduler:
        return scheduler_from_yaml(source, plugins=kvcompose_plugins, **kw)

    return make


@pytest.fixture
def kvcompose_worker(kvcompose_plugins: Plugins) -> Iterator[Callable[..., WorkerHarness]]:
    """Factory for worker harnesses (composition YAML text or file, or a kv_transfer_config dict)."""
    from kvcompose.testing.worker import WorkerHarness

    made: list[WorkerHarness] = []

    def make(source: str | Path | dict[str, Any], **kw: Any) -> WorkerHarness:
        h = (
            WorkerHarness(source, **kw)
            if isinstance(source, dict)
            else WorkerHarness.from_yaml(source, plugins=kvcompose_plugins, **kw)
        )
        made.append(h)
        return h

    yield make
    for h in made:
        h.shutdown()
