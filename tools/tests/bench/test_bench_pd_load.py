"""pd-load's figures from given loads (no engines): its bounds per run and its p99 target."""

from __future__ import annotations

from pathlib import Path

from kvcompose_tools.bench.pd_load import BOUND_S, SIDES, Run, summarize
from kvcompose_tools.bench.runner import BENCHMARKS, FULL_ONLY
from kvcompose_tools.e2e.load import Load, Turn


def load(ttfts: list[float | None]) -> Load:
    return Load("chat", [Turn(0.0, t, None if t is not None else "HTTP 500") for t in ttfts], wall_s=10.0)


def test_a_run_is_held_to_every_bound() -> None:
    fine = Run("kvcompose", load([0.1, 0.2, 0.3]), 0, 0)
    assert fine.problems() == [] and fine.figures()["over_bound"] == 0
    bad = Run("kvcompose", load([0.1, BOUND_S + 1, None]), 1, 2)
    said = bad.problems()
    assert len(said) == 4
    assert said[0].startswith(f"1 request(s) over {BOUND_S:g} s") and "HTTP 500" in said[1]
    assert "1 lease expiry" in said[2] and "2 read(s) after a lease" in said[3]
    assert bad.figures()["served"] == 2 and bad.figures()["failed"] == 1  # slow is served, not failed


def test_the_p99_target_is_kvcompose_over_its_nixl_child_per_workload(tmp_path: Path) -> None:
    p99 = {"kvcompose": 0.2, "MultiConnector": 0.2, "kvcompose-pd-only": 0.1}
    done = {w: {s: [Run(s, load([p99[s]] * 3), 0, 0)] for s in SIDES} for w in ("chat", "prefix")}
    r = summarize(done, 1, True, 60.0, tmp_path)
    assert r.target_met is False  # 2x the NIXL child's p99
    assert [(x.case, x.subject, x.baseline) for x in r.ratios][:2] == [
        ("chat", "kvcompose", "kvcompose-pd-only"),
        ("chat", "kvcompose", "MultiConnector"),
    ]
    assert "problems: none" in r.table()
    assert BENCHMARKS["pd-load"] == "pd_load" and "pd-load" in FULL_ONLY
