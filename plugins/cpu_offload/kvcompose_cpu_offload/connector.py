"""The class vLLM loads for a ``cpu-offload`` child.

``KVTransferConfig(kv_connector="SimpleCPUOffloadConnector",
kv_connector_module_path="kvcompose_cpu_offload.connector")`` makes vLLM's factory import this
module and take its ``SimpleCPUOffloadConnector`` attribute (a module path wins over the
registry, even for a built-in name). Keeping the upstream class name keeps the connector
visible to vLLM's ``has_connector("SimpleCPUOffloadConnector")`` checks.

The scheduler side is vLLM's, its metadata marked with whether the step runs a forward pass
(:class:`~kvcompose_cpu_offload.portable_worker.StepMetadata`). The worker side is vLLM's on
CUDA and ROCm; elsewhere (vLLM's CPU platform) it is
:class:`~kvcompose_cpu_offload.portable_worker.PortableSimpleCPUOffloadWorker`, which reports
transfers exactly as vLLM's worker does.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector import (
    SimpleCPUOffloadConnector as VllmSimpleCPUOffloadConnector,
)
from vllm.logger import init_logger
from vllm.platforms import current_platform

from kvcompose_cpu_offload.portable_worker import PortableSimpleCPUOffloadWorker, StepMetadata

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

# A child of vLLM's logger, so these lines appear in engine logs with vLLM's own.
logger = init_logger(f"vllm.{__name__}")

__all__ = ["SimpleCPUOffloadConnector", "has_cuda_copy_engine", "size_from_num_cpu_blocks"]


def has_cuda_copy_engine() -> bool:
    """Whether vLLM's own worker can run here: CUDA streams and the CUDA/HIP driver copy API."""
    return bool(torch.cuda.is_available() and current_platform.is_cuda_alike())


