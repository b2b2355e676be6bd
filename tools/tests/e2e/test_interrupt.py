"""Ctrl-C stops every process group the command started (each with a child of its own, as an
engine has its engine core) and says so; ``tools/tests/engine/test_interrupt.py`` does it to
``kvcompose demo`` with real engines."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

#: Two "engines", each a shell leading its own group with a ``sleep`` child, under the handler.
SCRIPT = textwrap.dedent(
    """
    import sys, time
    from kvcompose_tools.e2e.processes import Interrupted, start_group, stopped_on_interrupt

    try:
        with stopped_on_interrupt(grace_s=2.0):
            for name in ("prefill engine", "decode engine"):
                start_group(name, ["sh", "-c", "sleep 600 & wait"])
            print("started", flush=True)
            time.sleep(600)
    except Interrupted as exc:
        print(exc.message("demo"), file=sys.stderr)
        sys.exit(128 + exc.signum)
    """
)


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (from ``/proc``)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def alive(pids: set[int]) -> set[int]:
    """Those of ``pids`` still running (not gone, not a zombie waiting for its parent)."""
    running = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            running.add(pid)
    return running


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout:.0f} s")
        time.sleep(0.2)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_every_started_group_and_says_so(sig: signal.Signals) -> None:
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    try:
        assert proc.stdout.readline() == "started\n"
        # each group: its shell and the shell's sleep
        wait_for(lambda: len(descendants(proc.pid)) >= 4, 30, "engine processes")
        started = descendants(proc.pid)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + sig
    assert not alive(started), f"left running: {alive(started)}"
    assert err.startswith(
        f"kvcompose demo: interrupted ({sig.name}); stopped the 2 engine/router process groups it started: "
        "prefill engine (pid "
    ), err
    assert "decode engine (pid " in err


def test_a_started_group_is_a_process_group_of_its_own_in_this_session() -> None:
    """Its own group, so that stopping it reaches its children and a terminal's Ctrl-C does not;
    this session, so that Linux does not schedule it as a group of its own (autogroup): two
    engines in two sessions starved each other's workers on a shared core (docs/e2e.md)."""
    import os

    from kvcompose_tools.e2e.processes import start_group, stop_group

    proc = start_group("probe", ["sh", "-c", "sleep 600 & wait"])
    try:
        assert os.getpgid(proc.pid) == proc.pid != os.getpgrp()
        assert os.getsid(proc.pid) == os.getsid(0)
    finally:
        stop_group(proc, grace_s=5)


def test_a_killed_group_is_reaped_and_a_live_ones_kernel_states_are_said() -> None:
    from kvcompose_tools.e2e.processes import kernel_states, reap_killed, signal_group, start_group

    proc = start_group("sleeper", ["sleep", "100"])
    try:
        deadline = time.monotonic() + 10
        while "('S', " not in (states := kernel_states(proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.05)  # until it has started and sleeps
        assert "('S', " in states  # asleep: what a process stuck past SIGKILL would show
    finally:
        signal_group(proc, signal.SIGKILL)
        reap_killed(proc)
    assert proc.returncode == -signal.SIGKILL
    assert kernel_states(proc.pid) == "no threads left"
