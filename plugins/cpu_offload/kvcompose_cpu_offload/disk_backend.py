"""The disk tier's backend: vLLM's ``DiskBackend`` file format and handling, without CUDA."""

from __future__ import annotations

import contextlib
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from vllm.logger import init_logger
from vllm.v1.simple_kv_offload.disk_backend import _ALIGNMENT, O_DIRECT, DiskBackend

from kvcompose_cpu_offload.block_copy import (
    as_array,
    check_block_ids,
    copy_blocks,
    copy_loop,
    helper_built,
    helper_copy,
)
from kvcompose_cpu_offload.copy_threads import CopyThreads
from kvcompose_cpu_offload.host_memory import huge_page_buffer

# A child of vLLM's logger, so these lines appear in engine logs with vLLM's own.
logger = init_logger(f"vllm.{__name__}")

#: The most bytes one disk-tier I/O call moves (a run of consecutive slots): large enough that
#: a disk streams at its sequential rate (docs/performance.md 4).
STAGING_BYTES = 8 << 20

# The most pieces one pwritev/preadv takes (Linux's UIO_MAXIOV).
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") and "SC_IOV_MAX" in os.sysconf_names else 1024


def alloc_staging(num_slots: int, slot_bytes: int) -> np.ndarray:
    """A ``[num_slots, slot_bytes]`` buffer for ``O_DIRECT`` I/O, in huge pages where the kernel
    grants them (:func:`kvcompose_cpu_offload.host_memory.huge_page_buffer`), touched now so the first
    transfer does not fault it in.

    A disk request carries one scatter-gather segment per physically contiguous span of its
    buffer, and a request holds only so many (254 on this virtio disk), so a buffer in scattered
    4 KiB pages is cut into small requests, which a disk moves more slowly than a few large
    ones (vLLM's ``_alloc_aligned`` against huge pages: docs/performance.md 4).
    """
    buf = np.frombuffer(huge_page_buffer(num_slots * slot_bytes), dtype=np.int8).reshape(num_slots, slot_bytes)
    buf.fill(0)  # fault the pages in now
    return buf


