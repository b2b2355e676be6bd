"""A worker for vLLM's SimpleCPUOffload that copies blocks with host memory copies on copy threads.

vLLM's ``SimpleCPUOffloadWorker`` moves blocks with ``cuMemcpyBatchAsync`` on CUDA streams
(``DmaCopyBackend``), pins its pool with ``cudaHostRegister`` and waits on CUDA events, so it
cannot start on a platform without CUDA (on vLLM's CPU platform it fails with
``AttributeError: type object '_StreamPlaceholder' has no attribute 'priority_range'``).

:class:`PortableSimpleCPUOffloadWorker` subclasses it and replaces only those parts:

* the copy backend (:class:`HostCopyBackend`, or :class:`PortableDiskBackend` for the disk
  tier), which keeps the ``launch_copy`` contract of vLLM's backends: each transfer appends an
  ``(event_idx, event)`` pair to the worker's event list and runs on a store or load thread
  (:class:`CopyThreads`, the counterpart of vLLM's CUDA side streams), and the event answers
  ``query()`` and ``synchronize()`` like a ``torch.Event``;
* the host pool allocation (no ``cudaHostRegister``; laid out so a block of every layer is one
  copy, see :func:`stack_regions`);
* when a store starts: at the next step's ``bind_connector_metadata`` rather than in
  ``wait_for_save``, so that no step waits for a copy thread to wake before its tokens are
  sampled (see :meth:`PortableSimpleCPUOffloadWorker.wait_for_save`), except in a step without
  a forward pass (:class:`StepMetadata`), which starts them at once; the preemption flush and
  shutdown start them first.

Block ids are checked before a transfer copies anything (:func:`check_block_ids`): an id outside
a side's blocks fails the transfer through its event, with nothing copied (the compiled helper
would write out of bounds, and numpy would wrap a negative id to the end of the pool).

Copy loops. Transfers of :data:`STREAM_MIN_BYTES` or more go through the compiled helper
(``_streamcopy.c``), which copies with one of two loops: ``avx512`` (non-temporal 64-byte
stores, where the CPU has AVX-512F) or ``plain`` (``memmove`` per piece, everywhere else).
Setting the environment variable ``KVCOMPOSE_COPY_LOOP=plain`` forces the plain loop on any
CPU (to test it, or to compare the two); ``auto`` (the default) picks ``avx512`` where it
runs. :func:`copy_loop` says which loop a transfer gets, and
:meth:`PortableSimpleCPUOffloadWorker.take_copy_loops` which loops the transfers used.

Everything else is vLLM's own code, inherited unchanged: how raw ``[num_blocks, block_bytes]``
storage regions are derived from the engine's KV tensors, how the pool is sized, metadata
binding, completion polling (finished loads -> request ids in ``finished_recving``, finished
stores -> ``SimpleCPUOffloadWorkerMetadata`` counts), and the preemption flush. The
scheduler-side manager therefore sees exactly what vLLM's CUDA worker would report.
"""

from __future__ import annotations

import contextlib
import functools
import os
import queue
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch
from vllm.logger import init_logger
from vllm.v1.simple_kv_offload.disk_backend import _ALIGNMENT, O_DIRECT, DiskBackend
from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadMetadata
from vllm.v1.simple_kv_offload.worker import SimpleCPUOffloadWorker

from kvcompose_cpu_offload.host_memory import huge_page_buffer

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

# A child of vLLM's logger, so these lines appear in engine logs with vLLM's own.
logger = init_logger(f"vllm.{__name__}")

#: The most bytes one disk-tier I/O call moves (a run of consecutive slots): large enough that
#: a disk streams at its sequential rate (measured in docs/performance.md, benchmark 4).
STAGING_BYTES = 8 << 20

# The most pieces one pwritev/preadv takes (Linux's UIO_MAXIOV).
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") and "SC_IOV_MAX" in os.sysconf_names else 1024

# --------------------------------------------------------------------------- block copies

try:  # built with the plugin where a C compiler is found (pyproject.toml: ext-modules)
    from kvcompose_cpu_offload import _streamcopy
except ImportError:  # pragma: no cover - a build without a compiler
    _streamcopy = None  # type: ignore[assignment]

