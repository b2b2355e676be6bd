"""Build a real vLLM scheduler around a composition given as YAML text."""

from __future__ import annotations

from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler

from kvcompose.compose import loads
from kvcompose.testing.harness import make_kv_cache_config, make_scheduler, make_vllm_config
from kvcompose.vllm.args import kv_transfer_config
from kvcompose.vllm.connector import KVComposeConnector


def composed_scheduler(yaml_text: str, *, num_blocks: int = 100, block_size: int = 16,
                       sliding_window: int | None = None, **cfg: Any) -> tuple[Scheduler, KVComposeConnector]:
    plan = loads(yaml_text)
    vllm_config = make_vllm_config(kv_transfer_config(plan), block_size=block_size, **cfg)
    sched = make_scheduler(vllm_config, make_kv_cache_config(num_blocks, block_size=block_size,
                                                              sliding_window=sliding_window))
    assert isinstance(sched.connector, KVComposeConnector)
    return sched, sched.connector


def composed_worker(yaml_text: str, block_size: int = 16) -> KVComposeConnector:
    """The worker-role composed connector (children constructed for the worker role)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    plan = loads(yaml_text)
    vllm_config = make_vllm_config(kv_transfer_config(plan), block_size=block_size)
    return KVComposeConnector(vllm_config, KVConnectorRole.WORKER, make_kv_cache_config(block_size=block_size))
