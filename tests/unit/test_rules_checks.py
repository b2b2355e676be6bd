"""The built-in cross-child checks (``kvcompose_check`` in :mod:`kvcompose.rules.checks`). No vLLM.

Each check is driven by what a connector type declares, so the tests register small types that
declare exactly one thing each.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest

from kvcompose import hookimpl
from kvcompose.catalog import Child, ConnectorType, Options, Plan, Rule
from kvcompose.compose import loads
from kvcompose.contract import StoreRule
from kvcompose.errors import CompositionError, Problem
from kvcompose.plugins import Plugins
from kvcompose.rules import checks
from kvcompose.rules.checks import ChecksPlan, layout_conflict
from kvcompose.rules.children import index
from kvcompose.rules.params import Owners


class PdType(ConnectorType):
    name = "checks-pd"
    pd_transport = True


class HostBufferType(ConnectorType):
    name = "checks-host-buffer"
    owns_host_buffer_ops = True


class KeysType(ConnectorType):
    name = "checks-keys"
    param_keys = frozenset({"k1", "k2"})


class SavesType(ConnectorType):
    name = "checks-saves"

    def save_hooks_needed(self, child: Child) -> str | None:
        return "plans saves its worker runs"


class LayoutOptions(Options):
    layout: str | None = None


class LayoutType(ConnectorType):
    name = "checks-layout"
    options: ClassVar[type[Options]] = LayoutOptions

    def kv_layout(self, child: Child) -> str | None:
        return child.options_as(LayoutOptions).layout


class _Types:
    @hookimpl
    def kvcompose_connector_types(self) -> list[ConnectorType]:
        return [PdType(), HostBufferType(), KeysType(), LayoutType(), SavesType()]


@pytest.fixture(autouse=True)
def check_types(kvcompose_plugins: Plugins) -> Iterator[Plugins]:
    plugin = _Types()
    kvcompose_plugins.register(plugin, name="tests.unit.test_rules_checks")
    try:
        yield kvcompose_plugins
    finally:
        kvcompose_plugins.unregister(plugin)


def composition(*children: str, rules: str = "") -> str:
    lines = ["version: 1", "connectors:"] + [f"  - {c}" for c in children]
    if rules:
        lines.append(f"rules: {rules}")
    return "\n".join(lines) + "\n"


def problems(text: str) -> list[Problem]:
    with pytest.raises(CompositionError) as err:
        loads(text)
    return err.value.problems


# ------------------------------------------------------------------ one of each is fine


def test_one_of_each_is_clean() -> None:
    plan = loads(
        composition(
            "{name: pd, type: checks-pd}",
            "{name: buf, type: checks-host-buffer}",
            "{name: keys, type: checks-keys}",
            "{name: lay, type: checks-layout, options: {layout: NHD}}",
            "{name: rec, type: record}",
        )
    )
    assert checks.kvcompose_check(plan) == []
    assert plan.pd_transport is not None and plan.pd_transport.name == "pd"
    assert plan.host_buffer_owner == 1


# ------------------------------------------------------------------ P/D transports


def test_two_pd_transports_are_refused_at_the_second() -> None:
    [p] = problems(
        composition("{name: first, type: checks-pd}", "{name: rec, type: record}", "{name: second, type: checks-pd}")
    )
    assert p.message == "second and first both are P/D transports; an instance has one"
    assert p.path == ("connectors", 2, "type") and p.line == 5
    assert p.hint == "compose at most one P/D transport"


def test_three_pd_transports_are_two_problems_naming_the_first() -> None:
    found = problems(
        composition("{name: p1, type: checks-pd}", "{name: p2, type: checks-pd}", "{name: p3, type: checks-pd}")
    )
    assert [(p.path, p.message.split(" both")[0]) for p in found] == [
        (("connectors", 1, "type"), "p2 and p1"),
        (("connectors", 2, "type"), "p3 and p1"),
    ]


# ------------------------------------------------------------------ host-buffer owners


def test_two_host_buffer_owners_are_refused() -> None:
    [p] = problems(composition("{name: x, type: checks-host-buffer}", "{name: y, type: checks-host-buffer}"))
    assert p.message == "y and x both want vLLM's host-buffer copy op; only one child can own it"
    assert p.path == ("connectors", 1, "type")
    assert p.hint == "keep one host-buffer transport per composition"


# ------------------------------------------------------------------ params keys owned twice


def test_a_params_key_owned_twice_is_refused_under_owners() -> None:
    [p] = problems(composition("{name: x, type: checks-keys}", "{name: y, type: checks-keys}"))
    assert p.message == "kv_transfer_params key 'k1' is owned by both x and y"
    assert p.path == ("connectors", 1, "type")
    assert p.hint is not None and "params: strict" in p.hint


def test_a_params_key_owned_twice_is_one_problem_per_child() -> None:
    found = problems(
        composition("{name: x, type: checks-keys}", "{name: y, type: checks-keys}", "{name: z, type: checks-keys}")
    )
    assert [p.path for p in found] == [("connectors", 1, "type"), ("connectors", 2, "type")]


def test_a_params_key_declared_twice_is_fine_under_strict() -> None:
    plan = loads(composition("{name: x, type: checks-keys}", "{name: y, type: checks-keys}", rules="{params: strict}"))
    assert checks.kvcompose_check(plan) == []


def test_two_record_pd_children_trip_the_host_buffer_and_params_checks() -> None:
    found = problems(composition("{name: p1, type: record-pd}", "{name: p2, type: record-pd}"))
    messages = sorted(p.message for p in found)
    assert len(found) == 2, messages
    assert any("host-buffer copy op" in m for m in messages)
    assert any("is owned by both p1 and p2" in m for m in messages)
    assert all(p.path == ("connectors", 1, "type") for p in found)


def test_two_record_pd_children_under_strict_only_trip_the_host_buffer_check() -> None:
    [p] = problems(composition("{name: p1, type: record-pd}", "{name: p2, type: record-pd}", rules="{params: strict}"))
    assert "host-buffer copy op" in p.message


def test_every_problem_is_reported_together() -> None:
    found = problems(
        composition(
            "{name: p1, type: checks-pd}",
            "{name: p2, type: checks-pd}",
            "{name: b1, type: checks-host-buffer}",
            "{name: b2, type: checks-host-buffer}",
            "{name: k1, type: checks-keys}",
            "{name: k2, type: checks-keys}",
        )
    )
    assert sorted(p.path[1] for p in found) == [1, 3, 5]


# ------------------------------------------------------------------ children that need the save hooks


def test_a_child_that_needs_the_save_hooks_left_out_of_them_is_refused_at_the_store_rule() -> None:
    [p] = problems(
        composition(
            "{name: s, type: checks-saves}", "{name: rec, type: record}", rules="{store: {use: only, children: [rec]}}"
        )
    )
    assert p.message == "the store rule leaves s out of the save hooks, but it plans saves its worker runs"
    assert p.path == ("rules", "store") and p.line == 5
    assert p.hint == "list s in store.children, or use `store: all`"


@pytest.mark.parametrize("store", ["all", "{use: only, children: [s]}"])
def test_a_child_that_needs_the_save_hooks_and_gets_them_is_fine(store: str) -> None:
    plan = loads(composition("{name: s, type: checks-saves}", "{name: rec, type: record}", rules=f"{{store: {store}}}"))
    assert checks.kvcompose_check(plan) == []


@pytest.mark.parametrize("faults", ["isolate", "breaker"])
def test_a_child_that_needs_the_save_hooks_cannot_be_bypassed_by_the_faults_rule(faults: str) -> None:
    [p] = problems(
        composition(
            "{name: s, type: checks-saves}",
            "{name: rec, type: record}",
            rules=f"{{faults: {{use: {faults}, children: [s, rec]}}}}",
        )
    )
    assert p.message == (
        "the faults rule can bypass s, which then gets no save hooks, but it plans saves its worker runs"
    )
    assert p.path == ("rules", "faults") and p.line == 5
    assert p.hint == "leave s out of faults.children; an error of it then stops the engine"


def test_the_faults_rule_may_bypass_the_other_children() -> None:
    plan = loads(
        composition(
            "{name: s, type: checks-saves}",
            "{name: rec, type: record}",
            rules="{faults: {use: isolate, children: [rec]}}",
        )
    )
    assert checks.kvcompose_check(plan) == []


# ------------------------------------------------------------------ KV cache layouts


@pytest.mark.parametrize(
    "layouts",
    [{}, {"a": None}, {"a": "NHD", "b": None, "c": "NHD"}, {"a": None, "b": "HND"}],
)
def test_layout_conflict_agreeing_or_unknown_is_none(layouts: dict[str, str | None]) -> None:
    assert layout_conflict(layouts) is None


def test_layout_conflict_names_every_known_layout() -> None:
    text = layout_conflict({"a": "NHD", "b": None, "c": "HND"})
    assert text == "children need different KV cache layouts: a=NHD, c=HND"


def test_layout_conflict_in_a_composition_is_located_at_the_child_that_differs() -> None:
    [p] = problems(
        composition(
            "{name: a, type: checks-layout, options: {layout: NHD}}",
            "{name: n, type: checks-layout}",
            "{name: c, type: checks-layout, options: {layout: HND}}",
        )
    )
    assert p.message == "children need different KV cache layouts: a=NHD, c=HND"
    assert p.path == ("connectors", 2, "type")


def test_layout_conflict_is_not_located_at_a_child_that_agrees() -> None:
    [p] = problems(
        composition(
            "{name: a, type: checks-layout, options: {layout: NHD}}",
            "{name: b, type: checks-layout, options: {layout: NHD}}",
            "{name: c, type: checks-layout, options: {layout: HND}}",
        )
    )
    assert p.message == "children need different KV cache layouts: a=NHD, b=NHD, c=HND"
    assert p.path == ("connectors", 2, "type")


def test_agreeing_layouts_are_fine() -> None:
    plan = loads(
        composition(
            "{name: a, type: checks-layout, options: {layout: NHD}}",
            "{name: r, type: record}",
            "{name: b, type: checks-layout, options: {layout: NHD}}",
        )
    )
    assert checks.kvcompose_check(plan) == []


# ------------------------------------------------------------------ a rule's own check of the plan


@dataclass(frozen=True)
class StoreFirstAndCheck(StoreRule, ChecksPlan):
    """A third-party store rule that checks the plan itself: it wants at least two children."""

    targets: tuple[int, ...]

    def check(self, plan: Plan) -> list[Problem]:
        if len(plan.children) > 1:
            return []
        return [Problem("store rule 'first-checked' wants two children", ("rules", "store"), "add one")]


class _CheckingRule:
    @hookimpl
    def kvcompose_rules(self) -> list[Rule[Any]]:
        return [Rule("store", "first-checked", "", lambda children, p: StoreFirstAndCheck((children[0].index,)))]


@pytest.fixture
def checking_rule(kvcompose_plugins: Plugins) -> Iterator[Plugins]:
    plugin = _CheckingRule()
    kvcompose_plugins.register(plugin, name="tests.unit.test_rules_checks.rule")
    try:
        yield kvcompose_plugins
    finally:
        kvcompose_plugins.unregister(plugin)


def test_a_rule_checks_its_own_plan(checking_rule: Plugins) -> None:
    [p] = problems(composition("{name: rec, type: record}", rules="{store: first-checked}"))
    assert p.message == "store rule 'first-checked' wants two children"
    assert p.path == ("rules", "store") and p.line == 4 and p.hint == "add one"


def test_a_rule_whose_check_finds_nothing_is_clean(checking_rule: Plugins) -> None:
    plan = loads(composition("{name: a, type: record}", "{name: b, type: record}", rules="{store: first-checked}"))
    assert isinstance(plan.store, ChecksPlan) and checks.kvcompose_check(plan) == []


def test_the_owners_params_rule_checks_its_keys_itself() -> None:
    plan = loads(composition("{name: x, type: checks-keys}", "{name: y, type: checks-keys}", rules="{params: strict}"))
    owners = Owners(plan.children)
    assert isinstance(owners, ChecksPlan) and not isinstance(plan.params, ChecksPlan)
    [p] = owners.check(plan)
    assert p.message == "kv_transfer_params key 'k1' is owned by both x and y"


# ------------------------------------------------------------------ the child-index helpers


def test_index_resolves_one_name_or_locates_the_problem() -> None:
    plan = loads(composition("{name: host, type: record}", "{name: pd, type: record}"))
    assert index(plan.children, "pd") == 1
    with pytest.raises(CompositionError) as err:
        index(plan.children, "hots", ("child",))
    [p] = err.value.problems
    assert (p.message, p.path, p.hint) == ("no connector is named 'hots'", ("child",), "did you mean host?")
