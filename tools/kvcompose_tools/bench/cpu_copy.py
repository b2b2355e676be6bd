"""Benchmark 4: the CPU tier's data path, the portable worker against the memory's limit.

Subject: the cpu-offload plugin's portable worker (vLLM's ``SimpleCPUOffloadWorker`` with host
copies), driven as an engine drives it: ``bind_connector_metadata`` then ``wait_for_save`` (a
store) or ``start_load_kv`` (a load), then ``handle_preemptions`` with ``need_flush``, which
starts the store (the worker starts a step's stores when the next step begins) and waits for
the copy thread, so a sample is the time until the bytes are in place. The KV cache is
laid out by vLLM's own code (:func:`kvcompose.testing.kv.make_engine_kv`: the CPU platform's
``LBHNC`` layout, one ``[blocks, heads, tokens, K|V]`` view per layer in one allocation), and
the worker derives its regions from it as vLLM's worker does.

Baselines, in the same run and interleaved:

* ``contiguous memcpy``: one ``memmove`` of the same number of bytes between two contiguous
  buffers, the limit of one thread on this machine (the targets are ratios to it);
* ``per-block copy loop``: ``dst[d].copy_(src[s])`` per block and layer region, the obvious
  torch loop.

The worker comes from the installed ``cpu-offload`` connector type (its ``portable_worker()``,
and the disk baseline's buffer its ``huge_page_buffer()``), not from an import: the core reaches
plugins only through what they register.

Two block-id patterns: ``scattered`` (random ids on both sides: a fragmented pool) and
``consecutive`` (one run of ids on each side, what a fresh pool hands out).

The disk tier (``backend: disk``; not in ``--quick``) is measured the same way against
``sequential file I/O``: one ``pwrite`` (store cases) or ``pread`` (load cases) of the same
bytes to a file in the same directory, opened with ``O_DIRECT`` as the plugin opens its file,
from a buffer in huge pages (the disk's best: a request carries one segment per physically
contiguous span of its buffer). ``sequential file I/O, 4 KiB pages``, the same call from an
ordinary anonymous mapping, is shown beside it. The directory is ``$KVCOMPOSE_BENCH_DISK_DIR``,
else the system's temporary directory.

Each case records ``copy_loop``: which loop of the plugin's compiled copy moved its bytes
(``avx512``: streamed stores, where the CPU has AVX-512F; ``plain``: ``memmove`` per piece;
``numpy`` where the helper is not built), as the worker reports it. ``KVCOMPOSE_COPY_LOOP=plain``
forces the plain loop on any CPU, to compare the two on one machine.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from kvcompose_tools.bench.measure import interleave, pick, ratio, repeats_for
from kvcompose_tools.bench.report import AllTargets, Case, CaseTarget, Result

KIB = 1024
MIB = 1024 * KIB
SIZES = (16 * KIB, 64 * KIB, 256 * KIB, 2 * MIB)
QUICK_SIZES = (16 * KIB, 2 * MIB)
PATTERNS = ("scattered", "consecutive")
NUM_LAYERS = 8
SUBJECT = "portable worker"
MEMCPY = "contiguous memcpy"
LOOP = "per-block copy loop"
FILE_IO = "sequential file I/O"
FILE_IO_SMALL_PAGES = "sequential file I/O, 4 KiB pages"
DISK_SIZES = (16 * KIB, 256 * KIB, 2 * MIB)


@dataclass(frozen=True)
class Geometry:
    """A model shape whose per-layer KV page (one block of one layer, K and V) is ``bytes``."""

    block_size: int
    num_kv_heads: int
    head_size: int
    model: str
    dtype: torch.dtype = torch.bfloat16

    @property
    def bytes(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_size * self.dtype.itemsize


#: Per-layer page size -> a real model's attention shape that has it (bfloat16 KV).
GEOMETRY = {
    16 * KIB: Geometry(16, 2, 128, "Qwen2.5-1.5B (2 KV heads), 16-token blocks"),
    64 * KIB: Geometry(16, 8, 128, "Llama-3-8B (8 KV heads), 16-token blocks"),
    256 * KIB: Geometry(16, 32, 128, "Llama-2-7B (32 KV heads), 16-token blocks"),
    2 * MIB: Geometry(128, 32, 128, "Llama-2-7B (32 KV heads), 128-token blocks"),
}


def _label(size: int) -> str:
    return f"{size // KIB} KiB" if size < MIB else f"{size // MIB} MiB"


def _cpu_offload(name: str) -> Any:
    """A method of the installed ``cpu-offload`` type; a clear error without the plugin."""
    from kvcompose.plugins import get_plugins

    found = getattr(get_plugins().connector_types.get("cpu-offload"), name, None)
    if found is None:
        raise RuntimeError(
            "cpu_copy measures the cpu-offload plugin's portable worker: install kvcompose-cpu-offload "
            "(plugins/cpu_offload) and leave it enabled in KVCOMPOSE_PLUGINS"
        )
    return found


def portable_worker(vllm_config: Any, kv_cache_config: Any, cpu_bytes: int, **options: Any) -> Any:
    """The installed ``cpu-offload`` type's portable worker."""
    return _cpu_offload("portable_worker")(vllm_config, kv_cache_config, cpu_bytes, **options)


