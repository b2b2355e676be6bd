"""The type rule that combines the children's answers where kvcompose has no rule of its own
(carried transfer-result fields, engine calls kvcompose does not know)."""

from __future__ import annotations

from typing import Any

import pytest

from kvcompose.merge import merge_values


@pytest.mark.parametrize(
    ("answers", "merged"),
    [
        ([], None),
        ([None, None], None),
        ([None, 3], 3),
        ([True, False], True),
        ([False, False], False),
        ([2, 3, None], 5),
        ([0.5, 1], 1.5),
        ([{"a"}, {"b"}, None], {"a", "b"}),
        ([frozenset({1}), frozenset({2})], frozenset({1, 2})),
        ([[1, 2], [3]], [1, 2, 3]),
        ([(1,), (2,)], (1, 2)),
        (["first", "second"], "first"),
        ([None, "only"], "only"),
        # Mixed types: the first answer, in YAML order.
        ([{"a": 1}, [1]], {"a": 1}),
        ([1, True], 1),
    ],
)
def test_answers_merge_by_type(answers: list[Any], merged: Any) -> None:
    result = merge_values(answers)
    assert result == merged and type(result) is type(merged)


def test_dicts_union_their_keys_and_merge_a_shared_key_by_the_same_rule() -> None:
    # A results field like vLLM main's prefix_replay_checkpoints: request id -> something.
    a = {"r1": {"blocks": [1, 2], "tokens": 32}, "r2": {"done": False}}
    b = {"r1": {"blocks": [3], "tokens": 16}, "r3": {"done": True}}
    assert merge_values([a, None, b]) == {
        "r1": {"blocks": [1, 2, 3], "tokens": 48},
        "r2": {"done": False},
        "r3": {"done": True},
    }


def test_the_childrens_answers_are_not_changed() -> None:
    a, b = {"r1": [1]}, {"r1": [2]}
    merge_values([a, b])
    assert (a, b) == ({"r1": [1]}, {"r1": [2]})
