"""``KVCOMPOSE_TRACE=1 kvcompose ...`` shows the trace on stderr: the CLI gives the
``kvcompose.trace`` logger a handler while the variable is set (nothing else configures logging
in the CLI, and a logger without one shows its INFO lines nowhere)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvcompose import plugins
from kvcompose.cli import main

EXAMPLE = Path(__file__).parents[2] / "examples" / "pd-decode.yaml"
HOOK_CALLS = [
    "kvcompose.trace: kvcompose_connector_types from plugin nixl (kvcompose-nixl ",
    "kvcompose.trace: kvcompose_rules from plugin kvcompose.rules.load (kvcompose (built-in)) [provider]",
    "kvcompose.trace:   kvcompose_check [hook]",
    "kvcompose.trace:   finish kvcompose_check --> [[]] [hook]",
]


def check(trace: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("KVCOMPOSE_PLUGINS", "KVCOMPOSE_TRACE")}
    env["KVCOMPOSE_PD_KEY"] = "k" * 64  # the key the example names, as on its engine's host
    if trace is not None:
        env["KVCOMPOSE_TRACE"] = trace
    return subprocess.run(
        [sys.executable, "-m", "kvcompose.cli", "check", str(EXAMPLE)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_trace_is_on_stderr_when_set() -> None:
    proc = check("1")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    for call in HOOK_CALLS:
        assert any(line.startswith(call) for line in lines), (call, proc.stderr[:2000])
    # The plan is on stdout as without tracing; stderr holds the trace alone.
    assert proc.stdout == check(None).stdout and proc.stdout.startswith(f"{EXAMPLE}: ok")
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("trace", [None, "0"])
def test_no_trace_without_it(trace: str | None) -> None:
    proc = check(trace)
    assert (proc.returncode, proc.stderr) == (0, "")


def test_main_in_process_traces_to_the_stderr_of_the_moment(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVCOMPOSE_TRACE", "1")
    monkeypatch.setattr(plugins, "_default", None)  # made afresh under the variable, dropped after
    trace_log = logging.getLogger("kvcompose.trace")
    handlers, level = list(trace_log.handlers), trace_log.level
    assert main(["check", str(EXAMPLE)]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith(f"{EXAMPLE}: ok")
    for call in HOOK_CALLS:
        assert call in captured.err, call
    # The handler is the command's: none left behind for the next command in this process.
    assert (trace_log.handlers, trace_log.level) == (handlers, level)
