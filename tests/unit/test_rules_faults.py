"""Fault rules (``fail``, ``isolate``, ``breaker``): which child errors are contained, what a child
owed, and when a bypassed child is called again (the breaker's state machine on a fake clock). No vLLM."""

from __future__ import annotations

from typing import Any

import pytest

from kvcompose.catalog import Rule
from kvcompose.compose import loads
from kvcompose.contract import FaultsRule, Isolation
from kvcompose.errors import CompositionError
from kvcompose.rules import faults
from kvcompose.rules.children import ChildrenParams
from kvcompose.rules.faults import Breaker, BreakerParams, BreakerRule, Contain
from tests.unit.three import THREE, three_children


def built_rules() -> dict[str, Rule[Any]]:
    return {r.name: r for r in faults.kvcompose_rules()}


def test_the_module_offers_fail_isolate_and_breaker() -> None:
    rules = built_rules()
    assert set(rules) == {"fail", "isolate", "breaker"}
    assert all(r.kind == "faults" for r in rules.values())
    assert rules["fail"].params is None and rules["isolate"].params is ChildrenParams
    assert rules["breaker"].params is BreakerParams


def test_fail_contains_nothing() -> None:
    obj = built_rules()["fail"].build(three_children(), None)
    assert isinstance(obj, Contain) and isinstance(obj, FaultsRule)
    assert [obj.contains(i) for i in range(3)] == [False, False, False]


def test_fail_is_the_default() -> None:
    plan = loads(THREE)
    assert isinstance(plan.faults, Contain) and not any(plan.faults.contains(i) for i in range(3))


def test_isolate_contains_only_the_listed_children() -> None:
    obj = built_rules()["isolate"].build(three_children(), ChildrenParams(children=["c", "a"]))
    assert isinstance(obj, FaultsRule)
    assert [obj.contains(i) for i in range(3)] == [True, False, True]


def test_isolate_from_yaml() -> None:
    plan = loads(THREE + "rules: {faults: {use: isolate, children: [b]}}\n")
    assert [plan.faults.contains(i) for i in range(3)] == [False, True, False]


def test_isolate_an_unknown_child_is_located() -> None:
    with pytest.raises(CompositionError) as err:
        loads(THREE + "rules: {faults: {use: isolate, children: [b, d]}}\n")
    [problem] = err.value.problems
    assert problem.path == ("rules", "faults", "children", 1) and "'d'" in problem.message


def test_contains_an_index_outside_the_composition_is_false() -> None:
    assert not Contain(frozenset({0})).contains(5)


def test_contain_is_plain_frozen_data() -> None:
    rule = Contain(frozenset({1}))
    assert rule == Contain(frozenset({1}))
    with pytest.raises(AttributeError):
        rule.best_effort = frozenset()  # type: ignore[misc]


def test_explanations() -> None:
    rules = built_rules()
    fail, isolate = rules["fail"], rules["isolate"]
    assert fail.explain is not None and isolate.explain is not None
    assert "stops the engine" in fail.explain(three_children(), None)
    text = isolate.explain(three_children(), ChildrenParams(children=["b"]))
    assert text.startswith("faults: b are best-effort")


# ------------------------------------------------------------------ breaker


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def breaker(clock: Clock, failures: int = 3, cooldown_s: float = 30, successes: int = 2) -> Breaker:
    rule = BreakerRule(frozenset({1}), ("a", "b", "c"), failures, cooldown_s, successes, clock)
    assert isinstance(rule, FaultsRule)
    return rule.monitor()


def test_fail_and_isolate_bypass_at_the_first_failure_for_good() -> None:
    for rule in (Contain(frozenset()), Contain(frozenset({1}))):
        m = rule.monitor()
        assert isinstance(m, Isolation) and m.state(1) == "closed"
        assert m.failed(1) is True
        assert m.state(1) == "open" and m.step() == () and m.take_changes() == {1: "open"}
        assert not m.watched  # nothing to do per step: it never comes back


def test_breaker_opens_after_failures_without_a_clean_step_between() -> None:
    b = breaker(Clock())
    assert b.failed(1) is False
    assert b.step() == ()
    assert b.failed(1) is False  # the last step had a failure: the count goes on
    assert b.state(1) == "closed" and b.watched == {1}
    assert b.failed(1) is True
    assert b.state(1) == "open" and b.take_changes() == {1: "open"}
    assert b.take_changes() == {}  # each change is reported once


def test_a_step_free_of_failures_resets_the_count() -> None:
    b = breaker(Clock())
    b.failed(1)
    b.failed(1)
    b.step()  # the step that had the failures ends
    b.step()  # a whole step without one
    assert not b.watched  # a healthy closed child costs the composite nothing per step
    assert b.failed(1) is False and b.failed(1) is False and b.state(1) == "closed"
    assert b.take_changes() == {}


