"""Load rules: who loads a request's external KV (vLLM's ``get_num_new_matched_tokens`` and
``update_state_after_alloc``).

vLLM's answer ``(0, False)`` means "nothing here" and ``None`` means "ask me again later", so
the rules walk children in YAML order themselves instead of using pluggy's ``firstresult``
(which runs LIFO and skips ``None``). Both built-in rules pick one child; the allocation split and
load completion are :class:`~kvcompose.rules.contract.LoadRule`'s defaults: the winner gets the
external tokens, the others 0, and an async winner's report completes the load.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvcompose import hookimpl
from kvcompose.catalog import Rule
from kvcompose.rules.contract import NO_HIT, NOT_READY, Ask, Contribution, LoadRule, Selection


def single(child: int, tokens: int, is_async: bool) -> Selection:
    """A selection in which one child loads every external token."""
    return Selection(tokens, is_async, (Contribution(child, 0, tokens, is_async),))


class FirstWins(LoadRule):
    """The first child in YAML order with a hit loads; children below it are not asked.

    Not asking them matters: probing is not free of side effects (vLLM's CPU offload pins the
    blocks it matched until ``update_state_after_alloc``). A ``None`` from a child *above* the
    winner means that child may still answer with a hit, so the request waits a step.
    """

    def select(
        self,
        ask: Ask,
        children: Sequence[int],
        num_computed_tokens: int,
        kv_transfer_params: Mapping[str, Any] | None,
    ) -> Selection:
        for i in children:
            tokens, is_async = ask(i, num_computed_tokens)
            if tokens is None:
                return NOT_READY
            if tokens > 0:
                return single(i, tokens, is_async)
        return NO_HIT


class LongestHit(LoadRule):
    """Every child is asked; the one with the most tokens loads (ties go to YAML order)."""

    def select(
        self,
        ask: Ask,
        children: Sequence[int],
        num_computed_tokens: int,
        kv_transfer_params: Mapping[str, Any] | None,
    ) -> Selection:
        best = NO_HIT
        waiting = False
        for i in children:
            tokens, is_async = ask(i, num_computed_tokens)
            if tokens is None:
                waiting = True
            elif tokens > (best.tokens or 0):
                best = single(i, tokens, is_async)
        # A child still looking up might beat the best hit so far.
        return NOT_READY if waiting else best


def _explain_first(children: tuple[Any, ...], _: Any) -> str:
    order = " > ".join(c.name for c in children)
    return f"load: the first child with a hit loads, in this order: {order}; later children are not asked"


def _explain_longest(children: tuple[Any, ...], _: Any) -> str:
    return "load: every child is asked; the longest hit loads (ties: " + " > ".join(c.name for c in children) + ")"


@hookimpl
def kvcompose_rules() -> list[Rule[Any]]:
    return [
        Rule(
            "load",
            "first-wins",
            "first child in YAML order with a hit loads "
            "(vLLM MultiConnector's rule, without its None and probing defects)",
            lambda children, params: FirstWins(),
            explain=_explain_first,
        ),
        Rule(
            "load",
            "longest-hit",
            "every child is asked; the most matched tokens wins",
            lambda children, params: LongestHit(),
            explain=_explain_longest,
        ),
    ]
