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
import dataclasses
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
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig

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
        fields = {f.name: getattr(meta, f.name) for f in dataclasses.fields(meta)}
        return StepMetadata(**fields, forward=scheduler_output.total_num_scheduled_tokens > 0)
