"""Block copies between host-memory KV regions: the primitives every CPU-tier transfer uses.

Block ids are checked before a transfer copies anything (:func:`check_block_ids`): an id outside
a side's blocks fails the transfer with nothing copied (the compiled helper would write out of
bounds, and numpy would wrap a negative id to the end of the pool).

Copy loops. Transfers of :data:`STREAM_MIN_BYTES` or more go through the compiled helper
(``_streamcopy.c``), which copies with one of two loops: ``avx512`` (non-temporal 64-byte
stores, where the CPU has AVX-512F) or ``plain`` (``memmove`` per piece, everywhere else).
Setting the environment variable ``KVCOMPOSE_COPY_LOOP=plain`` forces the plain loop on any
CPU (to test it, or to compare the two); ``auto`` (the default) picks ``avx512`` where it
runs. :func:`copy_loop` reads it: each owner of transfers (a host or disk backend, a native
handler's copy thread) reads it once, when it is made, and passes it to every copy.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

import numpy as np
import torch
from vllm.logger import init_logger

# A child of vLLM's logger, so these lines appear in engine logs with vLLM's own.
logger = init_logger(f"vllm.{__name__}")

try:  # built with the plugin where a C compiler is found (pyproject.toml: ext-modules)
    from kvcompose_cpu_offload import _streamcopy
except ImportError:  # pragma: no cover - a build without a compiler
    _streamcopy = None  # type: ignore[assignment]

#: Transfers of at least this many bytes (per region pair) go through the compiled helper, which
#: streams them past the cache where the CPU allows it (``_streamcopy.STREAMS``). Smaller ones
#: are copied with numpy: their bytes are likely still in the cache, and the helper's fixed cost
#: of laying out the pieces is not paid back below about 1 MiB (docs/performance.md 4).
STREAM_MIN_BYTES = 1 << 20

#: The environment variable that picks the compiled helper's copy loop (:func:`copy_loop`).
COPY_LOOP_ENV = "KVCOMPOSE_COPY_LOOP"
_COPY_LOOP_CHOICES = ("auto", "plain")


@functools.cache
def _forced_plain(setting: str) -> bool:
    """Whether a :data:`COPY_LOOP_ENV` value forces the plain loop; an unknown one is ignored once, with a warning."""
    if setting not in _COPY_LOOP_CHOICES:
        logger.warning("%s=%r is not one of %s; using auto", COPY_LOOP_ENV, setting, ", ".join(_COPY_LOOP_CHOICES))
    return setting == "plain"


def helper_built() -> bool:
    """Whether the compiled helper is importable here (read at each call, so a test can remove it)."""
    return _streamcopy is not None


def copy_loop() -> str:
    """The loop the compiled helper copies with under the environment now: ``"avx512"`` (streamed
    stores; the CPU has AVX-512F), ``"plain"`` (``memmove`` per piece: no AVX-512F, or
    ``KVCOMPOSE_COPY_LOOP=plain``), or ``"numpy"`` where the helper is not built. Read once by
    each owner of transfers, when it is made; a copy is given it (``loop``)."""
    if _streamcopy is None:
        return "numpy"
    if _streamcopy.STREAMS and not _forced_plain(os.environ.get(COPY_LOOP_ENV, "auto").strip().lower()):
        return "avx512"
    return "plain"


def helper_copy(dst: np.ndarray, src: np.ndarray, sizes: np.ndarray, loop: str) -> str:
    """One call of the compiled helper on laid-out pieces, with ``loop`` (:func:`copy_loop`, as
    the caller read it); returns the loop that copied them."""
    # A negative stream_min streams no piece: the plain loop.
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
    pairs: Sequence[tuple[np.ndarray, np.ndarray]], src_ids: Sequence[int], dst_ids: Sequence[int], loop: str
) -> set[str]:
    """For each ``(src, dst)`` region pair of one transfer, copy block ``src[src_ids[i]]`` to
    ``dst[dst_ids[i]]`` for each ``i`` (dim 0 is the block index). ``loop`` is the compiled
    helper's loop (:func:`copy_loop`, as the caller read it). Returns the loops that copied
    (:func:`copy_loop`'s names; ``"numpy"`` for numpy).

    Every id is checked against its side's blocks first (:func:`check_block_ids`): a bad one
    raises :class:`IndexError` before any pair is copied.

    With the compiled helper (:mod:`kvcompose_cpu_offload._streamcopy`, built with the plugin
    where a C compiler is found), a pair moving at least :data:`STREAM_MIN_BYTES` and layouts it
    can address (:func:`pieces`): one call for the pair, streamed past the cache, the GIL
    released. Otherwise one numpy assignment per run of consecutive blocks (the runs found once
    for the transfer): numpy copies the run piece by piece through the cache, and releases the
    GIL too. Measured against each other and the alternatives in
    docs/performance.md 4.
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
                loops.add(helper_copy(*plan, loop))
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
    the reads then walk memory forwards, which the hardware prefetchers follow
    (docs/performance.md 4).
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
