"""A worker for vLLM's SimpleCPUOffload that copies blocks with plain torch ops.

vLLM's ``SimpleCPUOffloadWorker`` moves blocks with ``cuMemcpyBatchAsync`` on CUDA streams
(``DmaCopyBackend``), pins its pool with ``cudaHostRegister`` and waits on CUDA events, so it
cannot start on a platform without CUDA (on vLLM's CPU platform it fails with
``AttributeError: type object '_StreamPlaceholder' has no attribute 'priority_range'``).

:class:`PortableSimpleCPUOffloadWorker` subclasses it and replaces only those parts:

* the copy backend (:class:`TorchCopyBackend`, or :class:`PortableDiskBackend` for the disk
  tier), which keeps the ``launch_copy`` contract of vLLM's backends: each transfer appends an
  ``(event_idx, event)`` pair to the worker's event list, and the event answers ``query()`` and
  ``synchronize()`` like a ``torch.Event``;
* the host pool allocation (no ``cudaHostRegister``);
* ``wait_for_save`` (no compute-done CUDA event to record).

Everything else is vLLM's own code, inherited unchanged: how raw ``[num_blocks, block_bytes]``
storage regions are derived from the engine's KV tensors, how the pool is sized, metadata
binding, completion polling (finished loads -> request ids in ``finished_recving``, finished
stores -> ``SimpleCPUOffloadWorkerMetadata`` counts), and the preemption flush. The
scheduler-side manager therefore sees exactly what vLLM's CUDA worker would report.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from vllm.logger import init_logger
from vllm.v1.simple_kv_offload.disk_backend import _ALIGNMENT, O_DIRECT, DiskBackend, _alloc_aligned
from vllm.v1.simple_kv_offload.worker import SimpleCPUOffloadWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

# A child of vLLM's logger, so these lines appear in engine logs with vLLM's own.
logger = init_logger(f"vllm.{__name__}")

# Below this average run length a per-run slice copy costs more Python calls than it saves in
# memory traffic, so scattered block lists go through one gather and one scatter instead.
_MIN_AVG_RUN = 4


# --------------------------------------------------------------------------- block copies


def contiguous_runs(src_ids: Sequence[int], dst_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """Split paired block lists into ``(src_start, dst_start, length)`` runs of consecutive ids."""
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} source blocks but {len(dst_ids)} destination blocks")
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_ids, dst_ids):
        if runs:
            s0, d0, n = runs[-1]
            if s == s0 + n and d == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((s, d, 1))
    return runs


def copy_blocks(src: torch.Tensor, dst: torch.Tensor, src_ids: Sequence[int], dst_ids: Sequence[int]) -> None:
    """Copy rows ``src[src_ids[i]]`` to ``dst[dst_ids[i]]`` (dim 0 is the block index).

    Runs of consecutive blocks (the usual case: pools hand out neighbouring blocks) become one
    slice copy each, a single pass over memory; scattered lists use ``index_select`` and
    ``index_copy_``. Tensors may be on different devices.
    """
    if not src_ids and not dst_ids:
        return
    runs = contiguous_runs(src_ids, dst_ids)
    if len(runs) * _MIN_AVG_RUN <= len(src_ids) or len(runs) == 1:
        for s, d, n in runs:
            dst[d : d + n].copy_(src[s : s + n])
        return
    s_idx = torch.tensor(list(src_ids), dtype=torch.long, device=src.device)
    d_idx = torch.tensor(list(dst_ids), dtype=torch.long, device=dst.device)
    dst.index_copy_(0, d_idx, src.index_select(0, s_idx).to(dst.device))


class CompletedEvent:
    """A transfer event that completed when it was created (a synchronous copy).

    It answers the two calls vLLM's worker makes on a ``torch.Event``.
    """

    __slots__ = ()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class ThreadEvent:
    """A transfer event completed by an I/O thread; an I/O error is re-raised to the caller.

    Re-raising matters: reporting a failed store as complete would let the scheduler serve a
    block that was never written, and never reporting it would hold its GPU block forever.
    """

    __slots__ = ("_done", "_error", "_what")

    def __init__(self, what: str) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._what = what

    def set_done(self, error: BaseException | None = None) -> None:
        self._error = error
        self._done.set()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"KV offload {self._what} failed: {self._error}") from self._error

    def query(self) -> bool:
        if not self._done.is_set():
            return False
        self._raise_if_failed()
        return True

    def synchronize(self) -> None:
        self._done.wait()
        self._raise_if_failed()


class TorchCopyBackend:
    """Host-memory tier: copies blocks between the engine's KV regions and the pool synchronously.

    Same ``launch_copy`` contract as vLLM's ``DmaCopyBackend``. The copy runs in the caller's
    thread: on the CPU platform the "device" KV cache and the pool are both DRAM, the forward
    pass has finished by the time the worker issues stores, and a copy thread would compete
    with the model for the same cores while making completion timing nondeterministic.
    """

    def __init__(self) -> None:
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def init(self, device_regions: dict[str, torch.Tensor], host_regions: dict[str, torch.Tensor]) -> None:
        """Pair each ``[num_blocks, block_bytes]`` device region with its pool region by name."""
        if device_regions.keys() != host_regions.keys():
            raise ValueError("device and host regions name different tensors")
        self._pairs = [(device_regions[n], host_regions[n]) for n in device_regions]

    def launch_copy(
        self,
        src_blocks: list[int],
        dst_blocks: list[int],
        is_store: bool,
        event_idx: int,
        events_list: list[tuple[int, Any]],
        wait_event: Any = None,
    ) -> None:
        """Copy the blocks (store: device -> pool; load: pool -> device) and record completion."""
        for device, host in self._pairs:
            if is_store:
                copy_blocks(device, host, src_blocks, dst_blocks)
            else:
                copy_blocks(host, device, src_blocks, dst_blocks)
        events_list.append((event_idx, CompletedEvent()))

    def shutdown(self) -> None:
        """Nothing to stop: copies are synchronous."""


class PortableDiskBackend(DiskBackend):
    """Disk tier: the same file format and I/O as vLLM's ``DiskBackend``, without CUDA.

    vLLM stages each block through pinned buffers with a DMA copy; here the KV regions are host
    memory already, so staging is a plain copy into ``O_DIRECT``-aligned buffers (``_alloc_aligned``
    from vLLM), and the ``pwritev``/``preadv`` calls, the file handling and ``shutdown`` are
    vLLM's. Loads and stores each run on their own thread, as in vLLM, so a slow disk never
    stalls a forward pass and loads never queue behind stores. Events are put on the worker's
    list when a transfer is submitted (not when it finishes), so a preemption flush waits for
    every transfer in flight.
    """

    def init(  # type: ignore[override]  # no CUDA streams to pass
        self,
        device_regions: dict[str, torch.Tensor],
        disk_path: str,
        num_disk_slots: int,
        total_block_bytes: int,
        num_buffer_slots: int = 2,
        use_page_cache: bool = False,
    ) -> None:
        """Allocate staging buffers, create the backing file and start the I/O threads."""
        self._total_block_bytes = total_block_bytes
        self._num_buffer_slots = num_buffer_slots
        self._tensor_names = list(device_regions)
        self._regions = [device_regions[n] for n in self._tensor_names]
        self._per_tensor_bpb = [t.stride(0) * t.element_size() for t in self._regions]

        if not use_page_cache:
            # O_DIRECT needs every iovec (one per region and block) aligned, not just the sum.
            bad = [b for b in self._per_tensor_bpb if b % _ALIGNMENT]
            if bad:
                raise ValueError(
                    f"the disk backend writes with O_DIRECT, which needs KV blocks in multiples of "
                    f"{_ALIGNMENT} bytes, but this model's blocks are {self._per_tensor_bpb} bytes "
                    "per region; set the option use_page_cache (vLLM key use_page_cache: true) "
                    "to write through the page cache instead"
                )

        self._store_buffer_caches = {}
        self._load_buffer_caches = {}
        for name, bpb in zip(self._tensor_names, self._per_tensor_bpb):
            self._store_buffer_caches[name] = _alloc_aligned(num_buffer_slots, bpb)
            self._load_buffer_caches[name] = _alloc_aligned(num_buffer_slots, bpb)
        self._store_slot_views = [
            [memoryview(self._store_buffer_caches[n][slot].numpy()) for n in self._tensor_names]
            for slot in range(num_buffer_slots)
        ]
        self._load_slot_views = [
            [memoryview(self._load_buffer_caches[n][slot].numpy()) for n in self._tensor_names]
            for slot in range(num_buffer_slots)
        ]

        # Same file handling as vLLM's DiskBackend.init: blocks encode user prompts, so the
        # file is created fresh (O_EXCL, mode 0600, no symlink following), never reopened.
        os.makedirs(os.path.dirname(disk_path) or ".", exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(disk_path)
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        if not use_page_cache:
            flags |= O_DIRECT
        self._fd = os.open(disk_path, flags, 0o600)
        self._disk_path = disk_path
        os.ftruncate(self._fd, num_disk_slots * total_block_bytes)
        logger.info(
            "PortableDiskBackend: path=%s, slots=%d, %.2f GB, staging %dx%d bytes (page_cache=%s)",
            disk_path,
            num_disk_slots,
            num_disk_slots * total_block_bytes / 2**30,
            num_buffer_slots,
            total_block_bytes,
            use_page_cache,
        )

        self._store_thread = threading.Thread(
            target=self._io_loop,
            args=(self._store_queue, self._do_store),
            name="kv-offload-disk-store",
            daemon=True,
        )
        self._load_thread = threading.Thread(
            target=self._io_loop,
            args=(self._load_queue, self._do_load),
            name="kv-offload-disk-load",
            daemon=True,
        )
        self._store_thread.start()
        self._load_thread.start()

    def launch_copy(
        self,
        src_blocks: list[int],
        dst_blocks: list[int],
        is_store: bool,
        event_idx: int,
        events_list: list[tuple[int, Any]],
        wait_event: Any = None,
    ) -> None:
        """Queue the transfer for the store or load thread and register its event now."""
        if len(src_blocks) != len(dst_blocks):
            raise ValueError(f"{len(src_blocks)} source blocks but {len(dst_blocks)} destinations")
        event = ThreadEvent("disk store" if is_store else "disk load")
        events_list.append((event_idx, event))
        q = self._store_queue if is_store else self._load_queue
        q.put((list(src_blocks), list(dst_blocks), event))

    @staticmethod
    def _io_loop(q: Any, work: Any) -> None:
        while True:
            item = q.get()
            if item is None:  # DiskBackend.shutdown's sentinel
                return
            src_blocks, dst_blocks, event = item
            try:
                work(src_blocks, dst_blocks)
            except BaseException as exc:  # reported through the event, on the engine's thread
                event.set_done(exc)
            else:
                event.set_done()

    def _chunks(self, a: list[int], b: list[int]) -> Iterator[list[tuple[int, int]]]:
        pairs = list(zip(a, b))
        n = self._num_buffer_slots
        for i in range(0, len(pairs), n):
            yield pairs[i : i + n]

    def _do_store(self, device_blocks: list[int], disk_slots: list[int]) -> None:  # type: ignore[override]
        """Device block -> staging slot (copy) -> file (``pwritev``), a batch of slots at a time."""
        store_bufs = [self._store_buffer_caches[n] for n in self._tensor_names]
        for chunk in self._chunks(device_blocks, disk_slots):
            for slot, (blk, _) in enumerate(chunk):
                for region, buf in zip(self._regions, store_bufs):
                    buf[slot].copy_(region[blk])
            for slot, (_, disk_slot) in enumerate(chunk):
                self._writev_slot(slot, disk_slot * self._total_block_bytes)

    def _do_load(self, disk_slots: list[int], device_blocks: list[int]) -> None:  # type: ignore[override]
        """File (``preadv``) -> staging slot -> device block (copy), a batch of slots at a time."""
        load_bufs = [self._load_buffer_caches[n] for n in self._tensor_names]
        for chunk in self._chunks(disk_slots, device_blocks):
            for slot, (disk_slot, _) in enumerate(chunk):
                self._readv_slot(slot, disk_slot * self._total_block_bytes)
            for slot, (_, blk) in enumerate(chunk):
                for region, buf in zip(self._regions, load_bufs):
                    region[blk].copy_(buf[slot])


# --------------------------------------------------------------------------- the worker


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
        self._backend: TorchCopyBackend | PortableDiskBackend | None = None  # type: ignore[assignment]

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
        # As vLLM's, minus cudaHostRegister: the pool is ordinary (unpinned) host memory.
        self.cpu_kv_caches = {
            name: torch.zeros((self.num_cpu_blocks, *t.shape[1:]), dtype=t.dtype, device="cpu")
            for name, t in unique_gpu_caches.items()
        }
        logger.info(
            "PortableSimpleCPUOffloadWorker [CPU]: %d regions, %d host blocks (%.2f GB)",
            len(unique_gpu_caches),
            self.num_cpu_blocks,
            self.num_cpu_blocks * total_bytes_per_block / 2**30,
        )
        backend = TorchCopyBackend()
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

    def wait_for_save(self) -> None:
        """Issue this step's stores.

        vLLM orders them after a compute-done event on the current CUDA stream; here the
        forward pass has run to completion when this is called, so no ordering is needed.
        """
        metadata = self._connector_metadata
        if metadata is not None and metadata.store_gpu_blocks:
            if self._backend is None:
                raise RuntimeError("stores requested before register_kv_caches")
            self._backend.launch_copy(
                metadata.store_gpu_blocks,
                metadata.store_cpu_blocks,
                is_store=True,
                event_idx=metadata.store_event,
                events_list=self._store_events,
            )

    def shutdown(self) -> None:
        """Stop the backend (for the disk tier: join the I/O threads, remove the file)."""
        if self._backend is not None:
            self._backend.shutdown()
