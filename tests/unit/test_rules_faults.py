"""Fault rules (``fail``, ``isolate``): which child errors are contained, and what a child owed. No vLLM."""

from __future__ import annotations

from typing import Any

import pytest

from kvcompose.catalog import Rule
from kvcompose.compose import loads
from kvcompose.errors import CompositionError
from kvcompose.rules import faults
from kvcompose.rules._children import ChildrenParams
from kvcompose.rules.completion import OwnerAccounting
from kvcompose.rules.contract import FaultsRule, TransferResults
from kvcompose.rules.faults import Contain
from tests.unit.three import THREE, three_children


def built_rules() -> dict[str, Rule[Any]]:
    return {r.name: r for r in faults.kvcompose_rules()}


def test_the_module_offers_fail_and_isolate() -> None:
    rules = built_rules()
    assert set(rules) == {"fail", "isolate"}
    assert all(r.kind == "faults" for r in rules.values())
    assert rules["fail"].params is None and rules["isolate"].params is ChildrenParams


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


def test_owed_is_what_the_tracker_says_the_child_still_owes() -> None:
    tracker = OwnerAccounting(("a", "b", "c"))
    tracker.expect_load("r1", (0, 1))
    tracker.expect_load("r2", (1,))
    tracker.expect_saves("s", (0,))  # a delayed free is not a load: not owed
    for rule in (Contain(frozenset()), Contain(frozenset({0, 1}))):
        assert rule.owed(0, tracker) == {"r1"}
        assert rule.owed(1, tracker) == {"r1", "r2"}
        assert rule.owed(2, tracker) == set()


def test_owed_shrinks_as_the_child_reports() -> None:
    tracker = OwnerAccounting(("a", "b", "c"))
    tracker.expect_load("r1", (0,))
    tracker.expect_load("r2", (0,))
    tracker.settle([TransferResults(finished_recving={"r1"}), None, None])
    assert Contain(frozenset({0})).owed(0, tracker) == {"r2"}


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