#: Transfers of at least this many bytes (per region pair) go through the compiled helper, which
#: streams them past the cache where the CPU allows it (``_streamcopy.STREAMS``). Smaller ones
#: are copied with numpy: their bytes are likely still in the cache, and the helper's fixed cost
#: (about 25 us to lay out the pieces) is not paid back below about 1 MiB (measured: 512 KiB in
#: 32 blocks, numpy 41 us against 72 us; 8 MiB, 1.8 ms against 0.86 ms).
STREAM_MIN_BYTES = 1 << 20

#: The environment variable that picks the compiled helper's copy loop (:func:`copy_loop`).
COPY_LOOP_ENV = "KVCOMPOSE_COPY_LOOP"
_COPY_LOOP_CHOICES = ("auto", "plain")

#: The longest the engine's thread waits for one copy thread's transfer (vLLM's preemption
#: flush): a copy moves gigabytes per second, so a transfer not done by then never will be.
SYNC_TIMEOUT_S = 60.0


@functools.cache
def _forced_plain(setting: str) -> bool:
    """Whether a :data:`COPY_LOOP_ENV` value forces the plain loop; an unknown one is ignored once, with a warning."""
    if setting not in _COPY_LOOP_CHOICES:
        logger.warning("%s=%r is not one of %s; using auto", COPY_LOOP_ENV, setting, ", ".join(_COPY_LOOP_CHOICES))
    return setting == "plain"


def copy_loop() -> str:
    """The loop the compiled helper copies with now: ``"avx512"`` (streamed stores; the CPU has
    AVX-512F), ``"plain"`` (``memmove`` per piece: no AVX-512F, or ``KVCOMPOSE_COPY_LOOP=plain``),
    or ``"numpy"`` where the helper is not built. Read at each transfer, so a test can switch it."""
    if _streamcopy is None:
        return "numpy"
    if _streamcopy.STREAMS and not _forced_plain(os.environ.get(COPY_LOOP_ENV, "auto").strip().lower()):
        return "avx512"
    return "plain"


def _helper_copy(dst: np.ndarray, src: np.ndarray, sizes: np.ndarray) -> str:
    """One call of the compiled helper on laid-out pieces; returns the loop that copied them."""
    # A negative stream_min streams no piece: the plain loop.
    loop = copy_loop()
    streamed = _streamcopy.copy_pieces(dst, src, sizes, 0 if loop == "avx512" else -1)
    if streamed is None:  # a build from before copy_pieces counted its streamed pieces
        return loop
    return "avx512" if streamed else "plain"


def check_block_ids(ids: Sequence[int], count: int, what: str) -> None:
    """Raise :class:`IndexError` unless every id in ``ids`` is in ``[0, count)``.

    Called once per transfer before anything is copied: the compiled helper turns ids into
    addresses unchecked, and numpy wraps a negative index. ``what`` names the ids in the
    message (``"source block"``, ``"disk slot"``).
    """
    if not len(ids):
        return
    try:
        arr = np.asarray(ids, dtype=np.int64)
        lo, hi = int(arr.min()), int(arr.max())
    except OverflowError:  # an id beyond int64 is out of range anyway
        lo, hi = 0, max(ids)
    if lo >= 0 and hi < count:
        return
    raise IndexError(
        f"{what} id {lo if lo < 0 else hi} is outside [0, {count}); "
        f"nothing of the transfer's {len(ids)} blocks was copied"
    )


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


