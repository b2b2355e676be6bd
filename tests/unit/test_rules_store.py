"""Store rules (``all``, ``only``): which children receive the save hooks. No vLLM."""

from __future__ import annotations

from typing import Any

import pytest

from kvcompose.catalog import Rule
from kvcompose.compose import loads
from kvcompose.contract import StoreRule
from kvcompose.errors import CompositionError
from kvcompose.rules import store
from kvcompose.rules.children import ChildrenParams
from kvcompose.rules.store import StoreTo
from tests.unit.three import THREE, three_children


def built_rules() -> dict[str, Rule[Any]]:
    return {r.name: r for r in store.kvcompose_rules()}


def test_the_module_offers_all_and_only() -> None:
    rules = built_rules()
    assert set(rules) == {"all", "only"}
    assert all(r.kind == "store" for r in rules.values())
    assert rules["all"].params is None and rules["only"].params is ChildrenParams


def test_all_targets_every_child_in_yaml_order() -> None:
    obj = built_rules()["all"].build(three_children(), None)
    assert isinstance(obj, StoreRule)
    assert obj.targets == (0, 1, 2)


def test_all_is_the_default() -> None:
    assert loads(THREE).store.targets == (0, 1, 2)


def test_only_targets_the_named_children_in_yaml_order() -> None:
    obj = built_rules()["only"].build(three_children(), ChildrenParams(children=["c", "a"]))
    assert isinstance(obj, StoreRule)
    assert obj.targets == (0, 2)


def test_only_from_yaml() -> None:
    plan = loads(THREE + "rules: {store: {use: only, children: [b]}}\n")
    assert plan.store.targets == (1,)
    assert plan.rule_params["store"] == ChildrenParams(children=["b"])


def test_only_an_unknown_child_is_a_problem_at_its_place() -> None:
    with pytest.raises(CompositionError) as err:
        built_rules()["only"].build(three_children(), ChildrenParams(children=["a", "bb"]))
    [problem] = err.value.problems
    assert problem.path == ("children", 1)
    assert "'bb'" in problem.message and problem.hint == "did you mean b?"


def test_only_an_unknown_child_from_yaml_is_located_under_the_rule() -> None:
    text = THREE + "rules:\n  store: {use: only, children: [a, nope]}\n"
    with pytest.raises(CompositionError) as err:
        loads(text)
    [problem] = err.value.problems
    assert problem.path == ("rules", "store", "children", 1)
    assert problem.line == 8
    assert "no connector is named 'nope'" in problem.message


def test_only_without_children_is_refused() -> None:
    with pytest.raises(CompositionError) as err:
        loads(THREE + "rules: {store: only}\n")
    assert any(p.path[:2] == ("rules", "store") and "children" in p.message for p in err.value.problems)


def test_all_takes_no_parameters() -> None:
    with pytest.raises(CompositionError) as err:
        loads(THREE + "rules: {store: {use: all, children: [a]}}\n")
    [problem] = err.value.problems
    assert problem.path == ("rules", "store", "children") and "takes no parameters" in problem.message


def test_store_to_is_plain_frozen_data() -> None:
    rule = StoreTo((0, 2))
    assert isinstance(rule, StoreRule) and rule == StoreTo((0, 2))
    with pytest.raises(AttributeError):
        rule.targets = (1,)  # type: ignore[misc]


def test_explanations_name_the_targets() -> None:
    children = three_children()
    rules = built_rules()
    all_, only = rules["all"], rules["only"]
    assert all_.explain is not None and only.explain is not None
    assert all_.explain(children, None) == "store: every child may store (a, b, c)"
    assert only.explain(children, ChildrenParams(children=["b"])) == "store: only b get save hooks"
