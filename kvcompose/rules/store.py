"""Store rules: which children receive the save hooks (``save_kv_layer``, ``wait_for_save``).

Each child still decides from its own metadata what to save; the rule decides who is asked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvcompose import hookimpl
from kvcompose.catalog import Child, Rule
from kvcompose.contract import StoreRule
from kvcompose.rules.children import ChildrenParams, indices


@dataclass(frozen=True)
class StoreTo(StoreRule):
    """Save hooks go to a fixed set of children."""

    targets: tuple[int, ...]


def _all(children: tuple[Child, ...], params: None) -> StoreTo:
    return StoreTo(tuple(c.index for c in children))


def _only(children: tuple[Child, ...], params: ChildrenParams) -> StoreTo:
    return StoreTo(indices(children, params.children))


@hookimpl
def kvcompose_rules() -> list[Rule[Any]]:
    return [
        Rule(
            "store",
            "all",
            "every child gets every save hook (store-to-all)",
            _all,
            explain=lambda ch, p: "store: every child may store (" + ", ".join(c.name for c in ch) + ")",
        ),
        Rule(
            "store",
            "only",
            "only the listed children get save hooks",
            _only,
            params=ChildrenParams,
            explain=lambda ch, p: "store: only " + ", ".join(p.children) + " get save hooks",
        ),
    ]
