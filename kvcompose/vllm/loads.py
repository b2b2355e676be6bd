"""A request's load, from its lookup to the report that ends it: one record per request.

On the scheduler, :class:`RequestLoads` keeps each request's :class:`Load` between vLLM's calls
(``get_num_new_matched_tokens``, ``update_state_after_alloc``, ``build_connector_meta``,
``update_connector_output``, ``request_finished``): the load rule's selection and allocation, the
part deferred to the request's next schedule, whether vLLM waits for the load. It applies them to
vLLM's scheduler and keeps what the workers must be told in the next step's metadata and which
child served each load (the ``vllm:kvcompose_*`` counters). On each worker, :class:`Transfers`
keeps each request's :class:`Owed`: which children its load awaits and its free waits for, and
which reported. The rules decide, answering plain values (the load rule: who loads which range,
whose reports end the load; the completion rule: whether a report counts, whether a load or a
free is done); what a failed child owed is settled here. The functions at the end are the steps
of allocation, plain functions of the rule and the request's progress (no vLLM).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from kvcompose.contract import CompletionRule, Contribution, EngineFacts, LoadRule, Selection, TransferResults
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


@dataclass(slots=True)
class Load:
    """One request's load on the scheduler, from its first lookup until it finished and vLLM
    waits for nothing of it (:class:`RequestLoads`)."""

    #: The load rule's answer at the request's last lookup (``None``: nothing to load).
    selection: Selection | None = None
    #: The request's local prefix at that lookup (the selection's ranges start after it).
    local: int = 0
    #: The rule's allocation when vLLM allocated (``None``: not allocated since the lookup).
    allocated: tuple[Contribution, ...] | None = None
    #: The part of a mixed load deferred to the request's next schedule (``LoadRule.deferred``), not yet given.
    deferred: DeferredPart | None = None
    #: vLLM waits for the load (``WAITING_FOR_REMOTE_KVS``); left only when its report arrives
    #: (vLLM frees a request that finished mid-load only on that report).
    waiting: bool = False
    #: vLLM finished the request (kept while ``waiting``).
    finished: bool = False


class RequestLoads:
    """Each request's :class:`Load` on the scheduler (one record per request, in
    :attr:`requests`), what the workers must be told in the next step's metadata, and the load
    counters. The load rule decides; this applies its answers to vLLM's scheduler."""

    def __init__(self, rule: LoadRule, names: Sequence[str], engine: EngineFacts, block_bytes: int = 0) -> None:
        rule.bind(engine)
        self._rule = rule
        self._names = tuple(names)
        self._block_size = engine.block_size
        self._block_bytes = block_bytes
        #: Request -> its load, from its first lookup until it finished and vLLM waits for nothing of it.
        self.requests: dict[str, Load] = {}
        #: The requests whose load has a deferred part (read at each step's start).
        self.deferring: set[str] = set()
        #: A deferred part was given this step: its children load before the step's forward
        #: pass (the scheduler output's ``has_sync_kv_loads``).
        self.sync_load_now = False
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
        a re-lookup replaces the earlier one and drops what was allocated and deferred (vLLM looks a
        request up again only when it kept nothing of its load)."""
        load = self.requests.get(request_id)
        if load is None:
            load = self.requests[request_id] = Load()
            self.counts().lookup()
        if load.deferred is not None:
            load.deferred = None
            self.deferring.discard(request_id)
        load.allocated = None
        if selection.contributions:
            load.selection, load.local = selection, num_computed_tokens
        else:
            load.selection = None

    def after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> tuple[dict[int, int], tuple[int, ...]]:
        """At ``update_state_after_alloc``: each child's tokens (a child left out gets 0), and the
        children not to call now (their part is deferred). Records the load rule's allocation and what
        vLLM now waits for; at the request's first schedule after its asynchronous load, gives
        the deferred part instead."""
        request_id = request.request_id
        load = self.requests.get(request_id)
        if load is None:
            return {}, ()
        if load.deferred is not None and not load.waiting:
            return self._give_deferred(request_id, load), ()
        given = allocation(self._rule, load.selection, num_external_tokens) if load.selection is not None else None
        if given is None:
            return {}, ()
        load.allocated = given.contributions
        for c in given.given:
            self._count(c)
        if len(given.contributions) > 1:
            log.debug(
                "%s: %s (tokens beyond the local prefix)",
                request_id,
                " + ".join(
                    f"{self._names[c.child]} [{c.start}, {c.start + c.tokens})"
                    + (" deferred" if c in given.deferred else "")
                    for c in given.contributions
                ),
            )
        if given.awaited:
            load.waiting = True
            self.new_loads[request_id] = given.awaited
        if not given.deferred:
            return given.tokens(), ()
        load.deferred = deferred_part(request, given, load.local, blocks.get_block_ids()[0], self._block_size)
        self.deferring.add(request_id)
        return given.tokens(), given.deferred_children()

    def _give_deferred(self, request_id: str, load: Load) -> dict[int, int]:
        """The request is scheduled after its asynchronous load: the rule's part for the deferred
        children (:func:`resume`), counted and told to the workers."""
        d = load.deferred
        assert d is not None
        load.deferred = None
        self.deferring.discard(request_id)
        given = resume(self._rule, d)
        for c in given:
            self._count(c)
        if given != d.contributions:
            log.info(
                "%s: vLLM kept %d of the load's tokens beyond the local prefix (an awaited child failed); "
                "deferred %s given %s",
                request_id,
                kept(d),
                ", ".join(f"{self._names[c.child]} [{c.start}, {c.start + c.tokens})" for c in d.contributions),
                ", ".join(f"{self._names[c.child]} {c.tokens}" for c in given) or "nothing",
            )
        if given:
            self.sync_load_now = True
        return {c.child: c.tokens for c in given}

    def arrived(self, finished_recving: set[str]) -> set[str]:
        """At ``update_connector_output``: of the loads the workers reported finished, those vLLM
        waits for; the others (another worker's duplicate, a late report after an abort, which
        would trip vLLM's ``assert req_id in self.requests``) are withheld and counted."""
        kept: set[str] = set()
        for request_id in finished_recving:
            load = self.requests.get(request_id)
            if load is None or not load.waiting:
                continue
            load.waiting = False
            kept.add(request_id)
            if load.finished:
                del self.requests[request_id]
        withheld = len(finished_recving) - len(kept)
        if withheld:
            self.counts().withheld(withheld)
        return kept

    def _count(self, c: Contribution) -> None:
        blocks = -(-c.tokens // self._block_size)  # a range starts on a block boundary
        self.counts().load(self._names[c.child], c.tokens, blocks * self._block_bytes)

    def start_step(self, scheduler_output: SchedulerOutput, kv_cache_manager: KVCacheManager) -> None:
        """At ``build_connector_meta``, when a part is deferred or a deferred part loads now.

        vLLM cached the blocks of a deferred range when the request's asynchronous load arrived;
        their synchronous part is not loaded yet while the request was not scheduled since, so
        no other request may hit them (docs/rules.md, ranges): they leave vLLM's prefix cache. A
        deferred part given in this step loads before the step's forward pass: vLLM's workers
        then start the loads first (``has_sync_kv_loads``, as vLLM's HiSparse connector asks),
        not after it.
        """
        if self.deferring:
            parts = {r: self.requests[r].deferred for r in self.deferring}
            unloaded = unloaded_blocks(parts, {r for r in parts if self.requests[r].waiting})  # type: ignore[arg-type]
            for request_id in self.deferring - parts.keys():  # vLLM kept nothing of it: looked up again
                self.requests[request_id].deferred = None
                self.deferring.discard(request_id)
            if unloaded:
                kv_cache_manager.evict_blocks(unloaded)
        if self.sync_load_now:
            scheduler_output.has_sync_kv_loads = True
            self.sync_load_now = False

    def contributions(self, request_id: str, num_external_tokens: int | None = None) -> tuple[Contribution, ...]:
        """Who loads the request: the rule's allocation of ``num_external_tokens`` when given (vLLM
        asks where a hit comes from before it allocates), else as allocated, else as selected
        (asked before allocation). A deferred part counts."""
        load = self.requests.get(request_id)
        if load is None or load.selection is None:
            return ()
        if num_external_tokens is not None:
            return self._rule.allocate(load.selection, num_external_tokens)
        return load.allocated if load.allocated is not None else load.selection.contributions

    def finished(self, request_id: str, delaying: tuple[int, ...]) -> None:
        """The request finished; ``delaying`` children hold its blocks until they report. A
        deferred part not given yet is dropped; the record stays while vLLM waits for the load."""
        load = self.requests.get(request_id)
        if load is not None:
            self.deferring.discard(request_id)
            if load.waiting:  # aborted mid-load: vLLM frees its blocks on the report
                self.counts().aborted()
                load.finished, load.selection, load.allocated, load.deferred = True, None, None, None
            else:
                del self.requests[request_id]
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


# ------------------------------------------------------------------ the worker half

#: How many forwarded frees a worker remembers to drop their duplicates (request ids are unique,
#: so a duplicate arrives within a few steps, not thousands of requests later).
FREED_KEPT = 4096


@dataclass(slots=True)
class Owed:
    """What a worker waits for of one request: the children its load awaits and those that
    reported, and the children that delay its free and those that reported."""

    #: The children the load awaits (the load rule's ``awaited``); empty: no load waited for.
    awaited: tuple[int, ...] = ()
    loaded: set[int] = field(default_factory=set)
    #: An awaited child reported the load failed (or failed itself).
    failed: bool = False
    #: Awaited children that failed and will never report the load: the next settle reports
    #: it for them, failed.
    abandoned: set[int] = field(default_factory=set)
    #: The children that delay the request's free; empty: none announced.
    delaying: tuple[int, ...] = ()
    freed: set[int] = field(default_factory=set)


class Transfers:
    """Worker half of each request's load and free, one :class:`Owed` per request: told by the
    scheduler through each step's metadata which children a load awaits and which children delay
    a free, it turns the children's transfer reports into what this worker forwards to vLLM,
    asking the completion rule whether a report counts and whether a load or a free is done.

    What vLLM would trip on never reaches it: a ``finished_recving`` from a child the load does
    not await, a second one, or one for no load; a second ``finished_sending`` for a free already
    forwarded.
    """

    def __init__(self, rule: CompletionRule, names: Sequence[str]) -> None:
        self._rule = rule
        self._names = tuple(names)
        #: Request -> what this worker waits for of it (dropped when it waits for nothing).
        self.requests: dict[str, Owed] = {}
        #: The requests with an abandoned load (an index of :attr:`requests`, read by the next settle).
        self._failing: set[str] = set()
        #: Frees no child owes any more since a bypassed child was released from them.
        self._released: set[str] = set()
        #: Requests whose free was forwarded, newest last, at most :data:`FREED_KEPT`.
        self._freed: dict[str, None] = {}

    def told(
        self,
        loads: Mapping[str, tuple[int, ...]],
        saves: Mapping[str, tuple[int, ...]],
        abandoned: Mapping[str, tuple[int, ...]],
        bypassed: Collection[int],
    ) -> bool:
        """What the scheduler announced in a step's metadata: ``loads``, request -> the children
        its load awaits; ``saves``, request -> the children delaying its free; ``abandoned``,
        request -> children that failed on the scheduler before the load started. ``bypassed``:
        children this worker does not call now (they will neither load nor report). Returns
        :attr:`pending`."""
        for request_id, children in loads.items():
            owed = self.requests.get(request_id)
            if owed is None:
                owed = self.requests[request_id] = Owed()
            owed.awaited, owed.loaded, owed.failed = children, set(), False
            for child in children:
                if child in bypassed:
                    self._abandon(request_id, owed, child)
        for request_id, children in abandoned.items():
            owed = self.requests.get(request_id)
            if owed is not None:
                for child in children:
                    self._abandon(request_id, owed, child)
        if saves:
            for request_id, children in saves.items():
                owed = self.requests.get(request_id)
                if owed is None:
                    owed = self.requests[request_id] = Owed()
                owed.delaying, owed.freed = children, set()
            for child in bypassed:
                self._release(child)
        return self.pending

    @property
    def pending(self) -> bool:
        """Whether the next :meth:`settle` reports something no child reports: the loads failed
        children owed, the frees released from a bypassed child."""
        return bool(self._failing or self._released)

    def failed(self, child: int, bypassed: bool) -> None:
        """``child`` raised: the loads it still owes are reported failed by the next
        :meth:`settle`; when it is ``bypassed`` too, the frees it delays no longer wait for it
        (it may never come back, and holding its blocks could exhaust the engine's)."""
        for request_id in self.owed_by(child):
            self._abandon(request_id, self.requests[request_id], child)
        if bypassed:
            self._release(child)

    def _abandon(self, request_id: str, owed: Owed, child: int) -> None:
        owed.abandoned.add(child)
        self._failing.add(request_id)

    def owed_by(self, child: int) -> set[str]:
        """The requests whose load still waits for ``child``."""
        return {r for r, owed in self.requests.items() if child in owed.awaited and child not in owed.loaded}

    def _release(self, child: int) -> None:
        for request_id, owed in list(self.requests.items()):
            if child in owed.delaying and child not in owed.freed:
                owed.freed.add(child)
                if self._rule.done(owed.delaying, owed.freed):
                    owed.delaying = ()
                    self._released.add(request_id)
                    if not owed.awaited:
                        del self.requests[request_id]

    def settle(self, results: Sequence[TransferResults | None]) -> tuple[TransferResults, int]:
        """Each child's report for this step (``None``: nothing), in YAML order, into what this
        worker forwards to vLLM, and how many reports were withheld."""
        out = TransferResults()
        dropped = 0
        if self._released:
            for request_id in self._released:
                self._forget(request_id)
            out.finished_sending |= self._released
            self._released = set()
        abandoned: dict[int, set[str]] = {}
        if self._failing:  # what failed children owed: their reports, failed
            for request_id in self._failing:
                owed = self.requests.get(request_id)
                for child in owed.abandoned if owed is not None else ():
                    abandoned.setdefault(child, set()).add(request_id)
                if owed is not None:
                    owed.abandoned = set()
            self._failing = set()
        for child, res in enumerate(results):
            gone = abandoned.get(child)
            if gone:
                res = res or TransferResults()
                res.finished_recving |= gone
                res.failed_recving |= gone
            if not res:
                continue
            for request_id in res.finished_recving:
                owed = self.requests.get(request_id)
                if owed is None or not owed.awaited or child in owed.loaded:
                    dropped += 1
                    log.debug(
                        "finished_recving of %s from %s withheld: duplicate or late", request_id, self._names[child]
                    )
                    continue
                if not self._rule.counts(child, owed.awaited):
                    dropped += 1
                    log.debug(
                        "finished_recving of %s from %s withheld: not one of the request's loaders",
                        request_id,
                        self._names[child],
                    )
                    continue
                owed.loaded.add(child)
                owed.failed = owed.failed or request_id in res.failed_recving
                if self._rule.done(owed.awaited, owed.loaded):
                    out.finished_recving.add(request_id)
                    if owed.failed:
                        out.failed_recving.add(request_id)
                    owed.awaited = ()
                    if not owed.delaying:
                        del self.requests[request_id]
            for request_id in res.finished_sending:
                owed = self.requests.get(request_id)
                if owed is None or not owed.delaying:
                    if request_id in self._freed:  # a duplicate after the free was forwarded
                        dropped += 1
                        continue
                    # Nothing was announced for it: a single child's own delayed free.
                    self._forget(request_id)
                    out.finished_sending.add(request_id)
                    continue
                owed.freed.add(child)
                if self._rule.done(owed.delaying, owed.freed):
                    owed.delaying = ()
                    if not owed.awaited:
                        del self.requests[request_id]
                    self._forget(request_id)
                    out.finished_sending.add(request_id)
        return out, dropped

    def _forget(self, request_id: str) -> None:
        """The request's free was forwarded: a repeated ``finished_sending`` for it would hit vLLM's
        ``assert req_id in self.requests``, so it is remembered (the newest :data:`FREED_KEPT`)."""
        self._freed[request_id] = None
        if len(self._freed) > FREED_KEPT:
            del self._freed[next(iter(self._freed))]


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
class Allocation:
    """The rule's answer at a request's first ``update_state_after_alloc`` (read, never changed)."""

    #: ``LoadRule.allocate``'s contributions: every part of the load, deferred ones included.
    contributions: tuple[Contribution, ...]
    #: The children whose reports complete the load (``LoadRule.awaited``); vLLM waits for them.
    awaited: tuple[int, ...]
    #: The contributions given now.
    given: tuple[Contribution, ...]
    #: The contributions deferred to the request's next schedule (``LoadRule.deferred``).
    deferred: tuple[Contribution, ...]

    def tokens(self) -> dict[int, int]:
        """Each child given a part now, with its tokens (every other child gets 0)."""
        return {c.child: c.tokens for c in self.given}

    def deferred_children(self) -> tuple[int, ...]:
        """The children not to call now: their part is deferred."""
        return tuple(c.child for c in self.deferred)


def allocation(rule: LoadRule, selection: Selection, num_external_tokens: int) -> Allocation | None:
    """The load of ``selection`` as vLLM allocated it (``num_external_tokens``), under ``rule``;
    ``None`` when nothing loads (vLLM allocated no external token)."""
    contributions = rule.allocate(selection, num_external_tokens)
    if not contributions:
        return None
    awaited = rule.awaited(contributions)
    # Deferring is for a load vLLM waits for: a synchronous one is not scheduled again.
    deferred = rule.deferred(contributions) if awaited else ()
    given = tuple(c for c in contributions if c not in deferred) if deferred else contributions
    return Allocation(contributions, awaited, given, deferred)


@dataclass(frozen=True, slots=True)
class DeferredPart:
    """The synchronous part of a request's load, deferred until vLLM schedules the request after its
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


def deferred_part(
    request: Progress, load: Allocation, local: int, block_ids: Sequence[int], block_size: int
) -> DeferredPart:
    """The deferred part of ``load`` (its :attr:`Allocation.deferred`), for a request whose local
    prefix is ``local`` tokens and whose blocks (one KV cache group) are ``block_ids``."""
    ids = tuple(
        b
        for c in load.deferred
        for b in block_ids[(local + c.start) // block_size : -(-(local + c.start + c.tokens) // block_size)]
    )
    return DeferredPart(request, load.deferred, local, local + sum(c.tokens for c in load.contributions), ids)


def kept(d: DeferredPart) -> int:
    """How many tokens beyond the local prefix vLLM counts as loaded when it schedules the
    request again: all of the load's after a clean load, fewer after an awaited child failed."""
    computed = d.request.num_computed_tokens
    # vLLM recomputes the last token of a load that reaches the request's end.
    return (d.end if computed == d.request.num_tokens - 1 == d.end - 1 else computed) - d.local


def resume(rule: LoadRule, d: DeferredPart) -> tuple[Contribution, ...]:
    """What the rule gives the deferred children now, of what vLLM kept of the load."""
    return rule.resume(d.contributions, kept(d))


def unloaded_blocks(deferred: MutableMapping[str, DeferredPart], waiting: Collection[str]) -> set[int]:
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
