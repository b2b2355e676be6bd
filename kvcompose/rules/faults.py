"""Fault rules: what happens when a child raises."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvcompose import hookimpl
from kvcompose.catalog import Child, Rule
from kvcompose.rules._children import ChildrenParams, indices
from kvcompose.rules.contract import FaultsRule


@dataclass(frozen=True)
class Contain(FaultsRule):
    """Errors of the ``best_effort`` children are contained; a disabled child's outstanding loads
    are reported failed (the :class:`FaultsRule` default for :meth:`owed`)."""

    best_effort: frozenset[int]

    def contains(self, child: int) -> bool:
        return child in self.best_effort


def _isolate(children: tuple[Child, ...], params: ChildrenParams) -> Contain:
    return Contain(frozenset(indices(children, params.children)))


@hookimpl
def kvcompose_rules() -> list[Rule[Any]]:
    return [
        Rule(
            "faults",
            "fail",
            "an exception in any child propagates (vLLM's behaviour)",
            lambda children, params: Contain(frozenset()),
            explain=lambda ch, p: "faults: an error in any child stops the engine",
        ),
        Rule(
            "faults",
            "isolate",
            "the listed best-effort children are disabled on error; their requests recompute",
            _isolate,
            params=ChildrenParams,
            explain=lambda ch, p: (
                "faults: "
                + ", ".join(p.children)
                + " are best-effort: on error they are disabled and their loads recompute"
            ),
        ),
    ]
