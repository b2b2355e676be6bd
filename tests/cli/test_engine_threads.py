"""The kit lets every thread of an engine's process group use every CPU once the engine is up
(:func:`kvcompose.e2e.node.spread_group`), as vLLM's CPU platform would otherwise leave them
pinned to one core each (``docs/e2e.md``, cold start)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from kvcompose.e2e.node import spread_group, start_group, stop_group

#: A group leader with a child process, each with a second thread, all pinned to one CPU the way
#: vLLM pins a worker's threads; each process prints its pid and its thread's id.
PINNED = textwrap.dedent(
    """
    import os, subprocess, sys, threading, time
    os.sched_setaffinity(0, {{{cpu}}})
    t = threading.Thread(target=time.sleep, args=(600,), daemon=True)
    t.start()
    print(os.getpid(), t.native_id, flush=True)
    if len(sys.argv) > 1:
        subprocess.Popen([sys.executable, "-c", sys.argv[1]])
    time.sleep(600)
    """
)


def test_every_thread_of_the_group_may_use_every_cpu_once_spread() -> None:
    cpus = os.sched_getaffinity(0)
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")
    one = min(cpus)
    code = PINNED.format(cpu=one)
    proc = start_group("pinned", [sys.executable, "-c", code, code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        tids = [int(t) for _ in range(2) for t in proc.stdout.readline().split()]  # both processes
        assert len(tids) == 4
        assert all(os.sched_getaffinity(t) == {one} for t in tids)
        assert spread_group(proc) >= 4
        assert all(os.sched_getaffinity(t) == cpus for t in tids)
        assert spread_group(proc) == 0  # nothing left to change
    finally:
        stop_group(proc, 2.0)
