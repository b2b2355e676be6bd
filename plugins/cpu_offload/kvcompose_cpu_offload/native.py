"""vLLM's native offloading specs, with a worker that copies with host memory copies off CUDA/XPU.

vLLM's ``OffloadingConnector`` picks its offloading spec through its own extension point
(``kv_connector_extra_config``: ``spec_name`` + ``spec_module_path``,
``vllm/v1/kv_offload/factory.py`` ``OffloadingSpecFactory.get_spec_cls``). The specs here are
vLLM's (:class:`PortableCPUOffloadingSpec` is a ``CPUOffloadingSpec``,
:class:`PortableTieringOffloadingSpec` a ``TieringOffloadingSpec``): the scheduler side, the
manager, the eviction policies and the secondary tiers are vLLM's, unchanged. Only the worker
differs, and only where vLLM's cannot run:

* on CUDA and XPU ``get_worker`` is vLLM's own;
* elsewhere (vLLM's CPU platform) it is :class:`PortableCPUOffloadingWorker`: vLLM's
  ``CPUOffloadingWorker`` whose two ``SingleDirectionOffloadingHandler``\\ s are
  :class:`PortableOffloadingHandler`. vLLM's handler code plans every transfer as it does on
  CUDA (``transfer_async``: per-group block/chunk/skip mapping, ``_fill_direct_ops`` /
  ``_fill_canonical_ops`` filling uint64 pointer descriptors) and reports it
  (``get_finished``: ``TransferResult(job_id, True, bytes, seconds)``), inherited unchanged.
  What it gets from CUDA is replaced: the stream is a :class:`HostStream` (one copy thread per
  direction, FIFO like vLLM's chained streams), the events are :class:`HostEvent`\\ s, and
  ``swap_blocks_batch`` is the plugin's compiled ``copy_pieces`` over the same descriptors.

See docs/native-offload.md for what differs and why.
"""

from __future__ import annotations

