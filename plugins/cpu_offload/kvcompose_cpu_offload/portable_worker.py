"""A worker for vLLM's SimpleCPUOffload that copies blocks with host memory copies on copy threads.

vLLM's ``SimpleCPUOffloadWorker`` moves blocks with ``cuMemcpyBatchAsync`` on CUDA streams
(``DmaCopyBackend``), pins its pool with ``cudaHostRegister`` and waits on CUDA events, so it
cannot start on a platform without CUDA (on vLLM's CPU platform it fails with
``AttributeError: type object '_StreamPlaceholder' has no attribute 'priority_range'``).

:class:`PortableSimpleCPUOffloadWorker` subclasses it and replaces only those parts:

* the copy backend (:class:`~kvcompose_cpu_offload.host_backend.HostCopyBackend`, or
  :class:`~kvcompose_cpu_offload.disk_backend.PortableDiskBackend` for the disk tier), which
  keeps the ``launch_copy`` contract of vLLM's backends: each transfer appends an
  ``(event_idx, event)`` pair to the worker's event list and runs on a store or load thread
  (:mod:`kvcompose_cpu_offload.copy_threads`, the counterpart of vLLM's CUDA side streams), and
  the event answers ``query()`` and ``synchronize()`` like a ``torch.Event``;
* the host pool allocation (no ``cudaHostRegister``; laid out so a block of every layer is one
  copy, see :func:`~kvcompose_cpu_offload.block_copy.stack_regions`);
* when a store starts: at the next step's ``bind_connector_metadata`` rather than in
  ``wait_for_save``, so that no step waits for a copy thread to wake before its tokens are
  sampled (see :meth:`PortableSimpleCPUOffloadWorker.wait_for_save`), except in a step without
  a forward pass (:class:`StepMetadata`), which starts them at once; the preemption flush and
  shutdown start them first.

:meth:`PortableSimpleCPUOffloadWorker.take_copy_loops` says which copy loops the transfers used
(:func:`~kvcompose_cpu_offload.block_copy.copy_loop`).

Everything else is vLLM's own code, inherited unchanged: how raw ``[num_blocks, block_bytes]``
storage regions are derived from the engine's KV tensors, how the pool is sized, metadata
binding, completion polling (finished loads -> request ids in ``finished_recving``, finished
stores -> ``SimpleCPUOffloadWorkerMetadata`` counts), and the preemption flush. The
scheduler-side manager therefore sees exactly what vLLM's CUDA worker would report.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.logger import init_logger
from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadMetadata
from vllm.v1.simple_kv_offload.worker import SimpleCPUOffloadWorker

from kvcompose_cpu_offload.block_copy import stack_regions
from kvcompose_cpu_offload.disk_backend import PortableDiskBackend
from kvcompose_cpu_offload.host_backend import HostCopyBackend

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

# A child of vLLM's logger, so these lines appear in engine logs with vLLM's own.
logger = init_logger(f"vllm.{__name__}")


@dataclass
class StepMetadata(SimpleCPUOffloadMetadata):
    """vLLM's ``SimpleCPUOffloadMetadata`` and whether its engine step runs a forward pass.

    The plugin's connector builds it in the scheduler role
    (:meth:`~kvcompose_cpu_offload.connector.SimpleCPUOffloadConnector.build_connector_meta`).
    A step without a forward pass (vLLM's ``kv_connector_no_forward``: the scheduler scheduled
    no token, and steps on for pending transfers) produces no token, so the worker copies that
    step's small stores in place rather than on the store thread
    (:meth:`HostCopyBackend.copies_in_place`). vLLM's own metadata counts as a step with one.
    """

    forward: bool = True


def runs_forward(metadata: SimpleCPUOffloadMetadata | None) -> bool:
    """Whether the step of ``metadata`` runs a forward pass (:class:`StepMetadata`; vLLM's own
    metadata, or none, counts as one)."""
    return not isinstance(metadata, StepMetadata) or metadata.forward


class _HostStream:
    """Stands in for ``torch.cuda.Stream`` while vLLM's ``register_kv_caches`` runs.

    That method derives the storage regions and sizes the pool (the logic worth reusing), then
    creates two low-priority CUDA streams that only the CUDA backends use. No copy here runs on
    a stream, so a stream that does nothing is all it needs.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.device = torch.device("cpu")

    @staticmethod
    def priority_range() -> tuple[int, int]:
        return (0, 0)


