"""Store rules: which children receive the save hooks (``save_kv_layer``, ``wait_for_save``).

Each child still decides from its own metadata what to save; the rule decides who is asked.
"""

from __future__ import annotations

from typing import Any

from kvcompose import hookimpl
from kvcompose.catalog import Rule
from kvcompose.rules._children import ChildrenParams, indices


def _all(children: tuple[Any, ...], params: Any) -> tuple[int, ...]:
    return tuple(c.index for c in children)


def _only(children: tuple[Any, ...], params: ChildrenParams) -> tuple[int, ...]:
    return indices(children, params.children)


@hookimpl
def kvcompose_rules() -> list[Rule]:
    return [
        Rule("store", "all", "every child gets every save hook (store-to-all)", _all,
             explain=lambda ch, p: "store: every child may store (" + ", ".join(c.name for c in ch) + ")"),
        Rule("store", "only", "only the listed children get save hooks", _only, params=ChildrenParams,
             explain=lambda ch, p: "store: only " + ", ".join(p.children) + " get save hooks"),
    ]
