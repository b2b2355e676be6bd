"""The kit can let every thread of an engine's process group use every CPU once the engine is up
(:func:`kvcompose_tools.e2e.affinity.spread_group`; the engine tests ask for it), where vLLM's CPU
platform leaves them pinned to one core each (``docs/e2e.md``, cold start)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest

from kvcompose_tools.e2e.affinity import OMP_BIND_ENV, SPREAD_ENV, engine_up, spread_group
from kvcompose_tools.e2e.processes import start_group, stop_group
from kvcompose_tools.e2e.spec import EngineSpec

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


@pytest.fixture
def pinned() -> Iterator[tuple[subprocess.Popen[str], list[int], int]]:
    """The group of :data:`PINNED` started, its four thread ids, and the CPU they are pinned to."""
    cpus = os.sched_getaffinity(0)
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")
    one = min(cpus)
    code = PINNED.format(cpu=one)
    proc = start_group("pinned", [sys.executable, "-c", code, code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        tids = [int(t) for _ in range(2) for t in proc.stdout.readline().split()]  # both processes
        assert len(tids) == 4 and all(os.sched_getaffinity(t) == {one} for t in tids)
        yield proc, tids, one
    finally:
        stop_group(proc, 2.0)
        if proc.stdout is not None:
            proc.stdout.close()


def test_every_thread_of_the_group_may_use_every_cpu_once_spread(
    pinned: tuple[subprocess.Popen[str], list[int], int],
) -> None:
    proc, tids, _ = pinned
    assert spread_group(proc) >= 4
    assert all(os.sched_getaffinity(t) == os.sched_getaffinity(0) for t in tids)
    assert spread_group(proc) == 0  # nothing left to change


@pytest.mark.parametrize(
    ("asked", "bind", "spread"),
    [("1", None, True), ("1", "auto", True), (None, None, False), ("1", "0|1", False)],
)
def test_an_engine_up_is_spread_only_when_asked_and_vllm_chose_its_cores(
    pinned: tuple[subprocess.Popen[str], list[int], int],
    monkeypatch: pytest.MonkeyPatch,
    asked: str | None,
    bind: str | None,
    spread: bool,
) -> None:
    proc, tids, one = pinned
    if asked is None:
        monkeypatch.delenv(SPREAD_ENV, raising=False)
    else:
        monkeypatch.setenv(SPREAD_ENV, asked)
    engine_up(proc, {} if bind is None else {OMP_BIND_ENV: bind})
    expected = os.sched_getaffinity(0) if spread else {one}
    assert all(os.sched_getaffinity(t) == expected for t in tids)


def test_a_tensor_parallel_engine_names_its_workers_cores() -> None:
    # What keeps a TP-2 engine out of the spreading: its environment names a core per worker.
    assert EngineSpec("d", "m", tensor_parallel_size=2).env() == {OMP_BIND_ENV: "0|1"}
    assert EngineSpec("d", "m").env() == {}