@contextmanager
def _all_cores() -> Iterator[None]:
    # vLLM's CPU platform pins the process to one core when it builds a config; give the copy
    # thread back what the benchmark started with.
    cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    try:
        yield
    finally:
        if cores is not None:
            os.sched_setaffinity(0, cores)


@contextmanager
def _one_core() -> Iterator[int | None]:
    """Run the host-memory baselines and the worker's copy threads (created inside) on one core.

    Both sides then run on the same core: on this 2-vCPU machine one core copied at 6-11 GB/s
    while the other gave 10-11 in the same minute, so a copy thread that landed on the other
    core than the baseline's thread moved the ratio by up to 2x (docs/performance.md, section 4).
    The main thread only waits while a copy thread runs, so sharing a core costs neither side.
    """
    if not hasattr(os, "sched_getaffinity"):
        yield None
        return
    cores = os.sched_getaffinity(0)
    core = min(cores)
    os.sched_setaffinity(0, {core})
    try:
        yield core
    finally:
        os.sched_setaffinity(0, cores)


def _ids(pattern: str, n: int, first: int, last: int, gen: torch.Generator) -> list[int]:
    """``n`` distinct block ids in ``[first, last)``: random, or one run at a random start."""
    if pattern == "scattered":
        return (torch.randperm(last - first, generator=gen)[:n] + first).tolist()
    start = first + int(torch.randint(0, last - first - n + 1, (1,), generator=gen))
    return list(range(start, start + n))


def targets(sizes: tuple[int, ...], disk_sizes: tuple[int, ...] = ()) -> AllTargets:
    """The issue's targets: median ratio to a contiguous memcpy (disk: to sequential file I/O), per case."""
    items = []
    # The sequential write/read bounds runs of consecutive disk slots; scattered slots are random
    # I/O, bounded by the device's random rate, and are reported without a target.
    for size in disk_sizes:
        for direction in ("store", "load"):
            items.append(CaseTarget(">=", 0.8, SUBJECT, FILE_IO, f"disk {direction} {_label(size)} consecutive"))
    for size in sizes:
        for pattern in PATTERNS:
            value = 0.9 if pattern == "consecutive" else 0.8 if size >= 256 * KIB else 0.5
            for direction in ("store", "load"):
                items.append(CaseTarget(">=", value, SUBJECT, MEMCPY, f"{direction} {_label(size)} {pattern}"))
    return AllTargets(
        ">=",
        0.5,
        SUBJECT,
        MEMCPY,
        items=tuple(items),
        summary=f"{SUBJECT}/{MEMCPY}: scattered >= 0.5 below 256 KiB, >= 0.8 from 256 KiB; consecutive >= 0.9"
        + (f"; disk, consecutive slots: {SUBJECT}/{FILE_IO} >= 0.8" if disk_sizes else ""),
    )