def size_from_num_cpu_blocks(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> VllmConfig:
    """Honour ``num_cpu_blocks`` by turning it into ``cpu_bytes_to_use_per_rank``.

    vLLM sizes the host pool from bytes: the scheduler as
    ``num_gpu_blocks * bytes // kv_cache_tensors[0].size``, the worker as
    ``bytes // sum(region block bytes)``. Giving ``N * (size // num_gpu_blocks)`` bytes makes the
    scheduler count exactly N blocks (at most N with padding) and the worker at least N, so the
    scheduler never hands out a block the worker lacks. vLLM releases that do not read
    ``num_cpu_blocks`` get the same pool as those that do. Returns a shallow copy of
    ``vllm_config`` (the way MultiConnector gives each child its own config); the caller's is
    left alone.
    """
    ktc = vllm_config.kv_transfer_config
    extra: dict[str, Any] = dict(ktc.kv_connector_extra_config or {}) if ktc else {}
    if ktc is None or extra.get("num_cpu_blocks") is None:
        return vllm_config
    num_cpu_blocks = int(extra["num_cpu_blocks"])
    if num_cpu_blocks <= 0:
        raise ValueError(f"num_cpu_blocks must be > 0, got {num_cpu_blocks}")
    if str(extra.get("kv_offload_backend", "cpu")) == "disk":
        logger.warning("num_cpu_blocks sizes the host pool; the disk backend ignores it")
        return vllm_config
    if kv_cache_config is None or not kv_cache_config.kv_cache_tensors or kv_cache_config.num_blocks <= 0:
        return vllm_config  # nothing to size against; vLLM's own checks report this
    bytes_per_block = kv_cache_config.kv_cache_tensors[0].size // kv_cache_config.num_blocks
    per_rank = num_cpu_blocks * bytes_per_block
    for key in ("cpu_bytes_to_use", "cpu_bytes_to_use_per_rank"):
        if key in extra:
            logger.warning("num_cpu_blocks=%d overrides %s", num_cpu_blocks, key)
    extra["cpu_bytes_to_use_per_rank"] = per_rank
    # Keep the server-wide figure consistent too, or vLLM warns that the two disagree.
    extra["cpu_bytes_to_use"] = per_rank * vllm_config.parallel_config.world_size
    new_ktc = copy.copy(ktc)
    new_ktc.kv_connector_extra_config = extra
    new_config = copy.copy(vllm_config)
    new_config.kv_transfer_config = new_ktc
    return new_config


class SimpleCPUOffloadConnector(VllmSimpleCPUOffloadConnector):
    """vLLM's ``SimpleCPUOffloadConnector`` that also runs where CUDA does not.

    Scheduler role: vLLM's ``SimpleCPUOffloadScheduler``, untouched, its metadata marked with
    whether the step runs a forward pass (:meth:`build_connector_meta`). Worker role: vLLM's
    ``SimpleCPUOffloadWorker`` on CUDA/ROCm, else the portable torch-copy worker. Also
    honours ``num_cpu_blocks`` on every vLLM release (see :func:`size_from_num_cpu_blocks`).
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        super().__init__(size_from_num_cpu_blocks(vllm_config, kv_cache_config), role, kv_cache_config)
        #: Requests whose last lookup found blocks: vLLM's manager holds those blocks pinned (the
        #: used-blocks gauge) until the request's allocation, next lookup or end releases them.
        self._pinned: set[str] = set()
        #: Requests this tier loads: their completion counts the loaded blocks.
        self._loading: set[str] = set()
        # vLLM's worker constructor is plain Python (CUDA is first touched in
        # register_kv_caches), so it is safe to build it and then swap in the portable one with
        # the settings vLLM parsed: the extra-config parsing stays vLLM's.
        if self.worker_handler is not None and not has_cuda_copy_engine():
            self.worker_handler = PortableSimpleCPUOffloadWorker.like(self.worker_handler)
            logger.info(
                "SimpleCPUOffloadConnector: no CUDA copy engine on %s, using torch copies",
                current_platform.device_type or "this platform",
            )

    def shutdown(self) -> None:
        """Stop the portable worker's backend (vLLM's own worker has no shutdown)."""
        stop = getattr(self.worker_handler, "shutdown", None)
        if callable(stop):
            stop()
        super().shutdown()

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """vLLM's metadata for the step, as :class:`StepMetadata`: whether the step runs a forward
        pass (the scheduler scheduled a token), which the portable worker reads to copy small
        stores in place in a step that produces no token."""
        meta = super().build_connector_meta(scheduler_output)
        if meta.store_gpu_blocks or meta.load_gpu_blocks or meta.need_flush:
            self._stats_changed = True
        # vLLM's fields as they are, without a dataclass round trip: this runs every engine step.
        step = StepMetadata.__new__(StepMetadata)
        step.__dict__.update(meta.__dict__)
        step.forward = scheduler_output.total_num_scheduled_tokens > 0
        return step

    # -- stats: shipped only when they can have changed ------------------------------------------
    #
    # vLLM's scheduler asks for the connector's stats every step and sends what it gets to the
    # front end with the step's output. vLLM's manager builds them afresh each time (three gauges
    # and its counters), so without this every engine step, the idle steps of a decode waiting
    # for its NIXL pull included, carries the host tier's stats, which the front end then
    # observes. They can only change where the manager's state does: a lookup that pins blocks
    # (or releases an earlier pin), an allocation that takes a pin, a planned transfer, a
    # completion of this tier's load or store, a finished request, a reset. Counters are drained
    # by the next call, so none is lost; a gauge keeps its last value in Prometheus.
    #
    # A lookup that finds nothing changes nothing, nor does another child's finished load: a
    # P/D decode's lookup here misses and its NIXL pull is reported a step later. What the stats
    # cost a step: docs/performance.md 5b (Hook by hook).

    #: Whether a scheduler hook ran since the last stats that can have changed them.
    _stats_changed = True

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        tokens, is_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        rid = request.request_id
        if tokens:
            self._pinned.add(rid)
            self._stats_changed = True
        elif rid in self._pinned:  # this lookup released the last one's pin
            self._pinned.discard(rid)
            self._stats_changed = True
        return tokens, is_async

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        rid = request.request_id
        if rid in self._pinned:  # the allocation takes the lookup's pin (a load), or releases it
            self._pinned.discard(rid)
            if num_external_tokens:
                self._loading.add(rid)
            self._stats_changed = True
        super().update_state_after_alloc(request, blocks, num_external_tokens)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if connector_output.kv_connector_worker_meta is not None:  # stores done
            self._stats_changed = True
        if self._loading and connector_output.finished_recving:
            loaded = self._loading.intersection(connector_output.finished_recving)
            if loaded:
                self._loading -= loaded
                self._stats_changed = True
        super().update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._stats_changed = True
        self._pinned.discard(request.request_id)
        return super().request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._stats_changed = True
        self._pinned.discard(request.request_id)
        return super().request_finished_all_groups(request, block_ids)

    def reset_cache(self) -> bool | None:
        self._stats_changed = True
        return super().reset_cache()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """vLLM's stats, or None when no hook that can change them ran since the last ones."""
        if not self._stats_changed:
            return None
        self._stats_changed = False
        return super().get_kv_connector_stats()
