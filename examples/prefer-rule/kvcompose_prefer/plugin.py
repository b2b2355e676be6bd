"""The ``prefer`` load rule: ask a named child first for the requests that ask for it.

``load: {use: prefer, child: host, key: prefer_host}`` asks ``host`` first for a request whose
``kv_transfer_params`` carry the key ``prefer_host`` (whatever its value), and every other
request's children in YAML order; either way the first child with a hit loads and the children
after it are not asked (the built-in ``first-wins``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

from kvcompose.api import Child, FirstWins, Rule, hookimpl, index


class PreferParams(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The rule's parameters; a misspelt key is a located error, not a silently ignored one."""

    child: Annotated[str, msgspec.Meta(description="the connector asked first (its `name:`)")]
    key: Annotated[
        str,
        msgspec.Meta(min_length=1, description="the kv_transfer_params key that marks a request as preferring it"),
    ]


@dataclass(frozen=True)
class Prefer(FirstWins):
    """First-wins over an order that puts :attr:`child` first for the requests carrying :attr:`key`.

    :class:`FirstWins` asks in :meth:`order` and stops at the first hit; its ``StandardLoad`` base
    gives ``allocate`` and ``awaited``: the winner gets every external token, and an async
    winner's report completes the load.
    """

    child: int
    key: str

    def order(self, children: Sequence[int], kv_transfer_params: Mapping[str, Any] | None) -> Sequence[int]:
        # A bypassed preferred child is not in ``children``: its requests fall back to YAML order.
        if kv_transfer_params and self.key in kv_transfer_params and self.child in children:
            return (self.child, *(i for i in children if i != self.child))
        return children


def build(children: tuple[Child, ...], params: PreferParams) -> Prefer:
    """Runs once per composition: a child name is resolved to its index here, never per request.
    An unknown name is a problem at ``rules.load.child``, with its line and column."""
    return Prefer(index(children, params.child, ("child",)), params.key)


def explain(children: tuple[Child, ...], params: PreferParams) -> str:
    """The line ``kvcompose check`` prints for this rule."""
    order = " > ".join(c.name for c in children)
    return (
        f"load: a request whose kv_transfer_params carry {params.key!r} asks {params.child} first; "
        f"otherwise the first child with a hit loads, in this order: {order}; later children are not asked"
    )


@hookimpl
def kvcompose_rules() -> list[Rule[Any]]:
    return [
        Rule(
            "load",
            "prefer",
            "a named child is asked first for requests carrying a kv_transfer_params key; otherwise first-wins",
            build,
            params=PreferParams,
            explain=explain,
        )
    ]
