"""The completion rule ``owner`` (in ``kvcompose/rules/load.py``, beside the load rules): whose
reports count, and when a load or a free is done. No vLLM.

The record it is asked about is the adapter's (``tests/adapter/test_transfers.py``)."""

from __future__ import annotations

from typing import Any

from kvcompose.catalog import Rule
from kvcompose.compose import loads
from kvcompose.contract import CompletionRule
from kvcompose.rules import load
from kvcompose.rules.load import Owner
from tests.unit.three import THREE


def owner_rule() -> Rule[Any]:
    [rule] = [r for r in load.kvcompose_rules() if r.kind == "completion"]
    return rule


def test_owner_is_the_default_and_takes_no_parameters() -> None:
    rule = owner_rule()
    assert (rule.kind, rule.name, rule.params) == ("completion", "owner", None)
    obj = rule.build(loads(THREE).children, None)
    assert isinstance(obj, Owner) and isinstance(obj, CompletionRule)
    assert isinstance(loads(THREE).completion, Owner)


def test_only_an_awaited_childs_report_counts() -> None:
    assert Owner().counts(0, (0, 1)) and Owner().counts(1, (0, 1))
    assert not Owner().counts(2, (0, 1))
    assert not Owner().counts(0, ())


def test_a_load_or_a_free_is_done_when_every_child_it_waits_for_reported() -> None:
    assert not Owner().done((0, 1), set())
    assert not Owner().done((0, 1), {0})
    assert not Owner().done((0, 1), {0, 2})
    assert Owner().done((0, 1), {1, 0})
    assert Owner().done((2,), {0, 1, 2})


def test_explanation() -> None:
    rule = owner_rule()
    assert rule.explain is not None
    assert "each once" in rule.explain(loads(THREE).children, None)
