"""The metadata rule ``merge``: per-child metadata by name, checked on arrival. No vLLM."""

from __future__ import annotations

from typing import Any

import pytest

from kvcompose.catalog import Rule
from kvcompose.compose import loads
from kvcompose.contract import MetadataRule
from kvcompose.rules import metadata
from kvcompose.rules.metadata import Merge, MetadataMismatch
from tests.unit.three import THREE


def merge_rule() -> Rule[Any]:
    [rule] = metadata.kvcompose_rules()
    return rule


def test_merge_is_built_with_the_childrens_names() -> None:
    rule = merge_rule()
    assert (rule.kind, rule.name, rule.params) == ("metadata", "merge", None)
    obj = rule.build(loads(THREE).children, None)
    assert isinstance(obj, Merge) and isinstance(obj, MetadataRule)
    assert obj.names == ("a", "b", "c")
    assert isinstance(loads(THREE).metadata, Merge)


def test_pack_keys_each_entry_by_name_in_yaml_order() -> None:
    payload = Merge(["a", "b", "c"]).pack([1, None, {"x": 3}])
    assert payload == {"a": 1, "b": None, "c": {"x": 3}}
    assert list(payload) == ["a", "b", "c"]


def test_unpack_gives_the_entries_back_in_yaml_order() -> None:
    rule = Merge(["a", "b", "c"])
    metas: list[Any] = [object(), None, object()]  # None: a bypassed child's slot
    out = rule.unpack(rule.pack(metas))
    assert len(out) == 3 and all(x is y for x, y in zip(out, metas))


@pytest.mark.parametrize("metas", [[1, 2], [1, 2, 3, 4], []])
def test_pack_refuses_the_wrong_number_of_entries(metas: list[int]) -> None:
    with pytest.raises(MetadataMismatch, match=rf"{len(metas)} metadata entries for 3 children"):
        Merge(["a", "b", "c"]).pack(metas)


def test_unpack_names_a_missing_child() -> None:
    with pytest.raises(MetadataMismatch) as err:
        Merge(["a", "b", "c"]).unpack({"a": 1, "c": 3})
    text = str(err.value)
    assert "missing: ['b']" in text and "unexpected: none" in text
    assert "different compositions" in text


def test_unpack_names_an_unexpected_child() -> None:
    with pytest.raises(MetadataMismatch) as err:
        Merge(["a", "b"]).unpack({"a": 1, "b": 2, "x": 3})
    text = str(err.value)
    assert "missing: none" in text and "unexpected: ['x']" in text


def test_unpack_names_both_at_once() -> None:
    with pytest.raises(MetadataMismatch) as err:
        Merge(["a", "b"]).unpack({"a": 1, "z": 2})
    text = str(err.value)
    assert "missing: ['b']" in text and "unexpected: ['z']" in text


def test_unpack_never_hands_a_child_another_childs_entry() -> None:
    # The same names in another order: refused, or put back in YAML order, but never zipped.
    rule = Merge(["a", "b"])
    try:
        out = rule.unpack({"b": "for b", "a": "for a"})
    except MetadataMismatch:
        return
    assert list(out) == ["for a", "for b"]


def test_metadata_mismatch_is_a_runtime_error() -> None:
    assert issubclass(MetadataMismatch, RuntimeError)


def test_explanation_names_the_children() -> None:
    rule = merge_rule()
    assert rule.explain is not None
    assert "(a, b, c)" in rule.explain(loads(THREE).children, None)
