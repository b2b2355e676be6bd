"""Load rules: which child loads a request's external KV (``get_num_new_matched_tokens``).

vLLM's answer ``(0, False)`` means "nothing here" and ``None`` means "ask me again later", so
the rules walk children in YAML order themselves instead of using pluggy's ``firstresult``
(which runs LIFO and skips ``None``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvcompose import hookimpl
from kvcompose.catalog import Rule

#: ``ask(i)`` returns child ``i``'s ``(tokens | None, is_async)``.
Ask = Callable[[int], "tuple[int | None, bool]"]


@dataclass(frozen=True, slots=True)
class Selection:
    winner: int | None  # child index that loads, None when no child does
    tokens: int | None  # external tokens; None = not decided yet, ask again next step
    is_async: bool


NOT_READY = Selection(None, None, False)
NO_HIT = Selection(None, 0, False)


class FirstWins:
    """The first child in YAML order with a hit loads; children below it are not asked.

    Not asking them matters: probing is not free of side effects (vLLM's CPU offload pins the
    blocks it matched until ``update_state_after_alloc``). A ``None`` from a child *above* the
    winner means that child may still answer with a hit, so the request waits a step.
    """

    def select(self, ask: Ask, n: int) -> Selection:
        for i in range(n):
            tokens, is_async = ask(i)
            if tokens is None:
                return NOT_READY
            if tokens > 0:
                return Selection(i, tokens, is_async)
        return NO_HIT


class LongestHit:
    """Every child is asked; the one with the most tokens loads (ties go to YAML order)."""

    def select(self, ask: Ask, n: int) -> Selection:
        best = NO_HIT
        waiting = False
        for i in range(n):
            tokens, is_async = ask(i)
            if tokens is None:
                waiting = True
            elif tokens > (best.tokens or 0):
                best = Selection(i, tokens, is_async)
        # A child still looking up might beat the best hit so far.
        return NOT_READY if waiting else best


def _explain_first(children: tuple[Any, ...], _: Any) -> str:
    order = " > ".join(c.name for c in children)
    return f"load: the first child with a hit loads, in this order: {order}; later children are not asked"


def _explain_longest(children: tuple[Any, ...], _: Any) -> str:
    return "load: every child is asked; the longest hit loads (ties: " + " > ".join(c.name for c in children) + ")"


@hookimpl
def kvcompose_rules() -> list[Rule]:
    return [
        Rule("load", "first-wins", "first child in YAML order with a hit loads (vLLM MultiConnector's rule, without its None and probing defects)",
             lambda children, params: FirstWins(), explain=_explain_first),
        Rule("load", "longest-hit", "every child is asked; the most matched tokens wins",
             lambda children, params: LongestHit(), explain=_explain_longest),
    ]
