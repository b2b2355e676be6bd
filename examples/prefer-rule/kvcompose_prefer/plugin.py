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

from kvcompose import hookimpl
from kvcompose.catalog import Child, Rule
from kvcompose.errors import CompositionError, Problem, did_you_mean
from kvcompose.rules.contract import NO_HIT, NOT_READY, Ask, Contribution, LoadRule, Selection


class PreferParams(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The rule's parameters; a misspelt key is a located error, not a silently ignored one."""

    child: Annotated[str, msgspec.Meta(description="the connector asked first (its `name:`)")]
    key: Annotated[
        str,
        msgspec.Meta(min_length=1, description="the kv_transfer_params key that marks a request as preferring it"),
    ]


@dataclass(frozen=True)
class Prefer(LoadRule):
    """First-wins over an order that puts :attr:`child` first for the requests carrying :attr:`key`.

    Subclassing :class:`LoadRule` gives the Protocol's ``allocate`` and ``awaited``: the winner
    gets every external token, and an async winner's report completes the load.
    """

    child: int
    key: str

    def select(
        self,
        ask: Ask,
        children: Sequence[int],
        num_computed_tokens: int,
        kv_transfer_params: Mapping[str, Any] | None,
    ) -> Selection:
        order: Sequence[int] = children
        # A disabled preferred child is not in ``children``: its requests fall back to YAML order.
        if kv_transfer_params and self.key in kv_transfer_params and self.child in children:
            order = (self.child, *(i for i in children if i != self.child))
        for i in order:
            tokens, is_async = ask(i, num_computed_tokens)
            if tokens is None:
                # A child asked before any hit may still have one: look the request up next step.
                return NOT_READY
            if tokens > 0:
                # Probing is not free (vLLM's CPU offload pins what it matched), so stop here.
                return Selection(tokens, is_async, (Contribution(i, 0, tokens, is_async),))
        return NO_HIT


def build(children: tuple[Child, ...], params: PreferParams) -> Prefer:
    """Runs once per composition: a child name is resolved to its index here, never per request."""
    by_name = {c.name: c.index for c in children}
    if params.child not in by_name:
        # The path is relative to the rule (``rules.load``); kvcompose adds the line and column.
        raise CompositionError(
            [Problem(f"no connector is named {params.child!r}", ("child",), did_you_mean(params.child, by_name))]
        )
    return Prefer(by_name[params.child], params.key)


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
