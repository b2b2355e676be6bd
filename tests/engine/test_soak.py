"""``kvcompose soak``'s short variant (marker ``engine``; CI runs it under the engine lock): real
prefill and decode servers behind vLLM's router under load, the prefill and then the decode
SIGKILLed and restarted, clients hanging up (through the router, and on decode mid NIXL pull), and
the kit's ``faulty`` child raising under a breaker. Every request is answered or hung up, no
attempt hangs, the router never drops a connection, only the killed processes died, every engine
is back to no request, no KV block and no pinned host block once quiet, and a sample of the
answers equals a single-engine baseline's. The report is printed (``pytest -s``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcompose.e2e.node import EngineNode
from kvcompose.soak.plan import QUICK
from kvcompose.soak.run import run

pytestmark = pytest.mark.engine


def test_the_short_soak_passes_every_check(tmp_path: Path, baseline: EngineNode) -> None:
    report = run(QUICK, tmp_path, baseline=baseline)
    print("\n" + report.render())
    assert report.problems == []
    assert report.requests["answered"] > QUICK.requests // 2
    assert sum(report.hang_ups.values()) == report.requests["hung-up"]
    assert report.comparison.compared == QUICK.sample
    assert report.prefill_held_after_decode_kill > 0  # the prefill held blocks for the dead decode
