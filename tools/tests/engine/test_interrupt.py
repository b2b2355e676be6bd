"""Ctrl-C during ``kvcompose demo``: once its engines and their engine cores run, SIGINT (what a
terminal sends to the foreground process; the engines sit in process groups of their own, out of
its reach) stops every one of them, and the demo says which."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from e2e.test_interrupt import alive, descendants, wait_for

pytestmark = pytest.mark.engine

#: The demo's first two nodes (baseline and prefill) each start vLLM's engine core, a
#: multiprocessing child (besides its resource tracker).
ENGINE_CORES = 2


def engine_cores(pid: int) -> list[int]:
    found = []
    for child in descendants(pid):
        try:
            if b"multiprocessing.spawn" in Path(f"/proc/{child}/cmdline").read_bytes():
                found.append(child)
        except OSError:
            continue
    return found


def test_ctrl_c_stops_the_demos_engines_and_says_so(tmp_path: Path) -> None:
    demo = subprocess.Popen(
        [sys.executable, "-m", "kvcompose.cli", "demo"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: len(engine_cores(demo.pid)) >= ENGINE_CORES, 300, "engine cores")
        started = descendants(demo.pid)
        demo.send_signal(signal.SIGINT)
        out, err = demo.communicate(timeout=120)
    finally:
        if demo.poll() is None:
            demo.kill()
    assert demo.returncode == 128 + signal.SIGINT, out + err
    assert not alive(started), f"left running: {alive(started)}"
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("kvcompose demo: interrupted")]
    assert len(lines) == 1, err
    assert lines[0].startswith(
        "kvcompose demo: interrupted (SIGINT); stopped the 2 engine/router process groups it started: "
        "baseline engine (pid "
    ), lines[0]
    assert ", prefill engine (pid " in lines[0]
    print(f"\n{len(started)} processes under the demo before SIGINT, none after\n{lines[0]}")
