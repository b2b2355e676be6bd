"""Fixtures: vLLM's real ``Scheduler`` on CPU with a NIXL connector as its only connector.

The scheduler role of the NIXL connector creates no NIXL agent (only its worker does), so these
tests need no NIXL hardware, no model weights and no network: the model is a local
``config.json`` from kvcompose's test kit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kvcompose.testing import harness

BLOCK_SIZE = 16

#: Where kvcompose's connector classes live; leaving it out loads vLLM's own classes.
OURS = "kvcompose_nixl.connector"

SchedulerFactory = Callable[..., Any]


@pytest.fixture
def make_nixl_scheduler() -> SchedulerFactory:
    """``make_nixl_scheduler(role, module=OURS, connector="NixlConnector", **extra_config)``."""

    def make(
        role: str,
        *,
        module: str | None = OURS,
        connector: str = "NixlConnector",
        data_parallel_index: int = 0,
        num_blocks: int = 100,
        **extra: Any,
    ) -> Any:
        ktc: dict[str, Any] = {
            "kv_connector": connector,
            "kv_role": role,
            "kv_connector_extra_config": extra,
        }
        if module is not None:
            ktc["kv_connector_module_path"] = module
        cfg = harness.make_vllm_config(ktc, block_size=BLOCK_SIZE)
        # What the engine core sets for a data-parallel rank before it builds the scheduler.
        cfg.parallel_config.data_parallel_index = data_parallel_index
        kv = harness.make_kv_cache_config(num_blocks, block_size=BLOCK_SIZE)
        return harness.make_scheduler(cfg, kv)

    return make
