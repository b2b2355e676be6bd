"""Load rules: who loads a request's external KV (vLLM's ``get_num_new_matched_tokens`` and
``update_state_after_alloc``), and the completion rule: whose transfer reports end the load.

vLLM's answer ``(0, False)`` means "nothing here" and ``None`` means "ask me again later", so
the rules walk children in YAML order themselves instead of using pluggy's ``firstresult``
(which runs LIFO and skips ``None``). ``first-wins`` and ``longest-hit`` pick one child;
``ranges`` chains several, each loading the range after the one above it. The allocation split
and load completion are :class:`StandardLoad`'s for all three:
each contributor gets its own tokens, the others 0, the load completes when every async
contributor has reported, and in a chain that mixes synchronous and asynchronous contributors
the synchronous ones load when vLLM schedules the request after that.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvcompose import hookimpl
from kvcompose.catalog import Child, Rule
from kvcompose.contract import NO_HIT, NOT_READY, Ask, CompletionRule, Contribution, EngineFacts, LoadRule, Selection


class StandardLoad(LoadRule):
    """What every built-in load rule shares besides its lookup (:meth:`select`): the allocation
    split, whose reports end the load, and the two phases of a load that mixes synchronous and
    asynchronous contributors (each method's contract: :class:`~kvcompose.contract.LoadRule`).
    A rule of one's own subclasses this and writes ``select`` (docs/rules.md, Writing a rule).
    Plain functions of their arguments: no request is kept.
    """

    def bind(self, engine: EngineFacts) -> None:
        """Needs nothing of the engine."""

    def allocate(self, selection: Selection, num_external_tokens: int) -> tuple[Contribution, ...]:
        """Each contribution in order, the last one vLLM allocated tokens for cut to them (vLLM
        may allocate fewer than selected); the ones beyond get nothing."""
        out = []
        left = num_external_tokens
        for c in selection.contributions:  # vLLM may allocate fewer tokens than selected
            if left <= 0:
                break
            out.append(c if c.tokens <= left else Contribution(c.child, c.start, left, c.is_async))
            left -= c.tokens
        return tuple(out)

    def awaited(self, contributions: tuple[Contribution, ...]) -> tuple[int, ...]:
        """The asynchronous contributors with tokens: vLLM waits for each."""
        return tuple([c.child for c in contributions if c.is_async and c.tokens > 0])  # a list: no generator

    def deferred(self, contributions: tuple[Contribution, ...]) -> tuple[Contribution, ...]:
        """The synchronous contributions of a load that also has an asynchronous one (they load
        when vLLM schedules the request after it arrived); nothing otherwise."""
        if len(contributions) < 2:  # one child: nothing to hold for a schedule of its own
            return ()
        for c in contributions:
            if c.is_async and c.tokens > 0:
                return tuple([c for c in contributions if not c.is_async and c.tokens > 0])
        return ()

    def resume(self, deferred: tuple[Contribution, ...], kept: int) -> tuple[Contribution, ...]:
        """Each deferred contribution cut to the part of its range below ``kept``: one wholly
        beyond it is dropped (vLLM computes those tokens), so no child loads KV vLLM will not read."""
        out = []
        for c in deferred:
            tokens = min(c.tokens, kept - c.start)
            if tokens > 0:
                out.append(c if tokens == c.tokens else Contribution(c.child, c.start, tokens, c.is_async))
        return tuple(out)


def single(child: int, tokens: int, is_async: bool) -> Selection:
    """A selection in which one child loads every external token."""
    return Selection(tokens, is_async, (Contribution(child, 0, tokens, is_async),))


class FirstWins(StandardLoad):
    """The first child in :meth:`order` with a hit loads; children after it are not asked.

    Not asking them matters: probing is not free of side effects (vLLM's CPU offload pins the
    blocks it matched until ``update_state_after_alloc``). A ``None`` from a child asked *before*
    the winner means that child may still answer with a hit, so the request waits a step.

    The built-in ``first-wins`` asks in YAML order. A rule that asks in another order per request
    (a "prefer" rule: docs/rules.md, Writing a rule) subclasses this and overrides :meth:`order`.
    """

    def order(self, children: Sequence[int], kv_transfer_params: Mapping[str, Any] | None) -> Sequence[int]:
        """The children to ask for one request, first to last: a permutation of ``children`` (the
        children that may be asked, in YAML order) or a part of it. The default keeps YAML order."""
        return children

    def select(
        self,
        ask: Ask,
        children: Sequence[int],
        num_computed_tokens: int,
        kv_transfer_params: Mapping[str, Any] | None,
    ) -> Selection:
        for i in self.order(children, kv_transfer_params):
            tokens, is_async = ask(i, num_computed_tokens)
            if tokens is None:
                return NOT_READY
            if tokens > 0:
                return single(i, tokens, is_async)
        return NO_HIT


class LongestHit(StandardLoad):
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


class Ranges(StandardLoad):
    """Children in YAML order each load the range after the one above it (range loads).

    The first child is asked at the local prefix end, as vLLM asks any connector; each next
    child is asked with ``num_computed_tokens`` advanced by the tokens covered so far (vLLM's
    own contract: it answers for the tokens beyond that point), so a host tier's prefix and a
    P/D pull of the rest serve one request. The chain ends after a range whose end is not on a
    block boundary (the next range could not start on one), and before a child whose declared
    alignment the next start misses. Synchronous and asynchronous contributors mix: the load is
    asynchronous when any contributor is, and the synchronous ranges load when vLLM schedules
    the request after the asynchronous ones arrived (:meth:`LoadRule.deferred`). A child that
    cannot load a range away from the local prefix end (``ConnectorType.range_loads`` false) is
    offered only that end: after a contribution it is skipped, so for it the rule is
    ``first-wins``. A ``None`` makes the request wait a step, as under ``first-wins``.

    One KV cache group only: the ranges are in tokens of one block table (``bind`` refuses an
    engine with several groups, e.g. sliding-window layers, rather than load them wrong).
    """

    def __init__(self, children: Sequence[Child]) -> None:
        self._range_loads = tuple(c.type.range_loads for c in children)
        self._alignment = tuple(c.type.range_alignment for c in children)
        self._block_size = 0
        self._align: tuple[int, ...] = ()

    def bind(self, engine: EngineFacts) -> None:
        if engine.kv_cache_groups != 1:
            raise ValueError(
                f"load rule 'ranges' serves models with one KV cache group; this one has {engine.kv_cache_groups} "
                "(sliding-window or hybrid layers keep one block table per group, and a range of tokens "
                "is not one range of blocks in each). Use `load: first-wins` for this model."
            )
        if engine.context_parallel != 1:
            raise ValueError(
                "load rule 'ranges' does not serve context-parallel engines "
                f"(decode x prefill context parallel size {engine.context_parallel}): their block slices "
                "are lined up from the local prefix end, where a range after another child's does not start. "
                "Use `load: first-wins` with context parallelism."
            )
        self._block_size = engine.block_size
        self._align = tuple(math.lcm(engine.block_size, a) if a else engine.block_size for a in self._alignment)

    def select(
        self,
        ask: Ask,
        children: Sequence[int],
        num_computed_tokens: int,
        kv_transfer_params: Mapping[str, Any] | None,
    ) -> Selection:
        if not self._block_size:
            raise RuntimeError("load rule 'ranges' was not bound to an engine (LoadRule.bind)")
        contributions: list[Contribution] = []
        covered = 0
        for i in children:
            start = num_computed_tokens + covered
            if covered and not self._range_loads[i]:
                continue
            if start % self._align[i]:
                if covered:
                    break
                continue
            tokens, is_async = ask(i, start)
            if tokens is None:
                return NOT_READY
            if tokens <= 0:
                continue
            contributions.append(Contribution(i, covered, tokens, is_async))
            covered += tokens
            if (num_computed_tokens + covered) % self._block_size:
                break
        if not contributions:
            return NO_HIT
        return Selection(covered, any(c.is_async for c in contributions), tuple(contributions))


# ------------------------------------------------------------------ completion


@dataclass(frozen=True)
class Owner(CompletionRule):
    """Completion rule ``owner``: only the children a load awaits report it, each once; a load, or
    a delayed free, is done when every child it waits for reported.

    vLLM's scheduler asserts on a ``finished_recving`` it did not expect and frees a request's
    blocks on its first ``finished_sending``. MultiConnector forwards the union of every child's
    reports, so a child that did not load a request can crash the engine or free blocks another
    child still reads (vllm#51786, #53049). The adapter keeps, per request, who reported
    (:class:`kvcompose.vllm.loads.Transfers`) and asks these two questions of it.
    """

    def counts(self, child: int, awaited: tuple[int, ...]) -> bool:
        return child in awaited

    def done(self, owed: tuple[int, ...], reported: Collection[int]) -> bool:
        for child in owed:
            if child not in reported:
                return False
        return True


def _explain_first(children: tuple[Any, ...], _: Any) -> str:
    order = " > ".join(c.name for c in children)
    return f"load: the first child with a hit loads, in this order: {order}; later children are not asked"


def _explain_longest(children: tuple[Any, ...], _: Any) -> str:
    return "load: every child is asked; the longest hit loads (ties: " + " > ".join(c.name for c in children) + ")"


def _brief_first(children: tuple[Any, ...], _: Any) -> str:
    return "load: first-wins, the first child with a hit loads (" + " > ".join(c.name for c in children) + ")"


def _brief_longest(children: tuple[Any, ...], _: Any) -> str:
    return "load: longest-hit, the longest hit loads (ties: " + " > ".join(c.name for c in children) + ")"


def _ranges_parts(children: tuple[Child, ...]) -> list[str]:
    """Who loads what under ``ranges``, child by child."""
    parts: list[str] = []
    for c in children:
        if not parts:
            parts.append(f"{c.name} loads the prefix it holds")
        elif c.type.range_loads:
            parts.append(
                f"{c.name} pulls the rest from the prefill instance"
                if c.type.pd_transport
                else f"{c.name} loads what it holds of the rest"
            )
        else:
            parts.append(f"{c.name} loads only when nothing above it did (it cannot load a range)")
    return parts


def _brief_ranges(children: tuple[Child, ...], _: Any) -> str:
    return "load: ranges, " + "; then ".join(_ranges_parts(children))


def _explain_ranges(children: tuple[Child, ...], _: Any) -> str:
    return (
        "load: ranges, one request from several children: "
        + "; then ".join(_ranges_parts(children))
        + " (a synchronous child's range loads when the request is scheduled after the asynchronous ones "
        "arrived; models with one KV cache group: an engine with sliding-window or hybrid layers, or context "
        "parallelism, refuses to start with this rule)"
    )


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
            brief=_brief_first,
        ),
        Rule(
            "load",
            "longest-hit",
            "every child is asked; the most matched tokens wins",
            lambda children, params: LongestHit(),
            explain=_explain_longest,
            brief=_brief_longest,
        ),
        Rule(
            "load",
            "ranges",
            "children in YAML order each load the range after the one above (host prefix + NIXL rest)",
            lambda children, params: Ranges(children),
            explain=_explain_ranges,
            brief=_brief_ranges,
        ),
        Rule(
            "completion",
            "owner",
            "only the loading children's finished_recving is forwarded, once, when the last of them reported; "
            "a delayed free ends when every saving child reported",
            lambda children, params: Owner(),
            explain=lambda ch, p: (
                "completion: a load's completion is taken only from the children that load it, each once; "
                "blocks held by several children are freed when the last one is done"
            ),
            brief=lambda ch, p: "completion: taken from the children that load, each once; shared blocks freed last",
        ),
    ]