class PortableDiskBackend(CopyThreads, DiskBackend):
    """Disk tier: the same file format and file handling as vLLM's ``DiskBackend``, without CUDA.

    vLLM stages each block through pinned buffers with a DMA copy and writes it with one
    ``pwritev`` per block. Here the KV regions are host memory already, and the I/O goes one
    run of consecutive disk slots at a time (sorted by slot, up to :data:`STAGING_BYTES` or
    ``IOV_MAX`` pieces a call), since a disk moves large requests far faster than small ones:

    * with ``O_DIRECT`` (the default), staged: the run's blocks are copied into one of two
      aligned buffers in huge pages (:func:`alloc_staging`) laid out as the file is, and one
      ``pwrite`` or ``pread`` moves the buffer while a copy helper thread fills or empties the
      other (vLLM's pipeline of DMA and I/O, with memory copies for the DMA);
    * through the page cache (``use_page_cache``), in place: ``pwritev``/``preadv`` straight
      from and into the KV cache, one piece per region and block.

    The file layout (a slot is every region's block in order), the file's creation and
    ``shutdown`` are vLLM's. Loads and stores each run on their own thread
    (:class:`CopyThreads`), as in vLLM, so a slow disk never stalls a forward pass and loads
    never queue behind stores.
    """

    _what = "disk"

    def init(  # type: ignore[override]  # no CUDA streams to pass
        self,
        device_regions: dict[str, torch.Tensor],
        disk_path: str,
        num_disk_slots: int,
        total_block_bytes: int,
        num_buffer_slots: int = 2,
        use_page_cache: bool = False,
    ) -> None:
        """Allocate staging buffers, create the backing file and start the I/O threads.

        ``num_buffer_slots`` (vLLM's ``disk_buffer_slots``) sizes vLLM's per-block staging; this
        backend sizes its two buffers itself (:data:`STAGING_BYTES`, at least one block), so
        that a disk gets requests large enough to stream, and keeps it only for the record.
        """
        self._total_block_bytes = total_block_bytes
        self._num_disk_slots = num_disk_slots
        self._num_buffer_slots = num_buffer_slots
        self._copy_loops = set()
        #: The compiled helper's copy loop for the staging copies, read once (:func:`copy_loop`).
        self._loop = copy_loop()
        self._tensor_names = list(device_regions)
        self._regions = [device_regions[n] for n in self._tensor_names]
        self._per_tensor_bpb = [t.stride(0) * t.element_size() for t in self._regions]
        self._region_arrays = [as_array(r).reshape(r.shape[0], -1).view(np.int8) for r in self._regions]
        self._num_blocks = min(r.shape[0] for r in self._regions)

        if not use_page_cache and total_block_bytes % _ALIGNMENT:
            # Staged I/O moves whole slots from aligned buffers: a slot's size is what O_DIRECT sees.
            raise ValueError(
                f"the disk backend writes with O_DIRECT, which needs a KV block of all layers in "
                f"multiples of {_ALIGNMENT} bytes, but this model's is {total_block_bytes} bytes "
                f"({self._per_tensor_bpb} per region); set the option use_page_cache (vLLM key "
                "use_page_cache: true) to write through the page cache instead"
            )
        # O_DIRECT always stages: the KV cache's 4 KiB pages make slower disk requests (docs/performance.md
        # 4); through the page cache the kernel copies anyway, so that I/O goes in place.
        self._in_place = use_page_cache
        # Blocks larger than the staging size go one at a time, so that copying one overlaps
        # writing the previous one.
        self._run_slots = max(1, STAGING_BYTES // total_block_bytes)
        if self._in_place:
            self._run_slots = min(self._run_slots, max(1, _IOV_MAX // len(self._regions)))
            self._staging: dict[bool, list[np.ndarray]] = {}
        else:
            # Per direction, two buffers laid out as the file: [slot, region bytes...].
            self._staging = {
                d: [alloc_staging(self._run_slots, total_block_bytes) for _ in range(2)] for d in (True, False)
            }
            self._copy_helpers = {
                d: ThreadPoolExecutor(1, f"kv-offload-disk-{'store' if d else 'load'}-copy") for d in (True, False)
            }
        self._columns = []
        start = 0
        for bpb in self._per_tensor_bpb:
            self._columns.append(slice(start, start + bpb))
            start += bpb
        # Where a block of every region is one contiguous row, a run is staged by one call of
        # the compiled helper, its pieces laid out by a few numpy operations for all regions.
        self._rows: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None
        if helper_built() and all(a.strides[1] == 1 for a in self._region_arrays):
            self._rows = (
                np.array([a.ctypes.data for a in self._region_arrays], dtype=np.int64),
                np.array([a.strides[0] for a in self._region_arrays], dtype=np.int64),
                np.array([c.start for c in self._columns], dtype=np.int64),
                np.array([a.shape[1] for a in self._region_arrays], dtype=np.uint64),
            )

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
            "PortableDiskBackend: path=%s, slots=%d, %.2f GB, I/O up to %d blocks a call, %s (page_cache=%s)",
            disk_path,
            num_disk_slots,
            num_disk_slots * total_block_bytes / 2**30,
            self._run_slots,
            "in place" if self._in_place else "staged",
            use_page_cache,
        )

        self._start_threads()

    def _slot_runs(self, blocks: list[int], slots: list[int]) -> list[tuple[int, list[int]]]:
        """``(first_slot, blocks)`` per run of consecutive disk slots, in slot order, each at
        most one I/O call long."""
        runs: list[tuple[int, list[int]]] = []
        for slot, blk in sorted(zip(slots, blocks)):
            if runs:
                first, run = runs[-1]
                if slot == first + len(run) and len(run) < self._run_slots:
                    run.append(blk)
                    continue
            runs.append((slot, [blk]))
        return runs

    def _io(self, pieces: list[Any], slot: int, nbytes: int, write: bool) -> None:
        offset = slot * self._total_block_bytes
        done = os.pwritev(self._fd, pieces, offset) if write else os.preadv(self._fd, pieces, offset)
        if done != nbytes:
            raise OSError(f"short {'write' if write else 'read'}: {done} of {nbytes} bytes at offset {offset}")

    def _stage(self, run: list[int], buf: np.ndarray, to_buffer: bool) -> None:
        """Copy the run's blocks into (or out of) the first ``len(run)`` slots of ``buf``."""
        if self._rows is not None:
            # One call for every region: laying the pieces out region by region held the GIL
            # for a third of the staging time (docs/performance.md 4).
            bases, strides, starts, sizes = self._rows
            blocks = bases + np.asarray(run, dtype=np.int64)[:, None] * strides
            slots = buf.ctypes.data + np.arange(len(run), dtype=np.int64)[:, None] * buf.strides[0] + starts
            n = np.broadcast_to(sizes, blocks.shape)
            if to_buffer:  # read the KV cache forwards, layer by layer
                order = np.argsort(blocks, axis=None)
                dst, src, n = slots.ravel()[order], blocks.ravel()[order], n.ravel()[order]
            else:  # the buffer is read forwards as it is
                dst, src, n = blocks.ravel(), slots.ravel(), n.ravel()
            sizes = np.ascontiguousarray(n)
            self._copy_loops.add(helper_copy(dst.astype(np.uint64), src.astype(np.uint64), sizes, self._loop))
            return
        staged = [(region, buf[:, column]) for region, column in zip(self._region_arrays, self._columns)]
        slots = range(len(run))
        if to_buffer:
            self._copy_loops |= copy_blocks(staged, run, slots, self._loop)
        else:
            self._copy_loops |= copy_blocks([(b, r) for r, b in staged], slots, run, self._loop)

    def _transfer(self, blocks: list[int], slots: list[int], write: bool) -> None:
        if len(blocks) != len(slots):
            raise ValueError(f"{len(blocks)} blocks but {len(slots)} disk slots")
        # Before any I/O: a bad slot would write past the file, a bad block id past the KV cache.
        check_block_ids(blocks, self._num_blocks, "device block")
        check_block_ids(slots, self._num_disk_slots, "disk slot")
        runs = self._slot_runs(blocks, slots)
        size = self._total_block_bytes
        if self._in_place:
            for slot, run in runs:
                pieces = [memoryview(a[b]) for b in run for a in self._region_arrays]
                self._io(pieces, slot, len(run) * size, write)
            return
        # This thread does the I/O and the helper the copies: a thread asleep in the kernel leaves
        # its CPU to the woken copy at once, the other way round each write started late
        # (docs/performance.md 4).
        bufs, helper = self._staging[write], self._copy_helpers[write]
        pending: Future[None] | None = None
        try:
            if write and runs:
                # Write one buffer while the helper fills the other.
                pending = helper.submit(self._stage, runs[0][1], bufs[0], True)
                for i, (slot, run) in enumerate(runs):
                    pending.result()
                    pending = None
                    if i + 1 < len(runs):
                        pending = helper.submit(self._stage, runs[i + 1][1], bufs[(i + 1) % 2], True)
                    self._io([bufs[i % 2][: len(run)]], slot, len(run) * size, True)
            else:
                # Read into one buffer while the helper empties the other.
                for i, (slot, run) in enumerate(runs):
                    buf = bufs[i % 2]
                    self._io([buf[: len(run)]], slot, len(run) * size, False)
                    if pending is not None:
                        pending.result()
                    pending = helper.submit(self._stage, run, buf, False)
            if pending is not None:
                pending.result()
                pending = None
        finally:
            if pending is not None:  # an error above: let the copy in flight end before the buffer is reused
                with contextlib.suppress(BaseException):
                    pending.result()

    def store(self, device_blocks: list[int], disk_slots: list[int]) -> None:
        """Device blocks -> file slots, a run of consecutive slots per I/O call."""
        self._transfer(device_blocks, disk_slots, write=True)

    def load(self, disk_slots: list[int], device_blocks: list[int]) -> None:
        """File slots -> device blocks, a run of consecutive slots per I/O call."""
        self._transfer(device_blocks, disk_slots, write=False)

    def shutdown(self) -> None:
        """vLLM's shutdown (drain the threads, unlink the file), then stop the copy helpers."""
        super().shutdown()
        for helper in getattr(self, "_copy_helpers", {}).values():
            helper.shutdown(wait=True)
