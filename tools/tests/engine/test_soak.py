"""``kvcompose soak``'s short variant (markers ``engine`` and ``long``: ``make test-long``): real
prefill and decode servers behind vLLM's router under load, the prefill and then the decode
SIGKILLed and restarted, each paused (SIGSTOP on its process group) for longer than the
prefill's lease and resumed, clients hanging up (through the router, and on decode mid NIXL
pull), and the kit's ``faulty`` child raising under a breaker. Every request is answered or hung
up, no attempt hangs, the router never drops a connection, only the killed processes died, every
engine is back to no request, no KV block and no pinned host block once quiet, and a sample of
the answers equals a single-engine baseline's; no read of blocks released on a lease expiry is
used (every such read the prefill logs, the decode refused). Where the kit can make hosts (root:
CI), prefill and decode run on hosts of their own and the link between them is also cut, longer
than the prefill's lease, and restored (``kvcompose soak --quick --hosts``): every check of the
one-host run holds there too, and a read that ended after its lease must be refused. The report
is printed (``pytest -s``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kvcompose_tools.e2e.hosts import unavailable
from kvcompose_tools.e2e.node import EngineNode
from kvcompose_tools.soak.plan import QUICK
from kvcompose_tools.soak.run import run

# A long scenario: `make test-long` (and `kvcompose soak --quick --hosts` itself), not in `make test`.
pytestmark = [pytest.mark.engine, pytest.mark.long]


def test_the_short_soak_passes_every_check(tmp_path: Path, baseline: EngineNode) -> None:
    across = unavailable() is None
    report = run(dataclasses.replace(QUICK, hosts=across), tmp_path, baseline=baseline)
    print("\n" + report.render())
    assert report.problems == []
    assert report.requests["answered"] > QUICK.requests // 2
    assert sum(report.hang_ups.values()) == report.requests["hung-up"]
    assert report.comparison.compared == QUICK.sample
    assert report.prefill_held_after_decode_kill > 0  # the prefill held blocks for the dead decode
    assert sum("resumed (SIGCONT)" in e for e in report.events) == 2  # both servers paused and resumed
    assert report.late_reads == 0
    if across:
        assert any("link restored" in e for e in report.events) and any("serves again" in e for e in report.events)
