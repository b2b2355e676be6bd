"""vLLM's native offloading specs with a worker that runs where vLLM's cannot (its CPU platform).

vLLM's ``OffloadingConnector`` takes its spec from ``kv_connector_extra_config``
(``spec_name`` / ``spec_module_path``, ``vllm/v1/kv_offload/factory.py``). Its CPU spec
(``CPUOffloadingSpec``, ``vllm/v1/kv_offload/cpu/spec.py``) refuses to build a worker on a
platform without CUDA or XPU (``get_worker``), and its worker moves blocks with
``ops.swap_blocks_batch`` on CUDA streams, timed by CUDA events, after asserting that the KV
tensors are on a GPU (``cpu/gpu_worker.py``, ``SingleDirectionOffloadingHandler``). The tiering
spec (``TieringOffloadingSpec``, the ``fs`` tier behind host memory) builds that same worker over a
shared memory region its secondary tiers read.

:class:`PortableCPUOffloadingSpec` and :class:`PortableTieringOffloadingSpec` are those specs
unchanged (manager, eviction policies, secondary tiers, metrics), except ``get_worker``: with a
CUDA copy engine it is vLLM's; elsewhere it is :class:`PortableCPUOffloadingWorker`, which lays
out the host pool as vLLM's worker does (a private tensor, or the tiering spec's shared region),
maps each transfer's blocks to byte ranges as vLLM's handler does (``compute_sub_block_ptrs``,
skipping into a partly matching first chunk) and copies those ranges with host memory copies
(:func:`kvcompose_cpu_offload.block_copy.helper_copy`, the compiled helper the cpu-offload tier
uses). A transfer is done when ``submit_*`` returns: on the CPU platform the forward pass runs
in the same thread, so a load submitted at ``start_load_kv`` is in place before it, and a store,
which vLLM submits a step after the one that computed its blocks, reads finished KV.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from vllm.logger import init_logger
from vllm.utils.math_utils import cdiv
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.gpu_worker import compute_sub_block_ptrs
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from kvcompose_cpu_offload.block_copy import helper_built, helper_copy
from kvcompose_cpu_offload.connector import has_cuda_copy_engine

logger = init_logger(f"vllm.{__name__}")


def copy_ranges(dst: np.ndarray, src: np.ndarray, sizes: np.ndarray) -> None:
    """Copy ``sizes[i]`` bytes from address ``src[i]`` to ``dst[i]`` for every i (uint64 arrays)."""
    if helper_built():
        helper_copy(dst, src, sizes)
        return
    for d, s, n in zip(dst.tolist(), src.tolist(), sizes.tolist(), strict=True):
        ctypes.memmove(d, s, n)


class _Direction:
    """One direction's tensors and vLLM's block-to-bytes mapping (``SingleDirectionOffloadingHandler``
    in ``cpu/gpu_worker.py``, its direct layout): a device block is one page per tensor, a host chunk
    ``blocks_per_chunk`` pages, and a group's first device block may start inside a chunk."""

    def __init__(
        self,
        device: list[torch.Tensor],
        host: list[torch.Tensor],
        blocks_per_chunk: int,
        refs: list[list[CanonicalKVCacheRef]],
        to_host: bool,
    ) -> None:
        self.src, self.dst = (device, host) if to_host else (host, device)
        self.to_host = to_host
        self.refs = refs
        self.src_per_chunk = 1 if to_host else blocks_per_chunk
        self.dst_per_chunk = blocks_per_chunk if to_host else 1

    def copy(self, src_spec: LoadStoreSpec, dst_spec: LoadStoreSpec) -> int:
        """Copy one transfer's bytes; returns how many."""
        assert isinstance(src_spec, BlockIDsLoadStoreSpec) and isinstance(dst_spec, BlockIDsLoadStoreSpec)
        device_spec = src_spec if self.to_host else dst_spec
        assert isinstance(device_spec, GPULoadStoreSpec)
        src_blocks, dst_blocks = src_spec.block_ids, dst_spec.block_ids
        srcs: list[np.ndarray] = []
        dsts: list[np.ndarray] = []
        sizes: list[np.ndarray] = []
        src_at = dst_at = 0
        for group, (count, index) in enumerate(zip(device_spec.group_sizes, device_spec.block_indices, strict=True)):
            if count == 0:
                continue
            src_skip, dst_skip = index % self.src_per_chunk, index % self.dst_per_chunk
            src_n = cdiv(count + src_skip, self.src_per_chunk)
            dst_n = cdiv(count + dst_skip, self.dst_per_chunk)
            for ref in self.refs[group]:
                s, d = np.empty(count, np.uint64), np.empty(count, np.uint64)
                compute_sub_block_ptrs(
                    src_blocks[src_at : src_at + src_n], self.src_per_chunk, s, self.src[ref.tensor_idx], src_skip
                )
                compute_sub_block_ptrs(
                    dst_blocks[dst_at : dst_at + dst_n], self.dst_per_chunk, d, self.dst[ref.tensor_idx], dst_skip
                )
                srcs.append(s)
                dsts.append(d)
                sizes.append(np.full(count, ref.page_size_bytes, np.uint64))
            src_at, dst_at = src_at + src_n, dst_at + dst_n
        if src_at != len(src_blocks) or dst_at != len(dst_blocks):
            raise ValueError(f"transfer of {len(src_blocks)} -> {len(dst_blocks)} blocks does not match its groups")
        if not sizes:
            return 0
        all_sizes = np.concatenate(sizes)
        copy_ranges(np.concatenate(dsts), np.concatenate(srcs), all_sizes)
        return int(all_sizes.sum())


