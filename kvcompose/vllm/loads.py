"""A request's load on the scheduler, from its lookup to the report that ends it.

The load rule decides (:class:`~kvcompose.contract.LoadRule`: who loads which tokens at
the lookup, the split at allocation, whose reports end the load, which part of a mixed load
waits for the request's next schedule and what of it is given then). :class:`RequestLoads`
keeps what it decided for each request between vLLM's calls (``get_num_new_matched_tokens``,
``update_state_after_alloc``, ``build_connector_meta``, ``update_connector_output``,
``request_finished``), applies it to vLLM's scheduler, and keeps what the workers must be told
in the next step's metadata and which child served each load (the ``vllm:kvcompose_*``
counters). The functions after it are the steps of allocation, plain functions of the rule and
the request's progress (no vLLM).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, MutableMapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from kvcompose.contract import CompletionTracker, Contribution, EngineFacts, LoadRule, Selection
from kvcompose.vllm.loadstats import ChildLoadStats

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("kvcompose.vllm")

_NOTHING: dict[str, tuple[int, ...]] = {}
_NO_ANNOUNCEMENTS = (_NOTHING, _NOTHING, _NOTHING)


def block_bytes(kv_cache_config: KVCacheConfig | None) -> int:
    """Bytes of one block over every layer of this worker's KV cache (0 when unknown)."""
    if kv_cache_config is None or kv_cache_config.num_blocks <= 0:
        return 0
    return sum(t.size for t in kv_cache_config.kv_cache_tensors) // kv_cache_config.num_blocks