def test_open_until_the_cooldown_then_half_open_then_closed_after_clean_steps() -> None:
    clock = Clock()
    b = breaker(clock, failures=1, cooldown_s=30, successes=2)
    assert b.failed(1) and b.state(1) == "open"
    clock.now += 29.9
    assert b.step() == () and b.state(1) == "open"
    clock.now += 0.1
    assert b.step() == (1,) and b.state(1) == "half-open" and b.watched == {1}
    b.succeeded(1)  # the probe
    assert b.step() == ()  # let back once; one clean step with a call that succeeded
    assert b.state(1) == "half-open"
    b.succeeded(1)
    b.step()
    assert b.state(1) == "closed" and not b.watched
    assert b.take_changes() == {1: "closed"}  # the latest state of each child that changed


def test_a_half_open_child_that_gets_no_call_is_not_declared_recovered() -> None:
    """Steps without a call to the child prove nothing: only steps whose calls succeeded close it."""
    clock = Clock()
    b = breaker(clock, failures=1, cooldown_s=30, successes=3)
    b.failed(1)
    clock.now += 30
    assert b.step() == (1,)
    for _ in range(10):  # no call reaches the child (no request, nothing for it to do)
        b.step()
    assert b.state(1) == "half-open" and b.watched == {1}
    for _ in range(2):
        b.succeeded(1)
        b.step()
    b.step()  # a quiet step between does not reset the count either
    assert b.state(1) == "half-open"
    b.succeeded(1)
    b.step()
    assert b.state(1) == "closed" and b.take_changes() == {1: "closed"}


def test_a_call_that_succeeded_and_one_that_failed_in_a_step_is_a_failed_probe() -> None:
    clock = Clock()
    b = breaker(clock, failures=1, cooldown_s=30, successes=1)
    b.failed(1)
    clock.now += 30
    b.step()
    b.succeeded(1)
    assert b.failed(1) is True and b.state(1) == "open"
    b.step()
    assert b.state(1) == "open"


def test_a_failed_probe_opens_again_with_a_new_cooldown() -> None:
    clock = Clock()
    b = breaker(clock, failures=3, cooldown_s=10)
    for _ in range(3):
        b.failed(1)
    clock.now += 10
    assert b.step() == (1,)
    assert b.failed(1) is True  # the probe: one failure is enough in half-open
    assert b.state(1) == "open"
    clock.now += 9
    assert b.step() == ()
    clock.now += 1
    assert b.step() == (1,)


def test_a_failure_reported_while_open_keeps_it_open() -> None:
    clock = Clock()
    b = breaker(clock, failures=1)
    b.failed(1)
    opened = b.take_changes()
    assert b.failed(1) is True and b.take_changes() == {} and opened == {1: "open"}


def test_the_states_of_a_breaker_are_logged_once_each(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    b = breaker(clock, failures=1, cooldown_s=5, successes=1)
    with caplog.at_level("INFO", logger="kvcompose.rules.faults"):
        b.failed(1)
        b.failed(1)
        clock.now += 5
        b.step()
        b.succeeded(1)
        b.step()
        b.step()
    states = [r.getMessage().split("breaker ")[1].split(":")[0] for r in caplog.records]
    assert states == ["open", "half-open", "closed"]
    assert all("connector b" in r.getMessage() for r in caplog.records)


def test_breaker_from_yaml_with_its_options() -> None:
    plan = loads(THREE + "rules: {faults: {use: breaker, children: [c], failures: 2, cooldown_s: 0.5, successes: 4}}\n")
    assert isinstance(plan.faults, BreakerRule)
    assert [plan.faults.contains(i) for i in range(3)] == [False, False, True]
    assert (plan.faults.failures, plan.faults.cooldown_s, plan.faults.successes) == (2, 0.5, 4)
    text = "\n".join(plan.explain())
    assert "c has a circuit breaker: when 2 calls fail" in text
    assert "after 0.5 s one probe call" in text
    assert "after 4 steps in a row with calls that succeeded and none that failed" in text


def test_breaker_defaults() -> None:
    plan = loads(THREE + "rules: {faults: {use: breaker, children: [a]}}\n")
    assert (plan.faults.failures, plan.faults.cooldown_s, plan.faults.successes) == (3, 30.0, 3)


@pytest.mark.parametrize(
    ("params", "where"),
    [
        ("failures: 0", "failures"),
        ("cooldown_s: -1", "cooldown_s"),
        ("cooldown_s: 100000.0", "cooldown_s"),
        ("successes: 0", "successes"),
        ("retries: 2", "retries"),
    ],
)
def test_breaker_options_are_checked(params: str, where: str) -> None:
    with pytest.raises(CompositionError) as err:
        loads(THREE + f"rules: {{faults: {{use: breaker, children: [a], {params}}}}}\n")
    [problem] = err.value.problems
    assert where in problem.path


# ------------------------------------------------------------------ settlement and neutral answers
