"""Params rules (``owners``, ``strict``): merging the children's ``kv_transfer_params``. No vLLM."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from kvcompose.catalog import Child, Rule
from kvcompose.compose import loads
from kvcompose.contract import ParamsRule
from kvcompose.rules import params
from kvcompose.rules.params import Owners, ParamsClash, Strict

#: A prefix tier above the P/D transport (which declares the NIXL-style keys).
HOST_THEN_PD = """
version: 1
connectors:
  - {name: host, type: record}
  - {name: pd, type: record-pd}
  - {name: extra, type: record}
"""
LOGGER = "kvcompose.rules.params"


def children() -> tuple[Child, ...]:
    return loads(HOST_THEN_PD).children


def built_rules() -> dict[str, Rule[Any]]:
    return {r.name: r for r in params.kvcompose_rules()}


def owners() -> Owners:
    obj = built_rules()["owners"].build(children(), None)
    assert isinstance(obj, Owners)
    return obj


def strict() -> Strict:
    obj = built_rules()["strict"].build(children(), None)
    assert isinstance(obj, Strict)
    return obj


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


def test_the_module_offers_owners_and_strict() -> None:
    rules = built_rules()
    assert set(rules) == {"owners", "strict"}
    assert all(r.kind == "params" and r.params is None for r in rules.values())
    for rule in rules.values():
        assert isinstance(rule.build(children(), None), ParamsRule)


def test_owners_is_the_default_and_strict_is_chosen_by_name() -> None:
    assert isinstance(loads(HOST_THEN_PD).params, Owners)
    assert isinstance(loads(HOST_THEN_PD + "rules: {params: strict}\n").params, Strict)


# ------------------------------------------------------------------ owners


def test_owners_a_key_owned_by_another_child_is_dropped(caplog: pytest.LogCaptureFixture) -> None:
    rule = owners()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        merged = rule.merge([{"remote_block_ids": [9], "mine": 1}, {"remote_block_ids": [1, 2]}, None])
    assert merged == {"remote_block_ids": [1, 2], "mine": 1}
    [line] = warnings(caplog)
    assert "from host" in line and "'remote_block_ids' belongs to pd" in line


def test_owners_drops_an_owned_key_even_when_the_owner_returned_none() -> None:
    assert owners().merge([{"remote_host": "evil"}, None, None]) is None
    assert owners().merge([None, None, {"do_remote_decode": True, "x": 1}]) == {"x": 1}


def test_owners_the_owner_keeps_its_keys() -> None:
    pd = {"do_remote_prefill": True, "remote_block_ids": [3], "remote_engine_id": "e", "remote_port": 5600}
    assert owners().merge([None, pd, None]) == pd


def test_owners_a_dropped_key_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    rule = owners()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for _ in range(3):
            rule.merge([{"remote_block_ids": [9]}, {"remote_block_ids": [1]}, {"remote_block_ids": [7]}])
    lines = warnings(caplog)
    # once per (child, key): host's and extra's, not once per merge
    assert len(lines) == 2
    assert any("from host" in x for x in lines) and any("from extra" in x for x in lines)


def test_owners_undeclared_keys_first_child_wins(caplog: pytest.LogCaptureFixture) -> None:
    rule = owners()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        merged = rule.merge([{"shared": "host"}, {"shared": "pd"}, {"shared": "extra", "own": 1}])
        rule.merge([{"shared": "host"}, {"shared": "pd"}, {"shared": "extra", "own": 1}])
    assert merged == {"shared": "host", "own": 1}
    lines = warnings(caplog)
    assert len(lines) == 2  # pd's and extra's, once each
    assert all("'shared' was already returned by host" in x for x in lines)


def test_owners_undeclared_keys_first_answering_child_wins() -> None:
    # The first child that *returned* the key, not the first child in YAML order.
    assert owners().merge([None, {"shared": "pd"}, {"shared": "extra"}]) == {"shared": "pd"}


@pytest.mark.parametrize("results", [[None, None, None], [{}, None, {}], []])
def test_owners_nothing_is_none(results: list[dict[str, Any] | None]) -> None:
    assert owners().merge(results) is None


def test_owners_does_not_change_the_childrens_dicts() -> None:
    host: dict[str, Any] = {"remote_block_ids": [9], "a": 1}
    pd: dict[str, Any] = {"remote_block_ids": [1]}
    merged = owners().merge([host, pd, None])
    assert host == {"remote_block_ids": [9], "a": 1} and pd == {"remote_block_ids": [1]}
    assert merged is not host and merged is not pd


def test_owners_without_declared_keys_is_first_child_wins() -> None:
    plan = loads("version: 1\nconnectors: [{name: x, type: record}, {name: y, type: record}]\n")
    assert isinstance(plan.params, Owners)
    assert plan.params.merge([{"k": 1}, {"k": 2, "j": 3}]) == {"k": 1, "j": 3}


# ------------------------------------------------------------------ strict


def test_strict_a_clash_raises_naming_both_children() -> None:
    with pytest.raises(ParamsClash, match=r"key 'shared' returned by both host and extra"):
        strict().merge([{"shared": 1}, None, {"shared": 2}])


def test_strict_clash_on_an_owned_key_names_both_children() -> None:
    with pytest.raises(ParamsClash) as err:
        strict().merge([{"remote_block_ids": [9]}, {"remote_block_ids": [1]}, None])
    assert "host" in str(err.value) and "pd" in str(err.value) and "'remote_block_ids'" in str(err.value)


def test_strict_no_clash_merges() -> None:
    merged = strict().merge([{"a": 1}, {"remote_block_ids": [1]}, {"b": 2}])
    assert merged == {"a": 1, "remote_block_ids": [1], "b": 2}


def test_strict_ignores_ownership() -> None:
    # MultiConnector's rule: whoever returns a key alone keeps it.
    assert strict().merge([{"remote_block_ids": [9]}, None, None]) == {"remote_block_ids": [9]}


def test_strict_equal_values_still_clash() -> None:
    with pytest.raises(ParamsClash):
        strict().merge([{"k": 1}, {"k": 1}, None])


@pytest.mark.parametrize("results", [[None, None, None], [{}, {}, None], []])
def test_strict_nothing_is_none(results: list[dict[str, Any] | None]) -> None:
    assert strict().merge(results) is None


def test_params_clash_is_a_runtime_error() -> None:
    assert issubclass(ParamsClash, RuntimeError)


def test_explanations() -> None:
    rules = built_rules()
    own, st = rules["owners"], rules["strict"]
    assert own.explain is not None and st.explain is not None
    text = own.explain(children(), None)
    assert text.startswith("params: kv_transfer_params merged by declared owner; pd owns ")
    assert "(6 keys)" in text
    # children that declare nothing are named, with what happens to their keys
    assert text.endswith(
        "; host, extra declare no keys: a key no child declares goes to the first child in YAML order that returns it"
    )
    assert "a key returned twice is an error" in st.explain(children(), None)
