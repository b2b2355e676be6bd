"""The host-memory tier's backend: blocks move between the engine's KV and the pool on copy threads."""

from __future__ import annotations

import queue
from typing import ClassVar

import numpy as np
import torch

from kvcompose_cpu_offload.block_copy import as_array, copy_blocks, copy_loop, stack_regions
from kvcompose_cpu_offload.copy_threads import CopyThreads


class HostCopyBackend(CopyThreads):
    """Host-memory tier: copies blocks between the engine's KV regions and the pool on copy threads.

    Same ``launch_copy`` contract as vLLM's ``DmaCopyBackend``. On the CPU platform the
    "device" KV cache and the pool are both DRAM, so a transfer is a set of memory copies
    (:func:`~kvcompose_cpu_offload.block_copy.copy_blocks`), one per run of consecutive blocks
    and group of evenly spaced layers (:func:`~kvcompose_cpu_offload.block_copy.stack_regions`).
    Stores run on the store thread, so no step that produces a token waits for one; small loads,
    and small stores in a step without a forward pass, are copied in the engine's thread instead
    (:attr:`inline_copy_bytes`).
    """

    _what = "host copy"
    #: Transfers of at most this many bytes are copied in the calling (engine) thread, their
    #: event complete on return, instead of on a copy thread, where no token waits for them:
    #:
    #: * loads: vLLM starts a step's loads after its forward pass and polls them right after; a
    #:   woken thread is rarely done by the poll on a busy host, so the request would wait a
    #:   whole step more for a copy that takes far less in place (docs/performance.md 5d).
    #: * stores in a step without a forward pass
    #:   (:class:`~kvcompose_cpu_offload.portable_worker.StepMetadata`): vLLM steps on until a
    #:   store is reported (``has_pending_push_work``), each step contending for the GIL with the
    #:   engine core's output thread (docs/performance.md 5b); copied in place, the engine goes
    #:   idle in that step.
    #:
    #: Larger transfers keep the threads. 0: every copy on a thread.
    inline_copy_bytes: ClassVar[int] = 1 << 20

    def __init__(self) -> None:
        self._pairs: list[tuple[np.ndarray, np.ndarray]] = []
        self._block_bytes = 0
        self._copy_loops = set()
        #: The compiled helper's copy loop, read once (:func:`copy_loop`).
        self._loop = copy_loop()
        self._store_queue = queue.SimpleQueue()
        self._load_queue = queue.SimpleQueue()
        self._store_thread = None
        self._load_thread = None
        self._stopped = False

    def init(self, device_regions: dict[str, torch.Tensor], host_regions: dict[str, torch.Tensor]) -> None:
        """Pair the device and pool regions by name, stack evenly spaced ones, start the threads.

        Each region is ``[num_blocks, ...]`` with the block index first. Regions are stacked
        only where both sides stack the same way (the worker allocates its pool to match).
        """
        if device_regions.keys() != host_regions.keys():
            raise ValueError("device and host regions name different tensors")
        names = list(device_regions)
        dev = stack_regions([device_regions[n] for n in names])
        host = stack_regions([host_regions[n] for n in names])
        if [i for i, _ in dev] == [i for i, _ in host]:
            self._pairs = [(as_array(d), as_array(h)) for (_, d), (_, h) in zip(dev, host)]
        else:
            self._pairs = [(as_array(device_regions[n]), as_array(host_regions[n])) for n in names]
        self._block_bytes = sum(device[0].nbytes for device, _ in self._pairs)
        if self._store_thread is None:
            self._start_threads()

    def copies_in_place(self, num_blocks: int, is_store: bool, step_has_forward: bool) -> bool:
        """Whether the transfer is copied in the caller's thread (:attr:`inline_copy_bytes`): a
        load, or a store in a step without a forward pass, of at most that many bytes."""
        return (not is_store or not step_has_forward) and num_blocks * self._block_bytes <= self.inline_copy_bytes

    def store(self, src_blocks: list[int], dst_blocks: list[int]) -> None:
        """Copy device blocks ``src_blocks`` to pool blocks ``dst_blocks`` now, in the caller's thread
        (every id checked first, see :func:`copy_blocks`)."""
        self._copy_loops |= copy_blocks(self._pairs, src_blocks, dst_blocks, self._loop)

    def load(self, src_blocks: list[int], dst_blocks: list[int]) -> None:
        """Copy pool blocks ``src_blocks`` to device blocks ``dst_blocks`` now, in the caller's thread
        (every id checked first, see :func:`copy_blocks`)."""
        pairs = [(host, device) for device, host in self._pairs]
        self._copy_loops |= copy_blocks(pairs, src_blocks, dst_blocks, self._loop)

    def shutdown(self) -> None:
        """Let the copies already queued finish, then stop the threads (idempotent)."""
        if self._stopped:
            return
        self._stopped = True
        for q, t in ((self._store_queue, self._store_thread), (self._load_queue, self._load_thread)):
            if t is not None:
                q.put(None)
                t.join()
