"""Fault rules: what happens when a child raises."""

from __future__ import annotations

from typing import Any

from kvcompose import hookimpl
from kvcompose.catalog import Rule
from kvcompose.rules._children import ChildrenParams, indices


def _isolate(children: tuple[Any, ...], params: ChildrenParams) -> frozenset[int]:
    return frozenset(indices(children, params.children))


@hookimpl
def kvcompose_rules() -> list[Rule]:
    return [
        Rule("faults", "fail", "an exception in any child propagates (vLLM's behaviour)",
             lambda children, params: frozenset(),
             explain=lambda ch, p: "faults: an error in any child stops the engine"),
        Rule("faults", "isolate", "the listed best-effort children are disabled on error; their requests recompute",
             _isolate, params=ChildrenParams,
             explain=lambda ch, p: "faults: " + ", ".join(p.children) + " are best-effort: on error they are disabled and their loads recompute"),
    ]