def run(
    quick: bool = False,
    sizes: tuple[int, ...] | None = None,
    repeats: int | None = None,
    bytes_per_copy: int | None = None,
    disk_sizes: tuple[int, ...] | None = None,
) -> Result:
    """Store and load throughput per block size and pattern; ratios to a contiguous memcpy
    (host tier) and to sequential file I/O (disk tier, ``disk_sizes``: none in quick mode)."""
    sizes = tuple(sizes or pick(SIZES, quick, QUICK_SIZES))
    disk_sizes = tuple(() if quick else DISK_SIZES) if disk_sizes is None else tuple(disk_sizes)
    disk_dir = os.environ.get("KVCOMPOSE_BENCH_DISK_DIR") or tempfile.gettempdir()
    unknown = [s for s in (*sizes, *disk_sizes) if s not in GEOMETRY]
    if unknown:
        raise ValueError(f"cpu_copy: no model geometry for block sizes {unknown}; choose from {list(GEOMETRY)}")
    per_copy = bytes_per_copy or (8 if quick else 64) * MIB
    reps = repeats or repeats_for(quick, full=9)
    gen = torch.Generator().manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: the worker copies on one copy thread per direction
    try:
        cases, ratios = [], []
        with _one_core() as core:
            for size in sizes:
                c, r = _sweep(GEOMETRY[size], per_copy, reps, gen)
                cases += c
                ratios += r
        # The disk tier pipelines its staging copies with an I/O thread: it keeps every core.
        for size in disk_sizes:
            c, r = _disk_sweep(GEOMETRY[size], per_copy, reps, gen, disk_dir)
            cases += c
            ratios += r
    finally:
        torch.set_num_threads(threads)
    return Result(
        "cpu_copy",
        f"CPU tier data path: portable worker vs {MEMCPY}",
        "GB/s",
        1e-9,
        cases,
        ratios,
        targets(sizes, disk_sizes),
        reps,
        quick,
        [
            f"engine-laid-out KV ({NUM_LAYERS} layers, vLLM's CPU layout LBHNC, bfloat16); a block is one layer's "
            "page (K and V); a sample moves every layer's page of each block",
            "portable worker: from the metadata to the bytes in place (copy thread included); "
            f"{MEMCPY}: one memmove of the same bytes; {LOOP}: torch dst[d].copy_(src[s]) per block and layer",
            "one thread per copy; the machine is shared (2 cores), so samples are interleaved and judged on medians",
            "host memory: every side on one core"
            + (f" (core {core}: the baselines' thread and the worker's copy threads)" if core is not None else ""),
        ]
        + (
            [
                f"disk: the worker with backend disk (O_DIRECT) in {disk_dir}; {FILE_IO}: one pwrite (store) or "
                "pread (load) of the same bytes, O_DIRECT, same directory, from a buffer in huge pages; "
                f"{FILE_IO_SMALL_PAGES}: the same from an ordinary mapping"
            ]
            if disk_sizes
            else []
        ),
        {
            "bytes_per_copy": per_copy,
            "sizes": list(sizes),
            "layers": NUM_LAYERS,
            "threads": 1,
            "geometry": {_label(s): GEOMETRY[s].model for s in (*sizes, *disk_sizes)},
            "disk_sizes": list(disk_sizes),
            "disk_dir": disk_dir if disk_sizes else None,
        },
    )


def _copy_loops(worker: Any) -> str | None:
    """The copy loops the worker's transfers used since the last call (``"+"``-joined when
    several); ``None`` from a plugin that does not report them."""
    take = getattr(worker, "take_copy_loops", None)
    if take is None:
        return None
    return "+".join(sorted(take())) or None


def _engine_worker(geo: Geometry, pool: int, **options: Any) -> tuple[Any, Any]:
    """An engine-laid-out KV cache of ``pool`` usable blocks and a portable worker registered on it."""
    from kvcompose.testing.kv import fill_random, make_engine_kv

    with _all_cores():
        kv = make_engine_kv(
            num_layers=NUM_LAYERS,
            block_size=geo.block_size,
            num_blocks=pool + 1,  # block 0 is vLLM's null block
            num_kv_heads=geo.num_kv_heads,
            head_size=geo.head_size,
            dtype=geo.dtype,
        )
        fill_random(kv)
        worker = portable_worker(kv.vllm_config, kv.kv_cache_config, pool * geo.bytes * NUM_LAYERS, **options)
        worker.register_kv_caches(kv.kv_caches)
    return kv, worker