def as_array(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a host tensor (no copy); dtypes numpy lacks are viewed as same-size ints."""
    if t.dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):
        t = t.view(torch.int16 if t.element_size() == 2 else torch.int8)
    return t.detach().numpy()


def copy_blocks(
    pairs: Sequence[tuple[np.ndarray, np.ndarray]], src_ids: Sequence[int], dst_ids: Sequence[int]
) -> set[str]:
    """For each ``(src, dst)`` region pair of one transfer, copy block ``src[src_ids[i]]`` to
    ``dst[dst_ids[i]]`` for each ``i`` (dim 0 is the block index). Returns the loops that copied
    (:func:`copy_loop`'s names; ``"numpy"`` for numpy).

    Every id is checked against its side's blocks first (:func:`check_block_ids`): a bad one
    raises :class:`IndexError` before any pair is copied.

    With the compiled helper (:mod:`kvcompose_cpu_offload._streamcopy`, built with the plugin
    where a C compiler is found), a pair moving at least :data:`STREAM_MIN_BYTES` and layouts it
    can address (:func:`pieces`): one call for the pair, streamed past the cache, the GIL
    released. Otherwise one numpy assignment per run of consecutive blocks (the runs found once
    for the transfer): numpy copies the run piece by piece through the cache, and releases the
    GIL too. Measured against each other and the alternatives in docs/performance.md
    (benchmark 4).
    """
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} source blocks but {len(dst_ids)} destination blocks")
    if pairs:
        check_block_ids(src_ids, min(src.shape[0] for src, _ in pairs), "source block")
        check_block_ids(dst_ids, min(dst.shape[0] for _, dst in pairs), "destination block")
    loops: set[str] = set()
    runs: list[tuple[int, int, int]] | None = None
    for src, dst in pairs:
        if _streamcopy is not None and len(src_ids) * src[0].nbytes >= STREAM_MIN_BYTES:
            plan = pieces(src, dst, src_ids, dst_ids)
            if plan is not None:
                loops.add(_helper_copy(*plan))
                continue
        if runs is None:
            runs = contiguous_runs(src_ids, dst_ids)
        for s, d, n in runs:
            if n == 1:
                dst[d] = src[s]
            else:
                dst[d : d + n] = src[s : s + n]
        loops.add("numpy")
    return loops


def _chunks(arr: np.ndarray, whole: bool) -> tuple[int, np.ndarray] | None:
    """A block of ``arr`` (``arr[b]``) as equal contiguous chunks: (chunk bytes, their offsets
    from the block's start), or ``None`` when it is not. ``whole``: the block in one chunk if it
    is contiguous; otherwise one chunk per index of its first dimension (a stacked layer)."""
    block = arr[0]
    if whole:
        return (block.nbytes, np.zeros(1, dtype=np.int64)) if block.flags.c_contiguous else None
    if block.ndim >= 2 and block[0].flags.c_contiguous and block.strides[0] > 0:
        return block[0].nbytes, np.arange(block.shape[0], dtype=np.int64) * block.strides[0]
    return None


def pieces(
    src: np.ndarray, dst: np.ndarray, src_ids: Sequence[int], dst_ids: Sequence[int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The copy of blocks ``src_ids`` to ``dst_ids`` as (destination addresses, source
    addresses, sizes) of contiguous pieces, for the compiled helper; ``None`` when a layout has
    no such form (the caller copies with numpy).

    A block is one piece where both sides hold it contiguously, else one piece per stacked layer
    (:func:`stack_regions`: the engine and the pool keep a layer's blocks together; the disk
    tier's staging buffers a block's layers); a run of consecutive blocks is one piece per layer
    where both sides keep those pieces back to back. The pieces are in source-address order:
    the reads then walk memory forwards, which the hardware prefetchers follow (scattered 16 KiB
    blocks 0.69-0.70 -> 0.75-0.81 of a memcpy, docs/performance.md benchmark 4).
    """
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} source blocks but {len(dst_ids)} destination blocks")
    if not len(src_ids) or src.shape[1:] != dst.shape[1:]:
        return None
    for whole in (True, False):
        s_layout, d_layout = _chunks(src, whole), _chunks(dst, whole)
        if s_layout is not None and d_layout is not None:
            break
    else:
        return None
    chunk, s_offsets = s_layout
    s_start = np.asarray(src_ids, dtype=np.int64)
    d_start = np.asarray(dst_ids, dtype=np.int64)
    count = np.ones_like(s_start)
    s_stride, d_stride = src.strides[0], dst.strides[0]
    if s_stride == chunk and d_stride == chunk:  # a run's pieces are back to back: one piece
        starts = np.flatnonzero(np.r_[True, (np.diff(s_start) != 1) | (np.diff(d_start) != 1)])
        count = np.diff(np.r_[starts, len(s_start)])
        s_start, d_start = s_start[starts], d_start[starts]
    s_addr = src.ctypes.data + s_start[:, None] * s_stride + s_offsets[None, :]
    d_addr = dst.ctypes.data + d_start[:, None] * d_stride + d_layout[1][None, :]
    sizes = np.repeat(count * chunk, len(s_offsets))
    order = np.argsort(s_addr, axis=None, kind="stable")
    return (
        d_addr.astype(np.uint64).ravel()[order],
        s_addr.astype(np.uint64).ravel()[order],
        sizes.astype(np.uint64)[order],
    )


def stack_regions(regions: Sequence[torch.Tensor]) -> list[tuple[int, torch.Tensor]]:
    """Group regions that sit at equal distances in one allocation into ``[blocks, k, ...]`` views.

    vLLM lays the layers of one KV allocation out at a fixed layer stride, so the worker's
    per-layer ``[num_blocks, block_bytes]`` regions are slices of one strided tensor. Viewing
    them as ``[num_blocks, layers, block_bytes]`` lets one assignment copy a block of every
    layer: a Python call per block instead of one per block and layer. Returns
    ``(first_region_index, view)`` pairs covering every region in order; a region that fits no
    group is a group of one.
    """
    groups: list[tuple[int, list[torch.Tensor]]] = []
    for i, r in enumerate(regions):
        if groups and _extends(groups[-1][1], r):
            groups[-1][1].append(r)
        else:
            groups.append((i, [r]))
    out = []
    for i, members in groups:
        first = members[0]
        step = (members[1].data_ptr() - first.data_ptr()) // first.element_size() if len(members) > 1 else 0
        view = first.as_strided(
            (first.shape[0], len(members), *first.shape[1:]),
            (first.stride(0), step, *first.stride()[1:]),
        )
        out.append((i, view))
    return out


def _extends(members: list[torch.Tensor], r: torch.Tensor) -> bool:
    """Whether ``r`` continues ``members`` at the same distance without sharing a byte with them."""
    first = members[0]
    if r.untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
        return False
    if (r.shape, r.stride(), r.dtype) != (first.shape, first.stride(), first.dtype) or r.dim() < 2:
        return False
    if not r[0].is_contiguous():
        return False
    step = (members[1] if len(members) > 1 else r).data_ptr() - first.data_ptr()
    if step <= 0 or step % r.element_size() or r.data_ptr() - members[-1].data_ptr() != step:
        return False
    step //= r.element_size()
    row, block_stride = r[0].numel(), r.stride(0)
    # Disjoint spans (layer-outermost: one region per layer), or rows interleaved inside each
    # block's stride (block-outermost); anything else could alias.
    return step >= r.shape[0] * block_stride or (step >= row and len(members) * step + row <= block_stride)


# --------------------------------------------------------------------------- completion events


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
    """A transfer event completed by a copy thread; a copy error is re-raised to the caller.

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
        # vLLM waits on the engine's thread (its preemption flush): a bound, and a clear error past it.
        if not self._done.wait(SYNC_TIMEOUT_S):
            raise TimeoutError(
                f"KV offload {self._what} still running after {SYNC_TIMEOUT_S:g} s; the copy thread is stuck "
                "or starved of CPU"
            )
        self._raise_if_failed()


# --------------------------------------------------------------------------- copy threads


class CopyThreads:
    """A store thread and a load thread, each fed by a FIFO queue: the side streams of the CPU tier.

    Implements vLLM's ``launch_copy`` contract for a backend that defines ``store(src, dst)`` and
    ``load(src, dst)`` (synchronous copies of paired block lists). ``launch_copy`` puts the
    transfer's event on the worker's list *before* the copy runs, so the worker's completion
    polling (``get_finished``) reports it only once its bytes are in place, and its preemption
    flush (``handle_preemptions``) waits for every copy in flight. Loads never queue behind
    stores, as with vLLM's two CUDA streams. The scheduler keeps a block referenced until the
    transfer that reads or writes it is reported, so no block is reused under a copy.
    """

    _what: ClassVar[str] = "copy"
    #: The copy loops the transfers used since :meth:`take_copy_loops` last ran (set in ``init``).
    _copy_loops: set[str]
    _store_queue: queue.SimpleQueue[Any]
    _load_queue: queue.SimpleQueue[Any]
    _store_thread: threading.Thread | None
    _load_thread: threading.Thread | None

    def store(self, src_blocks: list[int], dst_blocks: list[int]) -> None:
        raise NotImplementedError

    def load(self, src_blocks: list[int], dst_blocks: list[int]) -> None:
        raise NotImplementedError

    def take_copy_loops(self) -> set[str]:
        """The copy loops (:func:`copy_loop`'s names) the transfers used since the last call."""
        loops, self._copy_loops = self._copy_loops, set()
        return loops

    def _start_threads(self) -> None:
        name = self._what.replace(" ", "-")
        self._store_thread = threading.Thread(
            target=self._io_loop, args=(self._store_queue, True), name=f"kv-offload-{name}-store", daemon=True
        )
        self._load_thread = threading.Thread(
            target=self._io_loop, args=(self._load_queue, False), name=f"kv-offload-{name}-load", daemon=True
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
        *,
        step_has_forward: bool = True,
    ) -> None:
        """Queue the transfer for the store or load thread (or copy it now, see
        :meth:`copies_in_place`) and register its event now.

        ``wait_event`` (vLLM's compute-done CUDA event) has no counterpart: on the CPU platform
        the forward pass has finished writing the KV when the worker issues its stores.
        ``step_has_forward``: whether the engine step issuing the transfer runs a forward pass
        (a step without one produces no token).
        """
        if len(src_blocks) != len(dst_blocks):
            raise ValueError(f"{len(src_blocks)} source blocks but {len(dst_blocks)} destinations")
        event = ThreadEvent(f"{self._what} {'store' if is_store else 'load'}")
        events_list.append((event_idx, event))
        if self.copies_in_place(len(src_blocks), is_store, step_has_forward):
            self._run(src_blocks, dst_blocks, is_store, event)
        else:
            (self._store_queue if is_store else self._load_queue).put((list(src_blocks), list(dst_blocks), event))

    def copies_in_place(self, num_blocks: int, is_store: bool, step_has_forward: bool) -> bool:
        """Whether a transfer of ``num_blocks`` blocks is copied now, in the caller's (engine)
        thread, instead of on a copy thread (its event then complete when ``launch_copy``
        returns). Never, here."""
        return False

    def _run(self, src_blocks: list[int], dst_blocks: list[int], is_store: bool, event: ThreadEvent) -> None:
        try:
            (self.store if is_store else self.load)(src_blocks, dst_blocks)
        except BaseException as exc:  # reported through the event, on the engine's thread
            event.set_done(exc)
        else:
            event.set_done()

    def _io_loop(self, q: queue.SimpleQueue[Any], is_store: bool) -> None:
        while True:
            item = q.get()
            if item is None:  # the shutdown sentinel, queued behind every transfer: a drain
                return
            self._run(item[0], item[1], is_store, item[2])


class HostCopyBackend(CopyThreads):
    """Host-memory tier: copies blocks between the engine's KV regions and the pool on copy threads.

    Same ``launch_copy`` contract as vLLM's ``DmaCopyBackend``. On the CPU platform the
    "device" KV cache and the pool are both DRAM, so a transfer is a set of memory copies
    (:func:`copy_blocks`), one per run of consecutive blocks and group of evenly spaced layers
    (:func:`stack_regions`). Stores run on the store thread, so no step that produces a token
    waits for one; small loads, and small stores in a step without a forward pass, are copied in
    the engine's thread instead (:attr:`inline_copy_bytes`).
    """

    _what = "host copy"
    #: Transfers of at most this many bytes are copied in the calling (engine) thread, their
    #: event complete on return, instead of on a copy thread, where no token waits for them:
    #:
    #: * loads: vLLM starts a step's loads after its forward pass and polls them right after. A
    #:   load handed to a thread there is rarely done by the poll on a busy host (here, 2 cores
    #:   shared by two engines, the woken thread waits 1-15 ms for a core; docs/performance.md,
    #:   5d), so the request would wait a whole step more, against 0.05 ms to copy a 600-token
    #:   prompt's 18 blocks of 32 KiB in place. The loading request produces no token in that step.
    #: * stores in a step without a forward pass (:class:`StepMetadata`): vLLM steps on until a
    #:   store is reported (``has_pending_push_work``), so after a request's last token a store
    #:   on a thread keeps the engine stepping, each step contending for the GIL with the engine
    #:   core's output thread that is sending that token (docs/performance.md, 5b). Copied in
    #:   place, it is reported in that step and the engine goes idle.
    #:
    #: 1 MiB copies in about 0.1 ms; larger transfers keep the threads. 0: every copy on a thread.
    inline_copy_bytes: ClassVar[int] = 1 << 20

    def __init__(self) -> None:
        self._pairs: list[tuple[np.ndarray, np.ndarray]] = []
        self._block_bytes = 0
        self._copy_loops = set()
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
        self._copy_loops |= copy_blocks(self._pairs, src_blocks, dst_blocks)

    def load(self, src_blocks: list[int], dst_blocks: list[int]) -> None:
        """Copy pool blocks ``src_blocks`` to device blocks ``dst_blocks`` now, in the caller's thread
        (every id checked first, see :func:`copy_blocks`)."""
        self._copy_loops |= copy_blocks([(host, device) for device, host in self._pairs], src_blocks, dst_blocks)

    def shutdown(self) -> None:
        """Let the copies already queued finish, then stop the threads (idempotent)."""
        if self._stopped:
            return
        self._stopped = True
        for q, t in ((self._store_queue, self._store_thread), (self._load_queue, self._load_thread)):
            if t is not None:
                q.put(None)
                t.join()


def alloc_staging(num_slots: int, slot_bytes: int) -> np.ndarray:
    """A ``[num_slots, slot_bytes]`` buffer for ``O_DIRECT`` I/O, in huge pages where the kernel
    grants them (:func:`kvcompose_cpu_offload.host_memory.huge_page_buffer`), touched now so the first
    transfer does not fault it in.

    A disk request carries one scatter-gather segment per physically contiguous span of its
    buffer, and a request holds only so many (254 on this virtio disk), so a buffer in scattered
    4 KiB pages is cut into small requests. vLLM's ``_alloc_aligned`` (``torch.zeros``, faulted
    in by two threads) came out in 2,048 spans per 8 MiB and wrote at 1.45 GB/s; huge pages make
    it 4 spans and 2.44 GB/s (docs/performance.md, benchmark 4).
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
        # O_DIRECT always goes through the huge-page staging buffers: even where the KV cache is
        # aligned, its own 4 KiB pages make more, smaller disk requests (64 MiB of 16 KiB blocks:
        # stores 1.52-1.79 GB/s from the KV cache against 1.88-2.07 staged, loads 0.96-1.00
        # against 1.26). Through the page cache the kernel copies anyway, so that I/O goes in place.
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
        if _streamcopy is not None and all(a.strides[1] == 1 for a in self._region_arrays):
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
            # for a third of the staging time (4.5 of 14 ms per 64 MiB of 16 KiB blocks).
            bases, strides, starts, sizes = self._rows
            blocks = bases + np.asarray(run, dtype=np.int64)[:, None] * strides
            slots = buf.ctypes.data + np.arange(len(run), dtype=np.int64)[:, None] * buf.strides[0] + starts
            n = np.broadcast_to(sizes, blocks.shape)
            if to_buffer:  # read the KV cache forwards, layer by layer
                order = np.argsort(blocks, axis=None)
                dst, src, n = slots.ravel()[order], blocks.ravel()[order], n.ravel()[order]
            else:  # the buffer is read forwards as it is
                dst, src, n = blocks.ravel(), slots.ravel(), n.ravel()
            self._copy_loops.add(_helper_copy(dst.astype(np.uint64), src.astype(np.uint64), np.ascontiguousarray(n)))
            return
        staged = [(region, buf[:, column]) for region, column in zip(self._region_arrays, self._columns)]
        slots = range(len(run))
        if to_buffer:
            self._copy_loops |= copy_blocks(staged, run, slots)
        else:
            self._copy_loops |= copy_blocks([(b, r) for r, b in staged], slots, run)

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
        # This thread does the I/O and the helper the copies. The other way round, Linux wakes
        # the I/O helper on this thread's CPU, where it waits until the copy ends (each write
        # started 1-2.6 ms late; docs/performance.md, benchmark 4). A thread that sleeps in the
        # kernel leaves its CPU to the woken copy at once.
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


# --------------------------------------------------------------------------- the worker


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
        """The copy loops (:func:`copy_loop`'s names) this worker's transfers used since the last
        call: what a benchmark records beside its timings."""
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
        the step, before its tokens are sampled (1-15 ms on a busy host, docs/performance.md 5d).
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
