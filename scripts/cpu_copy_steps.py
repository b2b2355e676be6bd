"""The CPU tier's copy path step by step, each against a contiguous memcpy (docs/performance.md, 4).

Not part of ``kvcompose bench``: it measures the alternatives the cpu-offload plugin's host copy
path was chosen from, on the same engine-laid-out KV as ``tools/kvcompose_tools/bench/cpu_copy.py`` (8
layers, vLLM's CPU layout), one thread, every step interleaved with the memcpy:

0. before: the worker at 1c6948b (``index_select`` + ``index_copy_`` per layer region for
   scattered ids, one slice copy per run when runs average 4 blocks or more), synchronous;
1. a torch ``copy_`` per block and layer;
2. a numpy assignment per block and layer;
3. a numpy assignment per run of consecutive ids and layer;
4. a numpy assignment per run for every layer at once (pool laid out ``[block, layer, bytes]``);
5. step 4 on the worker's store/load thread, through the worker's engine calls (what ships).

Usage: ``python scripts/cpu_copy_steps.py [--repeats 9] [--mib 64]`` (needs the plugin).
"""

# The closures below are timed inside the loop iteration that made them.
# ruff: noqa: B023

from __future__ import annotations

import argparse
import ctypes
import time
from collections.abc import Callable

import torch

from kvcompose_cpu_offload.block_copy import as_array, contiguous_runs, copy_runs
from kvcompose_tools.bench.cpu_copy import GEOMETRY, NUM_LAYERS, _engine_worker, _ids, _label, _through_worker
from kvcompose_tools.bench.measure import interleave

STEPS = (
    "0 before (index_select)",
    "1 torch copy_ per block",
    "2 numpy per block",
    "3 + runs",
    "4 + layers stacked",
    "5 + copy thread (worker)",
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--mib", type=int, default=64, help="bytes moved per sample, MiB")
    args = ap.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    print("case | " + " | ".join(STEPS) + "   (median ratio to a contiguous memcpy)")
    for size in (16 * 1024, 256 * 1024, 2 * 1024 * 1024):
        geo = GEOMETRY[size]
        n = max(1, args.mib * 2**20 // (size * NUM_LAYERS))
        pool = 2 * n
        _kv, worker = _engine_worker(geo, pool)
        nbytes = n * size * NUM_LAYERS
        sample = _through_worker(worker, nbytes)
        dev = list(worker.gpu_kv_caches.values())
        stacked = list(worker.cpu_kv_caches.values())  # the worker's pool: [block, layer, bytes]
        separate = [torch.zeros_like(r[:pool]) for r in dev]  # the pool before: a tensor per layer
        dev_np, sep_np = [as_array(r) for r in dev], [as_array(r) for r in separate]
        dev3 = as_array(
            dev[0].as_strided((dev[0].shape[0], NUM_LAYERS, size), (size, dev[1].data_ptr() - dev[0].data_ptr(), 1))
        )
        host3 = as_array(stacked[0].as_strided((pool, NUM_LAYERS, size), (NUM_LAYERS * size, size, 1)))
        flat_a, flat_b = torch.ones(nbytes, dtype=torch.int8), torch.zeros(nbytes, dtype=torch.int8)
        for pattern in ("scattered", "consecutive"):
            dev_ids, host_ids = _ids(pattern, n, 1, pool + 1, gen), _ids(pattern, n, 0, pool, gen)
            for direction in ("store", "load"):
                st = direction == "store"
                src, dst = (dev_ids, host_ids) if st else (host_ids, dev_ids)
                runs = contiguous_runs(src, dst)
                s_idx, d_idx = torch.tensor(src), torch.tensor(dst)

                def timed(fn: Callable[[], None]) -> Callable[[int], float]:
                    def run(_r: int) -> float:
                        t0 = time.perf_counter()
                        fn()
                        return nbytes / (time.perf_counter() - t0)

                    return run

                def pairs() -> list[tuple[torch.Tensor, torch.Tensor]]:
                    return [(d, h) if st else (h, d) for d, h in zip(dev, separate)]

                def before() -> None:
                    for a, b in pairs():
                        if len(runs) * 4 <= len(src) or len(runs) == 1:
                            for s, d, k in runs:
                                b[d : d + k].copy_(a[s : s + k])
                        else:
                            b.index_copy_(0, d_idx, a.index_select(0, s_idx))

                def torch_loop() -> None:
                    for a, b in pairs():
                        for s, d in zip(src, dst):
                            b[d].copy_(a[s])

                def numpy_loop() -> None:
                    for d_, h_ in zip(dev_np, sep_np):
                        a, b = (d_, h_) if st else (h_, d_)
                        for s, d in zip(src, dst):
                            b[d] = a[s]

                def numpy_runs() -> None:
                    for d_, h_ in zip(dev_np, sep_np):
                        copy_runs(*((d_, h_) if st else (h_, d_)), runs)

                def stacked_runs() -> None:
                    copy_runs(*((dev3, host3) if st else (host3, dev3)), runs)

                subjects: dict[str, Callable[[int], float]] = {
                    "memcpy": timed(lambda: ctypes.memmove(flat_b.data_ptr(), flat_a.data_ptr(), nbytes)),
                    STEPS[0]: timed(before),
                    STEPS[1]: timed(torch_loop),
                    STEPS[2]: timed(numpy_loop),
                    STEPS[3]: timed(numpy_runs),
                    STEPS[4]: timed(stacked_runs),
                    STEPS[5]: lambda r, st=st, src=src, dst=dst: sample(r, st, src, dst),
                }
                for fn in subjects.values():
                    fn(0)
                got = interleave(subjects, args.repeats)
                base = got["memcpy"].median
                cells = " | ".join(f"{got[s].median / base:.2f}" for s in STEPS)
                print(f"{direction} {_label(size)} {pattern} | {cells}   (memcpy {base / 1e9:.1f} GB/s)", flush=True)
        worker.shutdown()


if __name__ == "__main__":
    main()
