"""The rule contract (:mod:`kvcompose.contract`): the plain data, the Protocols' defaults,
every built-in rule building its kind's Protocol, and the resolver refusing a rule that does not.

No vLLM: the rule layer must be importable and testable without it (checked in a fresh process).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from kvcompose import hookimpl
from kvcompose.catalog import Child, Rule
from kvcompose.compose import loads
from kvcompose.config import DEFAULT_RULES
from kvcompose.contract import (
    NO_HIT,
    NOT_READY,
    PROTOCOLS,
    RULE_KINDS,
    Ask,
    Contribution,
    FaultMonitor,
    FaultsRule,
    LoadRule,
    Selection,
    StoreRule,
    TransferResults,
)
from kvcompose.errors import CompositionError, Problem
from kvcompose.plugins import BUILTIN_PLUGINS, Plugins
from kvcompose.rules import faults, load, metadata, params, store
from kvcompose.rules.children import ChildrenParams
from kvcompose.rules.load import FirstWins, StandardLoad
from kvcompose.rules.store import StoreTo
from tests.unit.three import THREE

RULE_MODULES: tuple[ModuleType, ...] = (load, store, metadata, params, faults)


# ------------------------------------------------------------------ kinds and Protocols


def test_one_protocol_per_kind_in_order() -> None:
    assert RULE_KINDS == ("load", "store", "metadata", "params", "completion", "faults")
    assert tuple(PROTOCOLS) == RULE_KINDS
    assert all(getattr(p, "_is_runtime_protocol", False) for p in PROTOCOLS.values())


def test_every_kind_has_a_builtin_default() -> None:
    builtin = {(r.kind, r.name) for m in RULE_MODULES for r in m.kvcompose_rules()}
    assert set(DEFAULT_RULES) == set(RULE_KINDS)
    assert {(k, n) for k, n in DEFAULT_RULES.items()} <= builtin


def test_the_rule_modules_are_builtin_plugins() -> None:
    assert {m.__name__ for m in RULE_MODULES} <= set(BUILTIN_PLUGINS)
    assert "kvcompose.rules.checks" in BUILTIN_PLUGINS


# ------------------------------------------------------------------ plain data


def test_not_ready_and_no_hit() -> None:
    assert NOT_READY == Selection(None, False) and NOT_READY.contributions == ()
    assert NO_HIT == Selection(0, False) and NO_HIT.contributions == ()
    assert NOT_READY != NO_HIT


def test_contribution_and_selection_are_frozen_values() -> None:
    c = Contribution(1, 0, 16, True)
    assert c == Contribution(1, 0, 16, True) and hash(c) == hash(Contribution(1, 0, 16, True))
    sel = Selection(16, True, (c,))
    with pytest.raises(AttributeError):
        c.tokens = 8  # type: ignore[misc]
    with pytest.raises(AttributeError):
        sel.tokens = 8  # type: ignore[misc]


def test_transfer_results_defaults_are_empty_and_not_shared() -> None:
    one, two = TransferResults(), TransferResults()
    assert one == TransferResults(set(), set(), set())
    one.finished_recving.add("r")
    assert two.finished_recving == set()


@pytest.mark.parametrize(
    ("results", "truth"),
    [
        (TransferResults(), False),
        (TransferResults(finished_sending={"r"}), True),
        (TransferResults(finished_recving={"r"}), True),
        (TransferResults(failed_recving={"r"}), True),
    ],
)
def test_transfer_results_truth_is_any_report(results: TransferResults, truth: bool) -> None:
    assert bool(results) is truth


# ------------------------------------------------------------------ what a rule inherits


class SelectOnly(StandardLoad):
    """A third-party load rule that writes only ``select`` and inherits the rest."""

    def select(
        self, ask: Ask, children: Sequence[int], num_computed_tokens: int, kv_transfer_params: Mapping[str, Any] | None
    ) -> Selection:
        return Selection(24, True, (Contribution(0, 0, 8, False), Contribution(1, 8, 16, True)))


def test_an_explicit_load_rule_subclass_inherits_allocate_and_awaited() -> None:
    rule = SelectOnly()
    assert isinstance(rule, LoadRule)
    sel = rule.select(lambda i, n: (0, False), (0, 1), 0, None)
    assert rule.allocate(sel, 12) == (Contribution(0, 0, 8, False), Contribution(1, 8, 4, True))
    assert rule.awaited(rule.allocate(sel, 12)) == (1,)
    assert rule.awaited(rule.allocate(sel, 8)) == ()


class ContainNothing(FaultsRule):
    def contains(self, child: int) -> bool:
        return False


def test_an_explicit_faults_rule_subclass_inherits_the_isolation_monitor() -> None:
    rule = ContainNothing()
    assert isinstance(rule, FaultsRule)
    monitor = rule.monitor()
    assert monitor.failed(1) and monitor.state(1) == "open" and monitor.step() == ()


# ------------------------------------------------------------------ every built-in rule builds its Protocol


def builtin_rules() -> list[Rule[Any]]:
    return [r for m in RULE_MODULES for r in m.kvcompose_rules()]


def rule_params(rule: Rule[Any]) -> Any:
    if rule.params is None:
        return None
    assert issubclass(rule.params, ChildrenParams), f"a new parametrised built-in rule: {rule.kind}/{rule.name}"
    return rule.params(children=["a", "c"])  # the others have defaults (breaker's thresholds)


@pytest.mark.parametrize("rule", builtin_rules(), ids=lambda r: f"{r.kind}/{r.name}")
def test_every_builtin_rule_builds_its_kinds_protocol(rule: Rule[Any]) -> None:
    obj = rule.build(loads(THREE).children, rule_params(rule))
    assert isinstance(obj, PROTOCOLS[rule.kind])
    others = [p for k, p in PROTOCOLS.items() if k != rule.kind]
    assert not any(isinstance(obj, p) for p in others), "a rule object should implement one kind"
    if isinstance(obj, FaultsRule):
        assert isinstance(obj.monitor(), FaultMonitor)


@pytest.mark.parametrize("rule", builtin_rules(), ids=lambda r: f"{r.kind}/{r.name}")
def test_every_builtin_rule_resolves_from_yaml_and_explains_itself(rule: Rule[Any]) -> None:
    choice = rule.name if rule.params is None else f"{{use: {rule.name}, children: [a, c]}}"
    plan = loads(THREE + f"rules: {{{rule.kind}: {choice}}}\n")
    assert (plan.rules[rule.kind].kind, plan.rules[rule.kind].name) == (rule.kind, rule.name)
    assert isinstance(getattr(plan, rule.kind), PROTOCOLS[rule.kind])
    assert rule.explain is not None and rule.explain(plan.children, plan.rule_params[rule.kind])


# ------------------------------------------------------------------ a third-party rule of the wrong kind


class RulePlugin:
    """A run-time plugin offering one rule per (kind, name, build)."""

    def __init__(self, rules: list[Rule[Any]]) -> None:
        self.__name__ = "contract-test-plugin"
        self._rules = rules

    @hookimpl
    def kvcompose_rules(self) -> list[Rule[Any]]:
        return self._rules


@pytest.fixture
def offer(kvcompose_plugins: Plugins) -> Iterator[Callable[..., Plugins]]:
    """``offer(kind, name, build)`` registers a rule for this test and returns the plugins."""
    registered: list[RulePlugin] = []

    def add(kind: str, name: str, build: Callable[[tuple[Child, ...], Any], Any]) -> Plugins:
        plugin = RulePlugin([Rule(kind, name, "a test rule", build)])  # type: ignore[arg-type]
        kvcompose_plugins.register(plugin, name=f"contract-test-{kind}-{name}")
        registered.append(plugin)
        return kvcompose_plugins

    yield add
    for plugin in registered:
        kvcompose_plugins.unregister(plugin)


WRONG: dict[str, Any] = {
    "load": StoreTo((0,)),  # another kind's rule object
    "store": FirstWins(),
    "metadata": object(),
    "params": SimpleNamespace(pack=None, unpack=None),  # a metadata rule's shape
    "completion": SimpleNamespace(),
    "faults": SimpleNamespace(contains=lambda child: False),  # no owed
}


@pytest.mark.parametrize("kind", RULE_KINDS)
def test_a_rule_building_the_wrong_kind_of_object_is_refused(kind: str, offer: Callable[..., Plugins]) -> None:
    wrong = WRONG[kind]
    plugins = offer(kind, "broken", lambda children, p: wrong)
    text = THREE + f"rules:\n  {kind}: broken\n"
    with pytest.raises(CompositionError) as err:
        loads(text, plugins=plugins)
    [problem] = err.value.problems
    protocol = PROTOCOLS[kind].__name__  # type: ignore[index]
    assert problem.path == ("rules", kind)
    assert problem.line == 8
    assert f"{kind} rule 'broken' built {type(wrong).__name__}" in problem.message
    assert f"does not implement {protocol} (kvcompose.contract)" in problem.message
    assert problem.hint is not None and "plugin is broken" in problem.hint
    assert f"rules.{kind}: " in str(err.value)


def test_every_wrong_kind_is_reported_together(offer: Callable[..., Plugins]) -> None:
    plugins = offer("load", "bad-load", lambda children, p: object())
    offer("store", "bad-store", lambda children, p: object())
    with pytest.raises(CompositionError) as err:
        loads(THREE + "rules: {load: bad-load, store: bad-store}\n", plugins=plugins)
    assert [p.path for p in err.value.problems] == [("rules", "load"), ("rules", "store")]
    assert "LoadRule" in err.value.problems[0].message and "StoreRule" in err.value.problems[1].message


def test_a_rule_that_does_not_subclass_but_implements_the_protocol_is_accepted(
    offer: Callable[..., Plugins],
) -> None:
    plugins = offer("store", "first-only", lambda children, p: SimpleNamespace(targets=(children[0].index,)))
    plan = loads(THREE + "rules: {store: first-only}\n", plugins=plugins)
    assert isinstance(plan.store, StoreRule) and plan.store.targets == (0,)


def test_a_rule_build_problem_is_located_under_the_rule(offer: Callable[..., Plugins]) -> None:
    def build(children: tuple[Child, ...], p: None) -> Any:
        raise CompositionError([Problem("no good", ("deep",), "fix it")])

    plugins = offer("faults", "refuses", build)
    with pytest.raises(CompositionError) as err:
        loads(THREE + "rules: {faults: refuses}\n", plugins=plugins)
    [problem] = err.value.problems
    assert problem.path == ("rules", "faults", "deep") and problem.message == "no good"


def test_a_registered_rule_is_gone_after_unregister(kvcompose_plugins: Plugins) -> None:
    plugin = RulePlugin([Rule("store", "temporary", "", lambda children, p: StoreTo(()))])
    kvcompose_plugins.register(plugin, name="contract-test-temporary")
    try:
        assert ("store", "temporary") in kvcompose_plugins.rules
    finally:
        kvcompose_plugins.unregister(plugin)
    assert ("store", "temporary") not in kvcompose_plugins.rules
    with pytest.raises(CompositionError, match="unknown store rule 'temporary'"):
        loads(THREE + "rules: {store: temporary}\n", plugins=kvcompose_plugins)


# ------------------------------------------------------------------ no vLLM in the rule layer


def test_the_rule_layer_imports_no_vllm() -> None:
    code = textwrap.dedent(
        """
        import sys
        import kvcompose.rules.checks, kvcompose.contract
        import kvcompose.rules.faults, kvcompose.rules.load, kvcompose.rules.metadata
        import kvcompose.rules.params, kvcompose.rules.store
        import kvcompose.testing.types
        from kvcompose.compose import loads
        from kvcompose.plugins import Plugins

        plugins = Plugins(entry_points=False, extra=[kvcompose.testing.types])
        plan = loads("version: 1\\nconnectors: [{name: a, type: record}, {name: b, type: record-pd}]\\n", plugins)
        assert plan.completion.done((0,), {0})
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("vllm", "torch"))
        assert not heavy, heavy
        print("ok")
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