_stream_swap_lock = threading.Lock()


@contextlib.contextmanager
def _host_streams() -> Iterator[None]:
    # vLLM's CPU model runner swaps torch.cuda.Stream the same way around its own CUDA-minded
    # set-up (cpu_model_runner._torch_cuda_wrapper); the swap is scoped and always undone.
    with _stream_swap_lock:
        saved = torch.cuda.Stream
        torch.cuda.Stream = _HostStream  # type: ignore[misc, assignment]
        try:
            yield
        finally:
            torch.cuda.Stream = saved  # type: ignore[misc]


def _rank_of(device: torch.device) -> int:
    """This worker's rank, for the disk file name (vLLM uses ``device.index``, None on CPU)."""
    if device.index is not None:
        return device.index
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


class PortableSimpleCPUOffloadWorker(SimpleCPUOffloadWorker):
    """vLLM's ``SimpleCPUOffloadWorker`` with torch copies instead of CUDA DMA.

    Drop-in: same constructor, same methods, same reporting. Built by the connector on platforms
    where ``torch.cuda`` is not usable (see :mod:`kvcompose_cpu_offload.connector`).
    """

    @classmethod
    def like(cls, worker: SimpleCPUOffloadWorker) -> PortableSimpleCPUOffloadWorker:
        """A portable worker with the settings vLLM's connector gave ``worker``."""
        return cls(
            worker.vllm_config,
            worker.kv_cache_config,
            worker.cpu_capacity_bytes,
            kv_offload_backend="disk" if worker.disk_mode else "cpu",
            disk_path=worker.disk_path,
            disk_capacity_bytes=worker.disk_capacity_bytes,
            disk_buffer_slots=worker.disk_buffer_slots,
            use_page_cache=worker.use_page_cache,
        )

    def __init__(
        self,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig | None,
        cpu_capacity_bytes: int,
        kv_offload_backend: str = "cpu",
        disk_path: str | None = None,
        disk_capacity_bytes: int = 0,
        disk_buffer_slots: int = 2,
        use_page_cache: bool = False,
    ) -> None:
        super().__init__(
            vllm_config,
            kv_cache_config,
            cpu_capacity_bytes,
            kv_offload_backend=kv_offload_backend,
            disk_path=disk_path,
            disk_capacity_bytes=disk_capacity_bytes,
            disk_buffer_slots=disk_buffer_slots,
            use_page_cache=use_page_cache,
        )
        self._backend: HostCopyBackend | PortableDiskBackend | None = None  # type: ignore[assignment]
        #: Stores issued by the last step's ``wait_for_save``, handed to the store thread when the
        #: next step starts: (device blocks, pool blocks, event index).
        self._stores_to_start: list[tuple[list[int], list[int], int]] = []

    def take_copy_loops(self) -> set[str]:
        """The copy loops (:func:`~kvcompose_cpu_offload.block_copy.copy_loop`'s names) this
        worker's transfers used since the last call: what a benchmark records beside its timings."""
        return set() if self._backend is None else self._backend.take_copy_loops()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """vLLM's region derivation and sizing, then our pool and backend (``_init_*_mode``)."""
        with _host_streams():
            super().register_kv_caches(kv_caches)

    def _init_cpu_mode(
        self,
        unique_gpu_caches: dict[str, torch.Tensor],
        total_bytes_per_block: int,
        device: torch.device,
    ) -> None:
        # As vLLM's, minus cudaHostRegister: the pool is ordinary (unpinned) host memory. Regions
        # the device side stacks (evenly spaced layers, see stack_regions) share one pool tensor
        # laid out [layer, block, bytes] as the engine's are, so both sides stack the same way (a
        # block of every layer is one numpy assignment) and a run of consecutive blocks is one
        # contiguous piece per layer on both sides (one streamed copy each, see pieces).
        names = list(unique_gpu_caches)
        self.cpu_kv_caches = {}
        for first, view in stack_regions([unique_gpu_caches[n] for n in names]):
            pool = torch.zeros((view.shape[1], self.num_cpu_blocks, *view.shape[2:]), dtype=view.dtype, device="cpu")
            for j in range(view.shape[1]):
                self.cpu_kv_caches[names[first + j]] = pool[j]
        logger.info(
            "PortableSimpleCPUOffloadWorker [CPU]: %d regions, %d host blocks (%.2f GB)",
            len(unique_gpu_caches),
            self.num_cpu_blocks,
            self.num_cpu_blocks * total_bytes_per_block / 2**30,
        )
        backend = HostCopyBackend()
        backend.init(unique_gpu_caches, self.cpu_kv_caches)
        self._backend = backend

    def _init_disk_mode(
        self,
        unique_gpu_caches: dict[str, torch.Tensor],
        total_bytes_per_block: int,
        device: torch.device,
    ) -> None:
        # Same slot count and per-rank file name scheme as vLLM's _init_disk_mode.
        num_disk_slots = max(1, self.disk_capacity_bytes // total_bytes_per_block)
        self.num_cpu_blocks = num_disk_slots
        if self.disk_path is None:
            raise ValueError('kv_offload_backend="disk" requires disk_path to be set.')
        rank_path = f"{self.disk_path}.rank_{_rank_of(device)}"
        backend = PortableDiskBackend()
        backend.init(
            unique_gpu_caches,
            rank_path,
            num_disk_slots,
            total_bytes_per_block,
            num_buffer_slots=self.disk_buffer_slots,
            use_page_cache=self.use_page_cache,
        )
        self._backend = backend

    def bind_connector_metadata(self, metadata: SimpleCPUOffloadMetadata) -> None:
        """Start the previous step's stores (see :meth:`wait_for_save`), then take this step's
        metadata as vLLM's worker does."""
        self._start_stores(runs_forward(metadata))
        super().bind_connector_metadata(metadata)

    def wait_for_save(self) -> None:
        """Take this step's stores and return: they start when the next step does.

        vLLM's CUDA worker queues them here on a side stream, after a compute-done event. The
        CPU platform has no side stream: a copy thread woken here takes a core in the middle of
        the step, before its tokens are sampled (docs/performance.md 5d).
        So, like vLLM's ``OffloadingConnector`` ("defer the store to the beginning of the next
        engine step ... avoiding delays to token generation"), the hand-off waits for the next
        step's ``bind_connector_metadata``. The scheduler keeps stepping while a store is pending
        (``has_pending_push_work``) and keeps the blocks it reads and writes referenced until
        ``get_finished`` reports it done, so a deferred store neither stalls nor races.

        A step without a forward pass (:class:`StepMetadata`) produces no token: its stores start
        now, and small ones are copied in place (:meth:`HostCopyBackend.copies_in_place`), so
        that they are reported in this step instead of keeping the engine stepping.
        """
        metadata = self._connector_metadata
        if metadata is not None and metadata.store_gpu_blocks:
            if self._backend is None:
                raise RuntimeError("stores requested before register_kv_caches")
            # launch_copy copies the lists when it queues them; until then they are this step's.
            self._stores_to_start.append((metadata.store_gpu_blocks, metadata.store_cpu_blocks, metadata.store_event))
        if not runs_forward(metadata):
            self._start_stores(step_has_forward=False)

    def _start_stores(self, step_has_forward: bool = True) -> None:
        if not self._stores_to_start:
            return
        assert self._backend is not None
        for gpu_blocks, cpu_blocks, event_idx in self._stores_to_start:
            self._backend.launch_copy(
                gpu_blocks,
                cpu_blocks,
                is_store=True,
                event_idx=event_idx,
                events_list=self._store_events,
                step_has_forward=step_has_forward,
            )
        self._stores_to_start.clear()

    def handle_preemptions(self, kv_connector_metadata: SimpleCPUOffloadMetadata) -> None:
        """When the step flushes (a preemption): start the stores not yet started, then vLLM's
        flush, so every copy in flight ends before a preempted request's blocks are reused.

        vLLM's model runner calls this every step, before ``bind_connector_metadata``. Without a
        flush the stores are left to the bind, which knows whether the step runs a forward pass:
        started here, a step without one would hand them to the store thread instead of copying
        them in place, and the engine would step on until the thread reported them.
        """
        if kv_connector_metadata.need_flush:
            self._start_stores(runs_forward(kv_connector_metadata))
        super().handle_preemptions(kv_connector_metadata)

    def shutdown(self) -> None:
        """Stop the backend: stores not yet started start, and every copy in flight finishes
        first (the disk tier also removes its file)."""
        if self._backend is not None:
            self._start_stores()
            self._backend.shutdown()
