"""A real vLLM engine on CPU serves a prefix from the cpu-offload tier (slow: ~30 s per backend).

Skipped unless selected: ``pytest -m engine`` (the disk backend: ``-m long``, ``make test-long``)
or ``KVCOMPOSE_ENGINE_TESTS=1``. The engine runs in a child process
(``cpu_offload_engine_check.py``) so its environment variables, OpenMP threads and engine-core
process stay out of the test session.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("cpu_offload_engine_check.py")


@pytest.mark.engine
# Both backends are `make test-long`, out of CI's hour: as children of a composition they run in
# `make test` (tools/tests/engine/test_three_tiers.py, test_pd_engines.py).
@pytest.mark.long
@pytest.mark.parametrize("backend", ["cpu", "disk"])
def test_engine_serves_a_prefix_from_the_offload_tier(request: pytest.FixtureRequest, backend: str) -> None:
    markexpr = request.config.getoption("markexpr", "") or ""
    selected = "engine" in markexpr or "long" in markexpr  # make test-long selects -m long
    if not selected and not os.environ.get("KVCOMPOSE_ENGINE_TESTS"):
        pytest.skip("starts a vLLM engine: run with -m engine, -m long or KVCOMPOSE_ENGINE_TESTS=1")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--backend", backend],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, f"no RESULT line (rc={proc.returncode}); stderr tail:\n{proc.stderr[-4000:]}"
    result = json.loads(lines[-1].removeprefix("RESULT "))
    failed = [name for name, ok in result["checks"].items() if not ok]
    assert not failed, f"failed checks {failed}: {json.dumps(result, indent=1)}"
    assert result["a2_external_hit_tokens"] == result["expected_hit_tokens"] == 576
    assert result["a2_tokens"] == result["a1_tokens"]
    assert proc.returncode == 0
