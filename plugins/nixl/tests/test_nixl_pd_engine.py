"""Two real vLLM engines doing NIXL P/D on CPU (slow: about a minute each; marker ``engine``).

The work is in ``nixl_pd_engine_check.py``, run as a subprocess so that each engine gets a
fresh process and the test session never holds vLLM engine state. Its ``--upstream`` mode, which
shows vLLM's own NixlConnector killing the decode engine on the short-prompt request, is a probe
of vLLM, not a test of kvcompose: run it by hand (plugins/nixl/README.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

CHECK = Path(__file__).with_name("nixl_pd_engine_check.py")

# `make test-long`: the same classes serve as the composition's NIXL child in `make test`'s engine
# tests, the no-remote-blocks request included (tools/tests/engine/test_pd_engines.py).
pytestmark = [pytest.mark.engine, pytest.mark.long]


def run_check(*args: str) -> dict[str, object]:
    pytest.importorskip("nixl")
    proc = subprocess.run([sys.executable, str(CHECK), *args], capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads(lines[-1][len("RESULT ") :])
    assert proc.returncode == (0 if result["ok"] else 1)
    return result


def test_pd_pull_with_kvcompose_classes() -> None:
    """KV moves over NIXL, the side channel comes from the options, the short-prompt request
    without remote blocks is computed locally and the decode engine keeps serving."""
    result = run_check()
    assert result["ok"], result
