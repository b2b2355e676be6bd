"""Benchmark 5a: KV block READ between two NIXL agents in two processes, vs a memcpy gather.

The target process registers a DRAM pool and publishes it as blocks of each size; this process
(the decode side) READs a random permutation of those blocks into a registered buffer, as a
decode instance pulls a prompt's scattered blocks, and checks every byte it read. Baseline: a
one-thread ``torch.index_select`` gather of the same bytes in the same pattern, in this process.

Agents run without a progress thread (DRAM) and with ``ucx_error_handling_mode=none``
(NIXL's default progress thread busy-spins a core, and with errmode
``none`` notifications use shared memory and no target progress is needed).

``memory="VRAM"`` puts the target's pool, the reader's buffer and the baseline on the first CUDA
device instead (``"VRAM"`` descriptors; UCX picks the transport, GPU to GPU with ``cuda_ipc``
where it offers it, through host memory where not) and enables the agents' progress threads
(without them a VRAM READ stays in ``PROC``); the baseline is then ``index_select`` on that
device. Not in
``kvcompose bench`` (there is no GPU here): ``python -c "from kvcompose_tools.bench import nixl_read;
print(nixl_read.run(memory='VRAM').table())"`` on a CUDA machine with ``nixl-cu12`` or
``nixl-cu13``. Block sizes: the
per-layer K or V block of common models at vLLM's block size 16 (16 KiB: 8 KV heads x 64 dims
fp16; 32 KiB: 8 x 128, Llama-3-8B; 64 KiB: 16 x 128) and the larger blocks of MLA/HND layouts.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from multiprocessing.connection import Connection
from typing import Any

from kvcompose_tools.bench.measure import interleave, pick, ratio, repeats_for
from kvcompose_tools.bench.report import Case, Result

KIB = 1024
SIZES = (16 * KIB, 32 * KIB, 64 * KIB, 256 * KIB, 2048 * KIB)
QUICK_SIZES = (16 * KIB, 256 * KIB)


def _agent(name: str, memory: str = "DRAM") -> Any:
    from nixl._api import nixl_agent, nixl_agent_config

    # VRAM: UCX's GPU transfers need the target's progress too (a READ stays in PROC without it).
    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=memory == "VRAM", backends=[]))
    agent.create_backend("UCX", {"ucx_error_handling_mode": "none"})
    return agent


MEMORY = ("DRAM", "VRAM")


def _device(memory: str) -> str:
    """The torch device of ``memory`` (a NIXL memory type: :data:`MEMORY`)."""
    import torch

    if memory not in MEMORY:
        raise ValueError(f"nixl_read: memory must be one of {MEMORY}, not {memory!r}")
    if memory == "VRAM" and not torch.cuda.is_available():
        raise RuntimeError("nixl_read: memory='VRAM' needs a CUDA device, and torch sees none here")
    return "cuda:0" if memory == "VRAM" else "cpu"


def _pattern(pool_bytes: int, device: str = "cpu") -> Any:
    import torch

    return (torch.arange(pool_bytes // 8, dtype=torch.int64, device=device) * 7 + 1000).view(torch.uint8)


def _blocks(base: int, size: int, count: int) -> Any:
    import numpy as np

    descs = np.zeros((count, 3), dtype=np.uint64)
    descs[:, 0] = base + np.arange(count, dtype=np.uint64) * size
    descs[:, 1] = size
    return descs


def _target(conn: Connection, pool_bytes: int, sizes: list[int], memory: str = "DRAM") -> None:
    """The prefill side: publish the pool as blocks of every size, then wait to be told to stop."""
    agent = _agent("kvcompose-bench-target", memory)
    buf = _pattern(pool_bytes, _device(memory))
    agent.register_memory(buf)
    descs = {
        size: agent.get_serialized_descs(
            agent.get_xfer_descs(_blocks(buf.data_ptr(), size, pool_bytes // size), memory)
        )
        for size in sizes
    }
    conn.send((agent.get_agent_metadata(), descs))
    agent.add_remote_agent(conn.recv())
    conn.recv()  # "stop"


def run(
    quick: bool = False, sizes: tuple[int, ...] | None = None, repeats: int | None = None, memory: str = "DRAM"
) -> Result:
    """READ throughput per block size; ratio NIXL READ / memcpy gather (higher is better)."""
    import numpy as np
    import torch

    device = _device(memory)
    sizes = tuple(sizes or pick(SIZES, quick, QUICK_SIZES))
    pool_bytes = (64 if quick else 256) * 1024 * KIB
    per_read = (16 if quick else 64) * 1024 * KIB
    reps = repeats or repeats_for(quick, full=9)
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(there, pool_bytes, list(sizes), memory), daemon=True)
    proc.start()
    cases: list[Case] = []
    ratios = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the CPU baseline gathers on one thread, as NIXL's READ is one caller's syscalls
    baseline_threads = torch.get_num_threads()
    try:
        if not here.poll(120):
            raise RuntimeError("nixl_read: the target process did not publish its agent within 120 s")
        remote_md, remote_descs = here.recv()
        agent = _agent("kvcompose-bench-initiator", memory)
        dst = torch.zeros(per_read, dtype=torch.uint8, device=device)
        agent.register_memory(dst)
        peer = agent.add_remote_agent(remote_md).decode()
        here.send(agent.get_agent_metadata())
        src = _pattern(pool_bytes, device)  # the same bytes, here, for the memcpy baseline and the check
        gen = np.random.default_rng(0)
        for size in sizes:
            nb = per_read // size
            local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", _blocks(dst.data_ptr(), size, nb), memory)
            remote = agent.prep_xfer_dlist(peer, agent.deserialize_descs(remote_descs[size]))
            perm = gen.permutation(pool_bytes // size)[:nb].astype(np.int32)
            handle = agent.make_prepped_xfer("READ", local, np.arange(nb, dtype=np.int32), remote, perm)
            src_rows, dst_rows = src.view(-1, size), dst.view(-1, size)
            idx = torch.from_numpy(perm.astype(np.int64)).to(device)
            copy_rows = torch.empty_like(dst_rows)

            def read(_r: int) -> float:
                t0 = time.perf_counter()
                state = agent.transfer(handle)
                while state == "PROC":
                    state = agent.check_xfer_state(handle)
                elapsed = time.perf_counter() - t0
                if state != "DONE":
                    raise RuntimeError(f"nixl_read: READ of {nb} x {size} B ended in state {state}")
                return per_read / elapsed

            def memcpy(_r: int) -> float:
                t0 = time.perf_counter()
                torch.index_select(src_rows, 0, idx, out=copy_rows)
                if device != "cpu":
                    torch.cuda.synchronize(device)
                return per_read / (time.perf_counter() - t0)

            read(0), memcpy(0)
            dst.zero_()
            samples = interleave({"memcpy gather": memcpy, "NIXL READ": read}, reps)
            if not torch.equal(dst_rows, src_rows[idx]):
                raise RuntimeError(f"nixl_read: the bytes READ for {size} B blocks differ from the target's")
            handle.release()
            label = f"{size // KIB} KiB x {nb}"
            cases.append(Case(label, samples, {"block_bytes": size, "blocks_per_read": nb}))
            ratios.append(ratio(label, samples, "NIXL READ", "memcpy gather", higher_is_better=True))
        agent.remove_remote_agent(peer)
    finally:
        torch.set_num_threads(threads)
        if proc.is_alive():
            here.send("stop")
            proc.join(30)
        if proc.is_alive():
            proc.kill()
    return Result(
        "nixl_read",
        f"P/D data path: NIXL READ between two processes ({memory}, UCX) vs memcpy gather",
        "GB/s",
        1e-9,
        cases,
        ratios,
        None,
        reps,
        quick,
        [
            "agents: UCX ucx_error_handling_mode=none; "
            + (
                "no progress thread; UCX moves DRAM with CMA (process_vm_readv), one syscall per block"
                if memory == "DRAM"
                else f"progress threads on; both processes on {torch.cuda.get_device_name(0)}; "
                "memcpy gather: index_select on that device"
            ),
            "remote blocks are a random permutation of the target's pool (no descriptor merging), every byte checked",
            "memcpy gather on the CPU: torch with one thread (torch.set_num_threads(1) while the benchmark runs)",
        ],
        {
            "pool_bytes": pool_bytes,
            "bytes_per_read": per_read,
            "sizes": list(sizes),
            "memory": memory,
            "baseline_threads": baseline_threads if device == "cpu" else None,
        },
    )
