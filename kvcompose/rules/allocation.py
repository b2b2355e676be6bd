"""Allocation under a load rule: what ``update_state_after_alloc`` gives each child now, what a
mixed load defers to the request's next schedule and gives then, and which blocks of a deferred
part no other request may hit before it loads.

These are the load rule's decisions between a request's lookup and its load (the
:class:`~kvcompose.rules.contract.LoadRule` methods ``allocate``, ``awaited``, ``deferred`` and
``resume`` put together), as plain functions of the rule, its selection and the request's
progress: no vLLM here. The vLLM adapter (:mod:`kvcompose.vllm.loads`) keeps the per-request
state between vLLM's calls and applies the answers (docs/rules.md, the ``ranges`` rule).
"""

from __future__ import annotations

from collections.abc import Collection, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvcompose.rules.contract import Contribution, LoadRule, Selection


class Progress(Protocol):
    """What allocation reads of a request, when vLLM schedules it again (vLLM's ``Request``)."""

    @property
    def request_id(self) -> str: ...

    @property
    def num_computed_tokens(self) -> int:
        """Tokens vLLM counts as computed or loaded (0: it kept nothing and looks it up again)."""
        ...

    @property
    def num_tokens(self) -> int:
        """The request's tokens, prompt and output."""
        ...


@dataclass(slots=True)  # not frozen: made once per allocation, and a frozen one costs more to make
class Split:
    """The rule's answer at a request's first ``update_state_after_alloc`` (read, never changed)."""

    #: ``LoadRule.allocate``'s contributions: every part of the load, deferred ones included.
    contributions: tuple[Contribution, ...]
    #: The children whose reports complete the load (``LoadRule.awaited``); vLLM waits for them.
    awaited: tuple[int, ...]
    #: The contributions given now.
    given: tuple[Contribution, ...]
    #: The contributions deferred to the request's next schedule (``LoadRule.deferred``).
    held: tuple[Contribution, ...]

    def tokens(self) -> dict[int, int]:
        """Each child given a part now, with its tokens (every other child gets 0)."""
        return {c.child: c.tokens for c in self.given}

    def held_children(self) -> tuple[int, ...]:
        """The children not to call now: their part is deferred."""
        return tuple(c.child for c in self.held)


def split(rule: LoadRule, selection: Selection, num_external_tokens: int) -> Split | None:
    """The load of ``selection`` as vLLM allocated it (``num_external_tokens``), under ``rule``;
    ``None`` when nothing loads (vLLM allocated no external token)."""
    contributions = rule.allocate(selection, num_external_tokens)
    if not contributions:
        return None
    awaited = rule.awaited(contributions)
    # Deferring is for a load vLLM waits for: a synchronous one is not scheduled again.
    held = rule.deferred(contributions) if awaited else ()
    given = tuple(c for c in contributions if c not in held) if held else contributions
    return Split(contributions, awaited, given, held)


@dataclass(frozen=True, slots=True)
class Deferred:
    """The synchronous part of a request's load, held until vLLM schedules the request after its
    asynchronous part arrived."""

    #: The request (vLLM's ``Request``), read again when vLLM schedules it.
    request: Progress
    contributions: tuple[Contribution, ...]
    #: The request's local prefix at the lookup (contributions start after it).
    local: int
    #: The load's end, in the request's tokens (local prefix + every allocated contribution).
    end: int
    #: The blocks of the deferred ranges: vLLM puts them in its prefix cache when the
    #: asynchronous part arrives, before they hold their KV.
    block_ids: tuple[int, ...]


def defer(request: Progress, load: Split, local: int, block_ids: Sequence[int], block_size: int) -> Deferred:
    """The deferred part of ``load`` (its :attr:`Split.held`), for a request whose local prefix is
    ``local`` tokens and whose blocks (one KV cache group) are ``block_ids``."""
    ids = tuple(
        b
        for c in load.held
        for b in block_ids[(local + c.start) // block_size : -(-(local + c.start + c.tokens) // block_size)]
    )
    return Deferred(request, load.held, local, local + sum(c.tokens for c in load.contributions), ids)


def kept(d: Deferred) -> int:
    """How many tokens beyond the local prefix vLLM counts as loaded when it schedules the
    request again: all of the load's after a clean load, fewer after an awaited child failed."""
    computed = d.request.num_computed_tokens
    # vLLM recomputes the last token of a load that reaches the request's end.
    return (d.end if computed == d.request.num_tokens - 1 == d.end - 1 else computed) - d.local


def resume(rule: LoadRule, d: Deferred) -> tuple[Contribution, ...]:
    """What the rule gives the deferred children now, of what vLLM kept of the load."""
    return rule.resume(d.contributions, kept(d))


def unloaded_blocks(deferred: MutableMapping[str, Deferred], waiting: Collection[str]) -> set[int]:
    """Blocks of deferred ranges that vLLM may have put in its prefix cache before they were
    loaded: those of requests whose asynchronous load arrived (not in ``waiting``) and that were
    not scheduled since. A request vLLM kept nothing of is looked up again from scratch: its
    deferred part is dropped from ``deferred``, and its blocks were freed."""
    out: set[int] = set()
    for request_id, d in list(deferred.items()):
        if request_id in waiting:
            continue
        if d.request.num_computed_tokens == 0:
            del deferred[request_id]
        else:
            out.update(d.block_ids)
    return out


def loaders(
    rule: LoadRule,
    selected: Selection | None,
    allocated: tuple[Contribution, ...] | None,
    num_external_tokens: int | None = None,
) -> tuple[Contribution, ...]:
    """Who loads a request: the rule's split of ``num_external_tokens`` when given (vLLM asks
    where a hit comes from before it allocates), else as ``allocated``, else as ``selected``
    (asked before allocation). A deferred part counts."""
    if selected is not None and num_external_tokens is not None:
        return rule.allocate(selected, num_external_tokens)
    if allocated is not None:
        return allocated
    return selected.contributions if selected is not None else ()
