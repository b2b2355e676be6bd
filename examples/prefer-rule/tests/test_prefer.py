"""The rule alone: ``select`` with a scripted ``ask``, and ``build``'s errors. No vLLM needed."""

from __future__ import annotations

import pytest
from kvcompose_prefer.plugin import Prefer

from kvcompose.api import NO_HIT, NOT_READY, Ask, CompositionError, Contribution, Selection
from kvcompose.compose import loads
from kvcompose.plugins import Plugins

# Child 0 is asked first in YAML order; the rule prefers child 1 for requests carrying the key.
RULE = Prefer(child=1, key="prefer_host")
KEYED = {"prefer_host": True}


def ask_from(answers: dict[int, tuple[int | None, bool]], asked: list[int]) -> Ask:
    def ask(child: int, num_computed_tokens: int) -> tuple[int | None, bool]:
        asked.append(child)
        return answers[child]

    return ask


@pytest.mark.parametrize(
    ("params", "answers", "expected", "asked"),
    [
        # Without the key: first-wins in YAML order, and the child after the winner is not asked.
        (None, {0: (32, False), 1: (48, True)}, Selection(32, False, (Contribution(0, 0, 32, False),)), [0]),
        ({"other": 1}, {0: (32, False), 1: (48, True)}, Selection(32, False, (Contribution(0, 0, 32, False),)), [0]),
        # With the key: the preferred child is asked first and wins with its hit.
        (KEYED, {0: (32, False), 1: (48, True)}, Selection(48, True, (Contribution(1, 0, 48, True),)), [1]),
        # ... and without one the others follow in YAML order.
        (KEYED, {0: (32, False), 1: (0, False)}, Selection(32, False, (Contribution(0, 0, 32, False),)), [1, 0]),
        # A preferred child still looking the request up holds it back a step.
        (KEYED, {0: (32, False), 1: (None, False)}, NOT_READY, [1]),
        (KEYED, {0: (0, False), 1: (0, False)}, NO_HIT, [1, 0]),
    ],
)
def test_select(
    params: dict[str, object] | None,
    answers: dict[int, tuple[int | None, bool]],
    expected: Selection,
    asked: list[int],
) -> None:
    seen: list[int] = []
    assert RULE.select(ask_from(answers, seen), (0, 1), 0, params) == expected
    assert seen == asked


def test_a_disabled_preferred_child_is_not_asked() -> None:
    seen: list[int] = []
    selection = RULE.select(ask_from({0: (32, False), 1: (48, False)}, seen), (0,), 0, KEYED)
    assert selection.contributions == (Contribution(0, 0, 32, False),) and seen == [0]


YAML = """\
version: 1
connectors:
  - {name: pd, type: record}
  - {name: host, type: record}
rules:
  load: {use: prefer, child: %s, key: prefer_host}
"""


def test_build_resolves_the_child_once(kvcompose_plugins: Plugins) -> None:
    plan = loads(YAML % "host", kvcompose_plugins)
    assert plan.load == Prefer(child=1, key="prefer_host")
    expected = "load: a request whose kv_transfer_params carry 'prefer_host' asks host first; otherwise"
    assert any(line.startswith(expected) for line in plan.explain())


def test_an_unknown_child_is_a_located_error(kvcompose_plugins: Plugins) -> None:
    with pytest.raises(CompositionError) as err:
        loads(YAML % "hots", kvcompose_plugins, filename="c.yaml")
    assert str(err.value) == "c.yaml:6:30: rules.load.child: no connector is named 'hots' (did you mean host?)"