def _through_worker(worker: Any, nbytes: int) -> Callable[[int, bool, list[int], list[int]], float]:
    """A sample: one store or load through the worker's engine calls, until the bytes are in place."""
    from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadMetadata

    flush = SimpleCPUOffloadMetadata(need_flush=True)
    event = 0

    def sample(_r: int, is_store: bool, src: list[int], dst: list[int]) -> float:
        nonlocal event
        event += 1
        if is_store:
            meta = SimpleCPUOffloadMetadata(store_event=event, store_gpu_blocks=src, store_cpu_blocks=dst)
        else:
            meta = SimpleCPUOffloadMetadata(
                load_event=event, load_cpu_blocks=src, load_gpu_blocks=dst, load_event_to_reqs={event: ["bench"]}
            )
        worker.bind_connector_metadata(meta)
        t0 = time.perf_counter()
        (worker.wait_for_save if is_store else worker.start_load_kv)()
        worker.handle_preemptions(flush)  # starts a store, waits for the copy thread: the bytes are in place
        dt = time.perf_counter() - t0
        worker.get_finished(set())
        worker.build_connector_worker_meta()
        worker.clear_connector_metadata()
        return nbytes / dt

    return sample


def _sweep(geo: Geometry, per_copy: int, reps: int, gen: torch.Generator) -> tuple[list[Case], list[Any]]:
    size = geo.bytes
    n = max(1, per_copy // (size * NUM_LAYERS))
    pool = 2 * n  # room for the ids to scatter
    kv, worker = _engine_worker(geo, pool)
    regions = [(worker.gpu_kv_caches[name], worker.cpu_kv_caches[name]) for name in worker.gpu_kv_caches]
    if [r.shape[1] * r.element_size() for r, _ in regions] != [size] * NUM_LAYERS:
        raise RuntimeError(f"cpu_copy: expected {NUM_LAYERS} regions of {size} bytes per block from the engine layout")
    nbytes = n * size * NUM_LAYERS
    flat_src = torch.randint(-128, 128, (nbytes,), dtype=torch.int8, generator=gen)
    flat_dst = torch.zeros(nbytes, dtype=torch.int8)
    through_worker = _through_worker(worker, nbytes)

    def memcpy(_r: int) -> float:
        t0 = time.perf_counter()
        ctypes.memmove(flat_dst.data_ptr(), flat_src.data_ptr(), nbytes)
        return nbytes / (time.perf_counter() - t0)

    cases: list[Case] = []
    ratios = []
    try:
        for pattern in PATTERNS:
            dev_ids, host_ids = _ids(pattern, n, 1, pool + 1, gen), _ids(pattern, n, 0, pool, gen)
            for direction in ("store", "load"):
                is_store = direction == "store"
                src, dst = (dev_ids, host_ids) if is_store else (host_ids, dev_ids)

                def subject(_r: int, src: list[int] = src, dst: list[int] = dst, is_store: bool = is_store) -> float:
                    return through_worker(_r, is_store, src, dst)

                def loop(_r: int, src: list[int] = src, dst: list[int] = dst, is_store: bool = is_store) -> float:
                    t0 = time.perf_counter()
                    for device, host in regions:
                        a, b = (device, host) if is_store else (host, device)
                        for s, d in zip(src, dst):
                            b[d].copy_(a[s])
                    return nbytes / (time.perf_counter() - t0)

                _check(regions, subject, dev_ids, host_ids, is_store, f"{direction} {_label(size)} {pattern}")
                memcpy(0), loop(0)  # first touch of the pages
                _copy_loops(worker)  # from here on, this case's samples only
                samples = interleave({MEMCPY: memcpy, LOOP: loop, SUBJECT: subject}, reps)
                label = f"{direction} {_label(size)} {pattern}"
                extra = {"block_bytes": size, "blocks": n, "layers": NUM_LAYERS, "pattern": pattern}
                extra["copy_loop"] = _copy_loops(worker)
                cases.append(Case(label, samples, {**extra, "direction": direction, "model": geo.model}))
                ratios.append(ratio(label, samples, SUBJECT, MEMCPY, higher_is_better=True))
                ratios.append(ratio(label, samples, SUBJECT, LOOP, higher_is_better=True))
    finally:
        worker.shutdown()
    return cases, ratios


def _check(
    regions: list[tuple[torch.Tensor, torch.Tensor]],
    subject: Callable[[int], float],
    dev_ids: list[int],
    host_ids: list[int],
    is_store: bool,
    label: str,
) -> None:
    """One copy by the worker alone, into a scrambled destination: what is timed really copies."""
    dev_idx, host_idx = torch.tensor(dev_ids), torch.tensor(host_ids)
    for device, host in regions:
        (host if is_store else device)[host_idx if is_store else dev_idx] = -1
    subject(0)
    for device, host in regions:
        if not torch.equal(host[host_idx], device[dev_idx]):
            raise RuntimeError(f"cpu_copy: the worker did not move the blocks ({label})")


def _disk_sweep(
    geo: Geometry, per_copy: int, reps: int, gen: torch.Generator, directory: str
) -> tuple[list[Case], list[Any]]:
    """The disk tier's stores and loads against one sequential write and read of the same bytes."""
    size = geo.bytes
    n = max(1, per_copy // (size * NUM_LAYERS))
    pool = 2 * n
    nbytes = n * size * NUM_LAYERS
    os.makedirs(directory, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="kvcompose-bench-disk-", dir=directory)
    kv, worker = _engine_worker(
        geo,
        pool,
        kv_offload_backend="disk",
        disk_path=os.path.join(tmp, "kv.bin"),
        disk_capacity_bytes=pool * size * NUM_LAYERS,
    )
    through_worker = _through_worker(worker, nbytes)
    regions = list(worker.gpu_kv_caches.values())
    plain = os.path.join(tmp, "sequential.bin")
    fd = os.open(plain, os.O_RDWR | os.O_CREAT | getattr(os, "O_DIRECT", 0), 0o600)
    small_pages = mmap.mmap(-1, nbytes)  # page-aligned, as O_DIRECT wants
    bufs = {FILE_IO: _cpu_offload("huge_page_buffer")(nbytes), FILE_IO_SMALL_PAGES: memoryview(small_pages)}
    data = os.urandom(min(nbytes, MIB)) * (nbytes // min(nbytes, MIB))
    for view in bufs.values():
        view[:] = data

    def sequential(which: str, is_store: bool) -> float:
        t0 = time.perf_counter()
        done = os.pwritev(fd, [bufs[which]], 0) if is_store else os.preadv(fd, [bufs[which]], 0)
        dt = time.perf_counter() - t0
        if done != nbytes:
            raise RuntimeError(f"cpu_copy: short sequential {'write' if is_store else 'read'} ({done} of {nbytes})")
        return nbytes / dt

    cases: list[Case] = []
    ratios = []
    try:
        sequential(FILE_IO, True)  # allocate the file's blocks before the first timed write
        for pattern in PATTERNS:
            dev_ids, slots = _ids(pattern, n, 1, pool + 1, gen), _ids(pattern, n, 0, pool, gen)
            for direction in ("store", "load"):
                is_store = direction == "store"
                src, dst = (dev_ids, slots) if is_store else (slots, dev_ids)
                label = f"disk {direction} {_label(size)} {pattern}"

                def subject(_r: int, src: list[int] = src, dst: list[int] = dst, is_store: bool = is_store) -> float:
                    return through_worker(_r, is_store, src, dst)

                def baseline(_r: int, is_store: bool = is_store) -> float:
                    return sequential(FILE_IO, is_store)

                def small_pages_baseline(_r: int, is_store: bool = is_store) -> float:
                    return sequential(FILE_IO_SMALL_PAGES, is_store)

                if not is_store:  # what the store wrote comes back into scrambled blocks
                    before = [r[dev_ids].clone() for r in regions]
                    for r in regions:
                        r[dev_ids] = -1
                    subject(0)
                    if not all(torch.equal(r[dev_ids], b) for r, b in zip(regions, before)):
                        raise RuntimeError(f"cpu_copy: the disk tier did not bring the blocks back ({label})")
                _copy_loops(worker)  # from here on, this case's samples only
                samples = interleave(
                    {FILE_IO: baseline, SUBJECT: subject, FILE_IO_SMALL_PAGES: small_pages_baseline}, reps
                )
                extra = {"block_bytes": size, "blocks": n, "layers": NUM_LAYERS, "pattern": pattern, "tier": "disk"}
                extra["copy_loop"] = _copy_loops(worker)
                cases.append(Case(label, samples, {**extra, "direction": direction, "model": geo.model}))
                ratios.append(ratio(label, samples, SUBJECT, FILE_IO, higher_is_better=True))
                ratios.append(ratio(label, samples, SUBJECT, FILE_IO_SMALL_PAGES, higher_is_better=True))
    finally:
        os.close(fd)
        for view in bufs.values():
            view.release()  # a mapping with a view on it cannot close
        small_pages.close()
        worker.shutdown()
        os.unlink(plain)
        os.rmdir(tmp)
    return cases, ratios
