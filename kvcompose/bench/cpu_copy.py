"""Benchmark 4: the CPU tier's copy path, the portable worker's backend vs a torch gather/scatter.

Subject: ``TorchCopyBackend.launch_copy`` of the cpu-offload plugin (what the portable worker
runs for every store and load), over a ``[num_blocks, block_bytes]`` KV region and a pool region
of the same shape, as vLLM's worker lays them out. Baseline: ``index_select`` + ``index_copy_``
of the same blocks with index tensors built beforehand (the bound on one thread here).

The backend comes from the installed ``cpu-offload`` connector type (its ``copy_backend()``),
not from an import: the core reaches plugins only through what they register.

Two block-id patterns: ``scattered`` (a random permutation: a fragmented pool) and ``runs``
(consecutive ids, what a fresh pool hands out; the backend copies each run as one slice).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from kvcompose.bench.measure import interleave, pick, ratio, repeats_for
from kvcompose.bench.report import Case, Result, Target

KIB = 1024
SIZES = (16 * KIB, 64 * KIB, 256 * KIB, 2048 * KIB)
QUICK_SIZES = (16 * KIB, 2048 * KIB)
PATTERNS = ("scattered", "runs")


def _label(size: int) -> str:
    return f"{size // KIB} KiB" if size < 1024 * KIB else f"{size // (1024 * KIB)} MiB"


def _ids(pattern: str, n: int, pool: int, gen: torch.Generator) -> list[int]:
    if pattern == "scattered":
        return torch.randperm(pool, generator=gen)[:n].tolist()
    start = int(torch.randint(0, pool - n + 1, (1,), generator=gen))
    return list(range(start, start + n))


def copy_backend() -> Any:
    """A new copy backend from the installed ``cpu-offload`` type; a clear error without the plugin."""
    from kvcompose.plugins import get_plugins

    make = getattr(get_plugins().connector_types.get("cpu-offload"), "copy_backend", None)
    if make is None:
        raise RuntimeError(
            "cpu_copy measures the cpu-offload plugin's copy backend: install kvcompose-cpu-offload "
            "(plugins/cpu_offload) and leave it enabled in KVCOMPOSE_PLUGINS"
        )
    return make()


def run(
    quick: bool = False,
    sizes: tuple[int, ...] | None = None,
    repeats: int | None = None,
    bytes_per_copy: int | None = None,
) -> Result:
    """Store and load throughput per block size and pattern; ratio portable / torch gather-scatter."""
    sizes = tuple(sizes or pick(SIZES, quick, QUICK_SIZES))
    per_copy = bytes_per_copy or (8 if quick else 64) * 1024 * KIB
    reps = repeats or repeats_for(quick, full=9)
    gen = torch.Generator().manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the bound is one thread's; vLLM may have changed the count
    try:
        cases, ratios = _sweep(sizes, per_copy, reps, gen)
    finally:
        torch.set_num_threads(threads)
    return Result(
        "cpu_copy",
        "CPU tier copy path: portable worker vs torch gather/scatter",
        "GB/s",
        1e-9,
        cases,
        ratios,
        Target(">=", 0.8, "portable worker", "torch gather/scatter"),
        reps,
        quick,
        [
            "one torch thread (the copy runs in the worker's thread); the baseline's index tensors are built "
            "beforehand, the portable worker builds its own from the block lists on every call",
            "'runs' = consecutive block ids: the portable worker copies each run as one slice, which beats a gather",
        ],
        {"bytes_per_copy": per_copy, "sizes": list(sizes), "threads": 1},
    )


def _sweep(sizes: tuple[int, ...], per_copy: int, reps: int, gen: torch.Generator) -> tuple[list[Case], list[Any]]:
    cases: list[Case] = []
    ratios = []
    for size in sizes:
        n = max(1, per_copy // size)
        pool = 2 * n  # room for the ids to scatter
        device = torch.randint(0, 255, (pool, size), dtype=torch.uint8, generator=gen)
        host = torch.zeros((pool, size), dtype=torch.uint8)
        backend = copy_backend()
        backend.init({"kv": device}, {"kv": host})
        for pattern in PATTERNS:
            dev_ids, host_ids = _ids(pattern, n, pool, gen), _ids(pattern, n, pool, gen)
            events: list[tuple[int, Any]] = []
            for direction in ("store", "load"):
                is_store = direction == "store"
                # launch_copy takes (source ids, destination ids): device -> pool, or pool -> device.
                src, dst = (dev_ids, host_ids) if is_store else (host_ids, dev_ids)
                a, b = (device, host) if is_store else (host, device)
                s_idx, d_idx = torch.tensor(src), torch.tensor(dst)

                def portable(_r: int, src: list[int] = src, dst: list[int] = dst, is_store: bool = is_store) -> float:
                    events.clear()
                    t0 = time.perf_counter()
                    backend.launch_copy(src, dst, is_store, 0, events)
                    return n * size / (time.perf_counter() - t0)

                def gather(
                    _r: int,
                    a: torch.Tensor = a,
                    b: torch.Tensor = b,
                    s_idx: torch.Tensor = s_idx,
                    d_idx: torch.Tensor = d_idx,
                ) -> float:
                    t0 = time.perf_counter()
                    b.index_copy_(0, d_idx, a.index_select(0, s_idx))
                    return n * size / (time.perf_counter() - t0)

                portable(0), gather(0)  # first touch of the pages
                samples = interleave({"torch gather/scatter": gather, "portable worker": portable}, reps)
                label = f"{direction} {_label(size)} {pattern}"
                cases.append(
                    Case(label, samples, {"block_bytes": size, "blocks": n, "pattern": pattern, "direction": direction})
                )
                ratios.append(ratio(label, samples, "portable worker", "torch gather/scatter", higher_is_better=True))
            # What was timed really copied: the pool holds the device blocks it stored.
            if not torch.equal(host[torch.tensor(host_ids)], device[torch.tensor(dev_ids)]):
                raise RuntimeError(f"cpu_copy: the pool does not hold the stored blocks ({_label(size)}, {pattern})")
        del device, host
    return cases, ratios
