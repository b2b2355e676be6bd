"""Where an engine's threads run: vLLM binds them itself; the kit can spread them once it is up."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping
from typing import Any

#: Set to 1 (``make test`` does, for the engine tests), the kit calls :func:`spread_group` on
#: every engine it starts once it is up. Off by default: the benchmarks and the demo measure
#: vLLM's own thread layout, and spreading costs decode TTFT there (docs/e2e.md, cold start).
SPREAD_ENV = "KVCOMPOSE_SPREAD_ENGINE_THREADS"


#: vLLM's CPU platform variable that names each worker's cores; unset or ``auto``, vLLM picks them.
OMP_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def engine_up(proc: subprocess.Popen[Any], env: Mapping[str, str]) -> None:
    """What the kit does to an engine's processes once it is up: :func:`spread_group` where
    :data:`SPREAD_ENV` asks for it and vLLM's auto-bind placed the engine (``env``, the engine's
    environment, names no cores in :data:`OMP_BIND_ENV`).

    An engine whose cores were named keeps them: a TP-2 decode with a core per worker, spread,
    often missed vLLM's fixed 5 s NIXL handshake timeout, bound it did not (docs/e2e.md, cold
    start)."""
    if os.environ.get(SPREAD_ENV) == "1" and env.get(OMP_BIND_ENV, "auto") == "auto":
        spread_group(proc)


def spread_group(proc: subprocess.Popen[Any]) -> int:
    """Let every thread of ``proc``'s process group (started by :func:`start_group`) run on every
    CPU this process may use; the number of threads changed.

    vLLM's CPU platform binds each engine's worker main (OpenMP) thread to the cores its auto-bind
    picks and confines the worker's other threads, the NIXL agent's among them, to its reserved
    CPU. Its auto-bind does not know about the other engines on the host, so on a 2-core host
    every engine lands on the same two single cores, and a new P/D pair's first READ then often
    stalls until the prefill's lease expires (measured in docs/e2e.md, cold start). The
    engines' thread counts are fixed by then, so their answers do not change.
    """
    cpus = os.sched_getaffinity(0)
    changed = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if os.getpgid(int(entry.name)) != proc.pid:
                continue
            tids = [int(t) for t in os.listdir(f"/proc/{entry.name}/task")]
        except OSError:  # ended meanwhile, or not ours to read
            continue
        for tid in tids:
            try:
                if os.sched_getaffinity(tid) != cpus:
                    os.sched_setaffinity(tid, cpus)
                    changed += 1
            except OSError:
                continue
    return changed