class PortableCPUOffloadingWorker(OffloadingWorker):
    """vLLM's ``OffloadingWorker`` for the host tier, with host memory copies: the same
    constructor as vLLM's ``CPUOffloadingWorker`` and the same reports (``TransferResult`` per
    job, in submission order)."""

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        blocks_per_chunk: int,
        num_cpu_chunks: int,
        mmap_region: SharedOffloadRegion | None = None,
        canonical_layout: bool = False,
    ) -> None:
        if canonical_layout:
            raise ValueError("canonical_layout is vLLM's CUDA worker's only; remove it from kv_connector_extra_config")
        self._mmap_region = mmap_region
        device: list[torch.Tensor] = []
        host: list[torch.Tensor] = []
        for t in kv_caches.tensors:
            device.append(t.tensor.view(torch.int8).view((-1, t.page_size_bytes)))
            page = t.page_size_bytes * blocks_per_chunk
            if mmap_region is not None:
                host.append(mmap_region.create_next_worker_view(page))
            else:
                host.append(torch.zeros((num_cpu_chunks, page), dtype=torch.int8))
        refs = kv_caches.group_data_refs
        self._store = _Direction(device, host, blocks_per_chunk, refs, to_host=True)
        self._load = _Direction(device, host, blocks_per_chunk, refs, to_host=False)
        self._done: list[TransferResult] = []
        logger.info("portable offloading worker: %d host tensors, %d chunks", len(host), num_cpu_chunks)

    def _run(self, direction: _Direction, job_id: int, src: LoadStoreSpec, dst: LoadStoreSpec) -> bool:
        t0 = time.perf_counter()
        try:
            moved = direction.copy(src, dst)
        except Exception:  # reported as vLLM reports a failed transfer; the engine goes on
            logger.exception("offloading job %d failed", job_id)
            self._done.append(TransferResult(job_id=job_id, success=False))
            return True
        self._done.append(TransferResult(job_id, True, moved, time.perf_counter() - t0))
        return True

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        return self._run(self._store, job_id, src_spec, dst_spec)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        return self._run(self._load, job_id, src_spec, dst_spec)

    def get_finished(self) -> list[TransferResult]:
        done, self._done = self._done, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        """Nothing to wait for: a job is copied when it is submitted."""

    def shutdown(self) -> None:
        if self._mmap_region is not None:
            self._mmap_region.cleanup()
            self._mmap_region = None


def _portable(spec: Any, kv_caches: CanonicalKVCaches, mmap_region: SharedOffloadRegion | None) -> OffloadingWorker:
    try:
        return PortableCPUOffloadingWorker(
            kv_caches,
            spec.blocks_per_chunk,
            spec.num_chunks,
            mmap_region,
            bool(getattr(spec.config, "canonical_layout", False)),
        )
    except Exception:
        if mmap_region is not None:
            mmap_region.cleanup()
        raise


class PortableCPUOffloadingSpec(CPUOffloadingSpec):
    """vLLM's ``CPUOffloadingSpec``; off CUDA its worker is :class:`PortableCPUOffloadingWorker`."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if has_cuda_copy_engine():
            return super().get_worker(kv_caches)
        if self._worker is None:
            self._worker = _portable(self, kv_caches, None)  # type: ignore[assignment]
        return self._worker  # type: ignore[return-value]


class PortableTieringOffloadingSpec(TieringOffloadingSpec):
    """vLLM's ``TieringOffloadingSpec`` (host memory, then secondary tiers such as ``fs``); off
    CUDA its worker is :class:`PortableCPUOffloadingWorker` over the shared region the secondary
    tiers read, made as vLLM's ``create_worker`` makes it."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if has_cuda_copy_engine():
            return super().get_worker(kv_caches)
        if self._worker is None:
            rank = 0 if self.replicated_layout else self.config.parallel.rank
            region = SharedOffloadRegion(
                engine_id=self._engine_id,
                num_chunks=self.num_chunks,
                rank=rank,
                kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                cpu_page_size=self.cpu_page_size_per_worker,
            )
            self._worker = _portable(self, kv_caches, region)  # type: ignore[assignment]
        return self._worker  # type: ignore[return-value]


__all__: Sequence[str] = ["PortableCPUOffloadingSpec", "PortableCPUOffloadingWorker", "PortableTieringOffloadingSpec"]