class RequestLoads:
    """Per request: the load rule's selection, what ``update_state_after_alloc`` gave each
    contributor, whether vLLM waits for the load (``WAITING_FOR_REMOTE_KVS``), and the
    contributions held for the request's next schedule (the rule's :meth:`LoadRule.deferred`)."""

    def __init__(self, rule: LoadRule, names: Sequence[str], engine: EngineFacts, block_bytes: int = 0) -> None:
        rule.bind(engine)
        self._rule = rule
        self._names = tuple(names)
        self._block_size = engine.block_size
        self._block_bytes = block_bytes
        self._selected: dict[str, tuple[Selection, int]] = {}
        self._loading: dict[str, tuple[Contribution, ...]] = {}
        self._looked_up: set[str] = set()
        #: Request -> the part of its load held for its next schedule, not yet given to its children.
        self.held: dict[str, HeldPart] = {}
        #: A held part was given this step: its children load before the step's forward
        #: pass (the scheduler output's ``has_sync_kv_loads``).
        self.sync_load_now = False
        #: Requests whose async load vLLM waits for; left only when the load's report arrives
        #: (vLLM frees a request that finished mid-load only on that report).
        self.waiting: set[str] = set()
        #: For the workers, in the next step's metadata: loads started (request -> the children
        #: the load awaits) and delayed frees announced (request -> the children that delay it).
        self.new_loads: dict[str, tuple[int, ...]] = {}
        self.new_saves: dict[str, tuple[int, ...]] = {}
        #: Loads of ``new_loads`` whose child failed before the workers were told (request ->
        #: those children): the workers report them failed instead of waiting for them.
        self.new_abandoned: dict[str, tuple[int, ...]] = {}
        #: The load counters of the next report: none until something is counted.
        self._report: ChildLoadStats | None = None

    def counts(self) -> ChildLoadStats:
        """The load counters of the next report (started by the first count since the last)."""
        report = self._report
        if report is None:
            report = self._report = ChildLoadStats()
        return report

    def selected(self, request_id: str, selection: Selection, num_computed_tokens: int) -> None:
        """A lookup's answer (never a ``NOT_READY``) at the local prefix ``num_computed_tokens``;
        a re-lookup replaces the earlier one, and drops a deferred part (vLLM looks a request up
        again only when it kept nothing of its load)."""
        if request_id not in self._looked_up:
            self._looked_up.add(request_id)
            self.counts().lookup()
        if self.held:
            self.held.pop(request_id, None)
        if selection.contributions:
            self._selected[request_id] = (selection, num_computed_tokens)
        else:
            self._selected.pop(request_id, None)

    def after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> tuple[dict[int, int], tuple[int, ...]]:
        """At ``update_state_after_alloc``: each child's tokens (a child left out gets 0), and the
        children not to call now (their part is held). Records the load rule's split and what
        vLLM now waits for; at the request's first schedule after its asynchronous load, gives
        the held part instead."""
        request_id = request.request_id
        if self.held and request_id in self.held and request_id not in self.waiting:
            return self._give_held(self.held.pop(request_id)), ()
        entry = self._selected.get(request_id)
        load = split(self._rule, entry[0], num_external_tokens) if entry is not None else None
        if load is None:
            return {}, ()
        self._loading[request_id] = load.contributions
        for c in load.given:
            self._count(c)
        if len(load.contributions) > 1:
            log.debug(
                "%s: %s (tokens beyond the local prefix)",
                request_id,
                " + ".join(
                    f"{self._names[c.child]} [{c.start}, {c.start + c.tokens})"
                    + (" deferred" if c in load.held else "")
                    for c in load.contributions
                ),
            )
        if load.awaited:
            self.waiting.add(request_id)
            self.new_loads[request_id] = load.awaited
        if not load.held:
            return load.tokens(), ()
        assert entry is not None
        self.held[request_id] = hold(request, load, entry[1], blocks.get_block_ids()[0], self._block_size)
        return load.tokens(), load.held_children()

    def _give_held(self, d: HeldPart) -> dict[int, int]:
        """The request is scheduled after its asynchronous load: the rule's part for the held
        children (:func:`resume`), counted and told to the workers."""
        given = resume(self._rule, d)
        for c in given:
            self._count(c)
        if given != d.contributions:
            log.info(
                "%s: vLLM kept %d of the load's tokens beyond the local prefix (an awaited child failed); "
                "deferred %s given %s",
                d.request.request_id,
                kept(d),
                ", ".join(f"{self._names[c.child]} [{c.start}, {c.start + c.tokens})" for c in d.contributions),
                ", ".join(f"{self._names[c.child]} {c.tokens}" for c in given) or "nothing",
            )
        if given:
            self.sync_load_now = True
        return {c.child: c.tokens for c in given}

    def arrived(self, finished_recving: set[str], completion: CompletionTracker) -> set[str]:
        """At ``update_connector_output``: of the loads the workers reported finished, those
        vLLM may see (the completion rule's :meth:`~CompletionTracker.admit`); they leave
        :attr:`waiting`, and the others are counted withheld."""
        kept = completion.admit(finished_recving, self.waiting)
        self.waiting -= kept
        withheld = len(finished_recving) - len(kept)
        if withheld:
            self.counts().withheld(withheld)
        return kept

    def _count(self, c: Contribution) -> None:
        blocks = -(-c.tokens // self._block_size)  # a range starts on a block boundary
        self.counts().load(self._names[c.child], c.tokens, blocks * self._block_bytes)

    def start_step(self, scheduler_output: SchedulerOutput, kv_cache_manager: KVCacheManager) -> None:
        """At ``build_connector_meta``, when something is deferred or a deferred part loads now.

        vLLM cached the blocks of a deferred range when the request's asynchronous load arrived;
        their synchronous part is not loaded yet while the request was not scheduled since, so
        no other request may hit them (docs/rules.md, ranges): they leave vLLM's prefix cache. A
        deferred part given in this step loads before the step's forward pass: vLLM's workers
        then start the loads first (``has_sync_kv_loads``, as vLLM's HiSparse connector asks),
        not after it.
        """
        unloaded = unloaded_blocks(self.held, self.waiting)
        if unloaded:
            kv_cache_manager.evict_blocks(unloaded)
        if self.sync_load_now:
            scheduler_output.has_sync_kv_loads = True
            self.sync_load_now = False

    def contributions(self, request_id: str, num_external_tokens: int | None = None) -> tuple[Contribution, ...]:
        """Who loads the request: the rule's split of ``num_external_tokens`` when given (vLLM
        asks where a hit comes from before it allocates), else as allocated, else as selected
        (asked before allocation). A held part counts."""
        entry = self._selected.get(request_id)
        if entry is not None and num_external_tokens is not None:
            return self._rule.allocate(entry[0], num_external_tokens)
        allocated = self._loading.get(request_id)
        if allocated is not None:
            return allocated
        return entry[0].contributions if entry is not None else ()

    def finished(self, request_id: str, delaying: tuple[int, ...]) -> None:
        """The request finished; ``delaying`` children hold its blocks until they report. A
        held part not given yet is dropped."""
        if request_id in self.waiting:  # aborted mid-load: vLLM frees its blocks on the report
            self.counts().aborted()
        self._selected.pop(request_id, None)
        self._loading.pop(request_id, None)
        self._looked_up.discard(request_id)
        if self.held:
            self.held.pop(request_id, None)
        if delaying:
            self.new_saves[request_id] = delaying

    def abandon(self, child: int) -> None:
        """``child`` failed on the scheduler: the loads it was given that the workers have not
        been told of yet may never start (its scheduler half may not have recorded them)."""
        for request_id, children in self.new_loads.items():
            if child in children and child not in self.new_abandoned.get(request_id, ()):
                self.new_abandoned[request_id] = self.new_abandoned.get(request_id, ()) + (child,)

    def take_stats(self) -> ChildLoadStats | None:
        """The load counters since the last call, if anything was counted."""
        report, self._report = self._report, None
        return report

    def take_announcements(
        self,
    ) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
        """``(new_loads, new_saves, new_abandoned)`` for this step's metadata, cleared for the next.

        Most steps announce nothing: they ship one shared empty dict, never written to, instead
        of two new ones (docs/performance.md: scheduler step, before/after). Not the dicts kept
        here: with async scheduling the scheduler may add to them while a worker still reads
        the last step's metadata.
        """
        if not (self.new_loads or self.new_saves or self.new_abandoned):
            return _NO_ANNOUNCEMENTS
        loads, saves = self.new_loads, self.new_saves
        if loads:
            self.new_loads = {}
        else:
            loads = _NOTHING
        if saves:
            self.new_saves = {}
        else:
            saves = _NOTHING
        abandoned = self.new_abandoned
        if abandoned:
            self.new_abandoned = {}
        else:
            abandoned = _NOTHING
        return loads, saves, abandoned


# ------------------------------------------------------------------ the steps of allocation


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
class HeldPart:
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


def hold(request: Progress, load: Split, local: int, block_ids: Sequence[int], block_size: int) -> HeldPart:
    """The deferred part of ``load`` (its :attr:`Split.held`), for a request whose local prefix is
    ``local`` tokens and whose blocks (one KV cache group) are ``block_ids``."""
    ids = tuple(
        b
        for c in load.held
        for b in block_ids[(local + c.start) // block_size : -(-(local + c.start + c.tokens) // block_size)]
    )
    return HeldPart(request, load.held, local, local + sum(c.tokens for c in load.contributions), ids)


def kept(d: HeldPart) -> int:
    """How many tokens beyond the local prefix vLLM counts as loaded when it schedules the
    request again: all of the load's after a clean load, fewer after an awaited child failed."""
    computed = d.request.num_computed_tokens
    # vLLM recomputes the last token of a load that reaches the request's end.
    return (d.end if computed == d.request.num_tokens - 1 == d.end - 1 else computed) - d.local


def resume(rule: LoadRule, d: HeldPart) -> tuple[Contribution, ...]:
    """What the rule gives the deferred children now, of what vLLM kept of the load."""
    return rule.resume(d.contributions, kept(d))


def unloaded_blocks(held: MutableMapping[str, HeldPart], waiting: Collection[str]) -> set[int]:
    """Blocks of deferred ranges that vLLM may have put in its prefix cache before they were
    loaded: those of requests whose asynchronous load arrived (not in ``waiting``) and that were
    not scheduled since. A request vLLM kept nothing of is looked up again from scratch: its
    held part is dropped from ``held``, and its blocks were freed."""
    out: set[int] = set()
    for request_id, d in list(held.items()):
        if request_id in waiting:
            continue
        if d.request.num_computed_tokens == 0:
            del held[request_id]
        else:
            out.update(d.block_ids)
    return out
