"""The scheduler benchmark's own-cost case (issue 54): the paired per-step estimator and the
``kvcompose-vllm`` side. No timing is asserted."""

from __future__ import annotations

import gc
import itertools
from collections import Counter

import pytest

from kvcompose_tools.bench.measure import (
    alternated_steps,
    balanced_rounds,
    median_interval,
    per_step_cost,
    quartiles,
)


def test_alternated_steps_runs_every_unit_once_a_round_in_the_balanced_orders() -> None:
    order: list[str] = []
    clock = iter(range(1, 100))

    def unit(name: str) -> float:
        order.append(name)
        return float(next(clock))

    steps = alternated_steps({n: (lambda n=n: unit(n)) for n in "ab"}, 3, chunk=3)
    assert order == list("abbaabba")  # two units: the order flips; 3 rounds -> 2 whole cycles
    # Each side's seconds per round, in the rounds' order.
    assert steps == {"a": [1.0, 4.0, 5.0, 8.0], "b": [2.0, 3.0, 6.0, 7.0]}
    order.clear()
    steps = alternated_steps({n: (lambda n=n: unit(n)) for n in "abc"}, 6, chunk=4)
    assert [order[k : k + 3] for k in range(0, 18, 3)] == balanced_rounds("abc")
    assert [len(v) for v in steps.values()] == [6, 6, 6]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_balanced_rounds_have_every_name_follow_every_name_equally_often(n: int) -> None:
    names = list("abcd"[:n])
    rounds = balanced_rounds(names)
    assert sorted(map(tuple, rounds)) == sorted(itertools.permutations(names))  # each round runs each once
    turns = [x for r in rounds for x in r]
    pairs = Counter(zip(turns, turns[1:] + turns[:1]))  # cyclically: the cycle repeats whole
    assert set(pairs) == {(a, b) for a in names for b in names} and len(set(pairs.values())) == 1
    # The order flipped every other round leaves three unbalanced: b never follows itself.
    flipped = [*"abc", *"cba"]
    assert ("b", "b") not in set(zip(flipped, flipped[1:] + flipped[:1]))
    with pytest.raises(ValueError, match="distinct"):
        balanced_rounds(["a", "a"])


def test_alternated_steps_pauses_the_collector_inside_a_chunk_only() -> None:
    seen: list[bool] = []
    steps = alternated_steps({"a": lambda: seen.append(gc.isenabled()) or 0.0}, 5, chunk=2)
    assert seen == [False] * 5 and gc.isenabled() and len(steps["a"]) == 5
    with pytest.raises(ValueError, match="steps and chunk"):
        alternated_steps({"a": lambda: 0.0}, 0)


def test_per_step_cost_is_each_rounds_difference_per_request_in_microseconds() -> None:
    steps = {"subject": [110e-6, 150e-6, 90e-6], "baseline": [100e-6, 100e-6, 100e-6]}
    cost = per_step_cost(steps, "subject", "baseline", 10)
    assert cost.values == pytest.approx([1.0, 5.0, -1.0])
    assert cost.median == pytest.approx(1.0)  # the figure: the median over rounds
    with pytest.raises(ValueError):
        per_step_cost({"subject": [1.0], "baseline": [1.0, 2.0]}, "subject", "baseline", 1)


def test_the_estimators_spread_brackets_the_median() -> None:
    values = [float(v) for v in range(101)]
    assert quartiles(values) == (25.0, 75.0)
    lo, hi = median_interval(values)
    assert lo < 50.0 < hi and (lo, hi) == (40.0, 60.0)
    assert median_interval([3.0]) == (3.0, 3.0)


def test_the_vllm_children_side_composes_vllms_own_classes_and_does_the_same_work() -> None:
    """kvcompose-vllm: the composite over vLLM's own classes (no plugin subclass), the same loads
    per tier and the same tokens as MultiConnector and kvcompose."""
    from kvcompose_tools.bench.scheduler_step import OWN_SIDES, VLLM_CHILDREN, Driver

    drivers = {s: Driver(s, 8) for s in OWN_SIDES}
    for d in drivers.values():
        for _ in range(120):
            d.step()
    multi = drivers["MultiConnector"].counts
    assert all(d.counts == multi for d in drivers.values())
    assert multi["loaded:nixl"] > 0 and multi["loaded:cpu"] > 0 and multi["finished"] > 0
    own = [type(c) for c in drivers[VLLM_CHILDREN].sched.connector.sub_connectors]
    plugins = [type(c) for c in drivers["kvcompose"].sched.connector.sub_connectors]
    assert [c.__module__.split(".")[0] for c in own] == ["vllm", "vllm"]
    assert [c.__module__.split(".")[0] for c in plugins] != ["vllm", "vllm"]


def test_the_own_cost_case_reports_both_figures_against_the_target(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvcompose_tools.bench import scheduler_step
    from kvcompose_tools.bench.measure import Ratio
    from kvcompose_tools.bench.scheduler_step import (
        COMPOSITE_OWN,
        OWN_BUDGET,
        OWN_SIDES,
        OWN_SUBJECT,
        PLUGINS_OWN,
        own_label,
        step_target,
    )

    monkeypatch.setattr(scheduler_step, "warmup_steps", lambda quick: 8)
    case, ratios, line = scheduler_step.own_case(16, True, 20)  # 20 rounds -> 24: whole cycles of six
    assert case.label == own_label(16) == "own cost, 16 reqs" and list(case.samples) == list(OWN_SIDES)
    assert all(len(s.values) == 24 for s in case.samples.values()) and case.extra["rounds"] == 24
    composite, plugins = case.derived[COMPOSITE_OWN], case.derived[PLUGINS_OWN]
    assert composite.values == pytest.approx(
        [
            (v - m) / 16 * 1e6
            for v, m in zip(case.samples["kvcompose-vllm"].values, case.samples["MultiConnector"].values)
        ]
    )
    assert len(plugins.values) == 24 and case.extra["same_work"] is True
    assert case.extra["estimator"][COMPOSITE_OWN]["median"] == composite.median
    assert [(r.case, r.subject, r.baseline) for r in ratios] == [(own_label(16), OWN_SUBJECT, OWN_BUDGET)]
    assert ratios[0].by_median == pytest.approx(composite.median / 1.0)
    assert "own cost, 16 reqs, 24 paired steps" in line and "plugins' overrides" in line

    def measured(us: float) -> list[Ratio]:
        return [Ratio(f"{n} reqs", "kvcompose", "MultiConnector", 1.0, 1.0, False) for n in (1, 16)] + [
            Ratio(own_label(n), OWN_SUBJECT, OWN_BUDGET, us, us, False) for n in (1, 16)
        ]

    target = step_target((1, 16), own=True)
    assert target.verdict(measured(0.9)) is True and target.verdict(measured(1.1)) is False
    # No target under 16 requests: one request's figure alone does not decide.
    assert target.verdict(measured(0.9)[:2] + [Ratio(own_label(1), OWN_SUBJECT, OWN_BUDGET, 5, 5, False)]) is None
    assert "composite own" in str(target) and "composite own" not in str(step_target((1, 16)))