import contextlib
import ctypes
import inspect
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from typing_extensions import override
from vllm.logger import init_logger
from vllm.platforms import current_platform
from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingManager, OffloadingWorker
from vllm.v1.kv_offload.cpu.gpu_worker import (
    CPUOffloadingWorker,
    SingleDirectionOffloadingHandler,
    _build_copy_plan,
    _canonical_block_sizes,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from kvcompose_cpu_offload import block_copy
from kvcompose_cpu_offload.copy_threads import ThreadEvent

# A child of vLLM's logger, so these lines appear in engine logs with vLLM's own.
logger = init_logger(f"vllm.{__name__}")


def vllm_worker_runs_here() -> bool:
    """Whether vLLM's own ``CPUOffloadingWorker`` runs on this platform (CUDA-alike or XPU;
    ``CPUOffloadingSpec.get_worker`` raises elsewhere)."""
    return bool(current_platform.is_cuda_alike() or current_platform.is_xpu())


def host_copy(src: torch.Tensor, dst: torch.Tensor, sizes: torch.Tensor, loop: str) -> str:
    """Copy ``sizes[i]`` bytes from address ``src[i]`` to ``dst[i]`` for each ``i``: what
    ``ops.swap_blocks_batch`` does on CUDA, on host memory, with the compiled helper's ``loop``
    (:func:`~kvcompose_cpu_offload.block_copy.copy_loop`). Returns the loop that copied."""
    n = sizes.numel()
    if n == 0:
        return "none"
    s, d, z = src.numpy(), dst.numpy(), sizes.numpy()
    if block_copy.helper_built():
        return block_copy.helper_copy(d, s, z, loop)
    for i in range(n):  # pragma: no cover - a build without a compiler
        ctypes.memmove(int(d[i]), int(s[i]), int(z[i]))
    return "memmove"


class HostEvent(ThreadEvent):
    """Stands in for a ``torch.Event(enable_timing=True)``: recorded on a :class:`HostStream`,
    complete (with a timestamp) once its copy thread reaches it; a copy error queued before it
    on that stream is raised by ``query``/``synchronize`` (like a CUDA error)."""

    __slots__ = ("_t",)

    def __init__(self) -> None:
        super().__init__("native offload transfer")
        self._t = 0.0

    def record(self, stream: HostStream | None = None) -> None:
        if stream is None:
            stream = current_platform.current_stream()
        assert isinstance(stream, HostStream), stream
        self._done.clear()
        self._error = None
        stream.put(("record", self))

    def stamp(self, error: BaseException | None) -> None:
        self._t = time.perf_counter()
        self.set_done(error)

    def elapsed_time(self, end: HostEvent) -> float:
        """Milliseconds from this event to ``end`` (as ``torch.Event.elapsed_time``)."""
        return (end._t - self._t) * 1e3


class HostStream:
    """Stands in for a CUDA stream: work queued on it runs in order on its lane's copy thread.

    ``wait_stream`` (vLLM: wait for the compute stream) has nothing to wait for: on vLLM's CPU
    platform the forward pass that wrote the KV, and the zeroing of newly allocated blocks, ran
    on the engine's thread before the connector submits a transfer (``start_load_kv`` runs after
    ``_update_states``; stores are deferred to the next step's ``start_load_kv``).
    """

    def __init__(self, lane: _CopyLane) -> None:
        self._lane = lane

    def put(self, op: tuple[str, Any]) -> None:
        self._lane.put(op)

    def wait_stream(self, stream: object) -> None:
        return

    def wait_event(self, event: HostEvent) -> None:
        self.put(("wait", event))


class _CopyLane:
    """One copy thread and its FIFO: every transfer of one direction, in submission order."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[tuple[str, Any] | None] = queue.SimpleQueue()
        self._error: BaseException | None = None
        self.loops: set[str] = set()
        #: The compiled helper's copy loop for this lane's copies, read once.
        self.loop = block_copy.copy_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, op: tuple[str, Any]) -> None:
        self._queue.put(op)

    def _run(self) -> None:
        while True:
            op = self._queue.get()
            if op is None:
                return
            kind, arg = op
            if kind == "copy":
                try:
                    self.loops.add(host_copy(*arg, self.loop))
                except BaseException as exc:  # reported by the transfer's end event
                    self._error = exc
            elif kind == "wait":
                try:
                    arg.synchronize()
                except BaseException as exc:
                    self._error = exc
            else:  # record
                error, self._error = self._error, None
                arg.stamp(error)

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=60)


class PortableOffloadingHandler(SingleDirectionOffloadingHandler):
    """vLLM's ``SingleDirectionOffloadingHandler`` on host memory.

    ``transfer_async``, ``get_finished``, ``wait`` and the descriptor fill are vLLM's. Its
    stream and events come from the handler's pools when they hold one (vLLM's reuse path,
    ``gpu_worker.py`` ``transfer_async``), so the pools are topped up with :class:`HostStream`
    and :class:`HostEvent` objects before each transfer; ``self._swap_blocks_batch`` queues
    the filled descriptors on the current (host) stream.

    ``__init__`` is vLLM's minus one line: vLLM asserts ``gpu_tensor.is_cuda or is_xpu``
    (``gpu_worker.py:302``), which no CPU tensor satisfies, so the same attributes are set
    here (pinned by tests/test_native_offload_pins.py).
    """

    def __init__(
        self,
        gpu_tensors: list[torch.Tensor],
        cpu_tensors: list[torch.Tensor],
        blocks_per_chunk: int,
        layer_refs_per_group: list,
        gpu_to_cpu: bool,
        canonical_layout: bool = False,
        host_memory_is_pinned: bool = False,
    ):
        assert len(gpu_tensors) == len(cpu_tensors)
        assert len(gpu_tensors) > 0
        canonical_bytes_per_block = (
            _canonical_block_sizes(layer_refs_per_group, len(gpu_tensors)) if canonical_layout else None
        )
        for t_idx, (gpu_tensor, cpu_tensor) in enumerate(zip(gpu_tensors, cpu_tensors, strict=True)):
            for t in (gpu_tensor, cpu_tensor):
                assert t.dtype == torch.int8 and t.ndim == 2 and t.device.type == "cpu"
            gpu_page_size, cpu_page_size = gpu_tensor.shape[1], cpu_tensor.shape[1]
            if canonical_bytes_per_block is not None:
                assert cpu_page_size == canonical_bytes_per_block[t_idx] * blocks_per_chunk
            else:
                assert cpu_page_size == gpu_page_size * blocks_per_chunk

        self.src_tensors = gpu_tensors if gpu_to_cpu else cpu_tensors
        self.dst_tensors = cpu_tensors if gpu_to_cpu else gpu_tensors
        self.gpu_to_cpu = gpu_to_cpu
        self.layer_refs_per_group = layer_refs_per_group
        self._swap_blocks_batch = self._queue_copy
        self.src_blocks_per_chunk = 1 if gpu_to_cpu else blocks_per_chunk
        self.dst_blocks_per_chunk = blocks_per_chunk if gpu_to_cpu else 1
        self._canonical_copy_plans = (
            [[_build_copy_plan(ref, gpu_to_cpu) for ref in refs] for refs in layer_refs_per_group]
            if canonical_layout
            else None
        )
        self._fill_group_ops = self._fill_canonical_ops if canonical_layout else self._fill_direct_ops
        num_scratch_blocks = gpu_tensors[0].shape[0] if canonical_layout else 0
        self._scratch_bases_src = np.empty(num_scratch_blocks, dtype=np.uint64)
        self._scratch_bases_dst = np.empty(num_scratch_blocks, dtype=np.uint64)
        self._transfer_events = {}
        self._transfers = deque()
        self._stream_pool = []
        self._event_pool = []
        self._buffer_pool = []
        self._lane = _CopyLane("kv-native-offload-" + ("store" if gpu_to_cpu else "load"))

    def _queue_copy(
        self, src: torch.Tensor, dst: torch.Tensor, sizes: torch.Tensor, is_src_access_order_any: bool = False
    ) -> None:
        stream = current_platform.current_stream()
        assert isinstance(stream, HostStream), stream
        stream.put(("copy", (src, dst, sizes)))

    @override
    def transfer_async(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        if not self._stream_pool:
            self._stream_pool.append(HostStream(self._lane))
        while len(self._event_pool) < 2:
            self._event_pool.append(HostEvent())
        return super().transfer_async(job_id, src_spec, dst_spec)

    def take_copy_loops(self) -> set[str]:
        """The copy loops (``block_copy.copy_loop`` names) transfers used since the last call."""
        loops, self._lane.loops = self._lane.loops, set()
        return loops

    @override
    def shutdown(self) -> None:
        try:
            super().shutdown()
        finally:
            self._lane.stop()


#: Whether vLLM's worker takes ``submit_load(..., expedited=)`` and so keeps a third handler
#: (``_expedited_load_handler``, vLLM 0.33's ``cpu/gpu_worker.py``), which its other methods use.
_EXPEDITED_LOADS = "expedited" in inspect.signature(CPUOffloadingWorker.submit_load).parameters


class PortableCPUOffloadingWorker(CPUOffloadingWorker):
    """vLLM's ``CPUOffloadingWorker`` with :class:`PortableOffloadingHandler`\\ s.

    ``submit_store``/``submit_load``/``get_finished``/``wait``/``shutdown`` are vLLM's.
    ``__init__`` is vLLM's without CUDA pinning (``cudaHostRegister``; vLLM's ``PIN_MEMORY`` is
    false on its CPU platform anyway): host tensors from the shared region when one is given
    (the tiering spec's, which its secondary tiers read), else ``torch.zeros``.
    """

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        blocks_per_chunk: int,
        num_cpu_chunks: int,
        mmap_region: SharedOffloadRegion | None = None,
        canonical_layout: bool = False,
    ):
        assert not canonical_layout or mmap_region is not None
        self._mmap_region = mmap_region
        canonical_bytes_per_block = (
            _canonical_block_sizes(kv_caches.group_data_refs, len(kv_caches.tensors)) if canonical_layout else None
        )
        gpu_tensors: list[torch.Tensor] = []
        cpu_tensors: list[torch.Tensor] = []
        for t_idx, kv_cache_tensor in enumerate(kv_caches.tensors):
            page = kv_cache_tensor.page_size_bytes
            gpu_tensors.append(kv_cache_tensor.tensor.view(torch.int8).view((-1, page)))
            if canonical_bytes_per_block is not None:
                assert mmap_region is not None
                cpu = mmap_region.create_next_canonical_view(canonical_bytes_per_block[t_idx] * blocks_per_chunk)
            elif mmap_region is not None:
                cpu = mmap_region.create_next_worker_view(page * blocks_per_chunk)
            else:
                cpu = torch.zeros((num_cpu_chunks, page * blocks_per_chunk), dtype=torch.int8)
            cpu_tensors.append(cpu)
        common: dict[str, Any] = {
            "gpu_tensors": gpu_tensors,
            "cpu_tensors": cpu_tensors,
            "blocks_per_chunk": blocks_per_chunk,
            "layer_refs_per_group": kv_caches.group_data_refs,
            "canonical_layout": canonical_layout,
        }
        self._store_handler = PortableOffloadingHandler(gpu_to_cpu=True, **common)
        self._load_handler = PortableOffloadingHandler(gpu_to_cpu=False, **common)
        if _EXPEDITED_LOADS:  # vLLM 0.33: expedited loads have a handler (a stream) of their own
            self._expedited_load_handler = PortableOffloadingHandler(gpu_to_cpu=False, **common)
        logger.info(
            "native offload: portable worker (host memory copies, %s), %d tensors, %d chunks of %d blocks",
            block_copy.copy_loop(),
            len(cpu_tensors),
            num_cpu_chunks,
            blocks_per_chunk,
        )

    def take_copy_loops(self) -> set[str]:
        """The copy loops the transfers used since the last call (both directions)."""
        assert isinstance(self._store_handler, PortableOffloadingHandler)
        assert isinstance(self._load_handler, PortableOffloadingHandler)
        return self._store_handler.take_copy_loops() | self._load_handler.take_copy_loops()


class PortableCPUOffloadingSpec(CPUOffloadingSpec):
    """vLLM's ``CPUOffloadingSpec``; off CUDA/XPU its worker is :class:`PortableCPUOffloadingWorker`.

    Config: ``spec_name: PortableCPUOffloadingSpec``, ``spec_module_path:
    kvcompose_cpu_offload.native``, and vLLM's keys (``cpu_bytes_to_use``, ...).
    """

    @override
    def create_worker(self, kv_caches: CanonicalKVCaches) -> CPUOffloadingWorker:
        if vllm_worker_runs_here():
            return super().create_worker(kv_caches)
        # vLLM's create_worker without the shared region (it maps one on CUDA/XPU only).
        return PortableCPUOffloadingWorker(
            kv_caches=kv_caches, blocks_per_chunk=self.blocks_per_chunk, num_cpu_chunks=self.num_chunks
        )

    @override
    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        # vLLM's (cpu/spec.py:197) refuses CUDA-less platforms before it makes the worker once;
        # PortableTieringOffloadingSpec inherits this one, with its own create_worker.
        if vllm_worker_runs_here():
            return super().get_worker(kv_caches)
        if not self._worker:
            self._worker = self.create_worker(kv_caches)
        return self._worker


class PortableTieringOffloadingSpec(TieringOffloadingSpec, PortableCPUOffloadingSpec):
    """vLLM's ``TieringOffloadingSpec`` (CPU primary tier + secondary tiers such as ``fs``); off
    CUDA/XPU its worker is :class:`PortableCPUOffloadingWorker` on vLLM's shared region.

    Config: ``spec_name: PortableTieringOffloadingSpec``, ``spec_module_path:
    kvcompose_cpu_offload.native``, ``cpu_bytes_to_use``, ``secondary_tiers: [{type: fs,
    root_dir: ...}]``.
    """

    @override
    def get_manager(self) -> OffloadingManager:
        """vLLM's manager; then the shared region's file in ``/dev/shm`` is unlinked once the
        scheduler has joined it.

        vLLM's tiering spec maps the region by name from every worker and the scheduler with no
        barrier, so only its creator (a worker) removes the name, at a cleanup that a killed or
        hastily stopped engine never runs: each such engine left ``cpu_bytes`` of host memory
        in ``/dev/shm`` (20 GiB of them filled this machine after 19 benchmark runs). The engine
        core initialises every worker's KV caches, which maps the region, before it builds the
        scheduler: a scheduler that joined an existing file is the last to map it, and the name
        can go (the mappings stay valid; the memory is freed when the last process exits). A
        scheduler that created the file (no worker mapped it yet) leaves it."""
        manager = super().get_manager()
        region = getattr(self, "_scheduler_mmap", None)  # vLLM's (tiering/spec.py), private
        if region is not None and getattr(region, "_creator", True) is False:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(region.mmap_path)
        return manager

    @override
    def create_worker(self, kv_caches: CanonicalKVCaches) -> CPUOffloadingWorker:
        if vllm_worker_runs_here():
            return super().create_worker(kv_caches)
        # vLLM's TieringOffloadingSpec.create_worker with the portable worker class.
        rank = 0 if self.replicated_layout else self.config.parallel.rank
        worker_mmap = SharedOffloadRegion(
            engine_id=self._engine_id,
            num_chunks=self.num_chunks,
            rank=rank,
            kv_bytes_per_chunk=self.kv_bytes_per_chunk,
            cpu_page_size=self.cpu_page_size_per_worker,
        )
        try:
            if self.config.canonical_layout:
                self._validate_canonical_refs(kv_caches)
            return PortableCPUOffloadingWorker(
                kv_caches=kv_caches,
                blocks_per_chunk=self.blocks_per_chunk,
                num_cpu_chunks=self.num_chunks,
                mmap_region=worker_mmap,
                canonical_layout=self.config.canonical_layout,
            )
        except Exception:
            worker_mmap.cleanup()
            raise


__all__: Sequence[str] = [
    "PortableCPUOffloadingSpec",
    "PortableCPUOffloadingWorker",
    "PortableOffloadingHandler",
    "PortableTieringOffloadingSpec",
]
