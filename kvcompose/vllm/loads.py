"""The scheduler half's per-request load state, kept between vLLM's calls.

The load rule decides (:mod:`kvcompose.rules.allocation`: the split at allocation, a mixed
load's deferred part, what vLLM kept of it, the blocks no one may hit before it loads); this
records what it decided for each request until the request finishes, applies it to vLLM's
scheduler, and keeps what the workers must be told in the next step's metadata and which child
served each load (the ``vllm:kvcompose_*`` counters).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kvcompose.rules import allocation
from kvcompose.rules.allocation import Deferred
from kvcompose.rules.contract import CompletionTracker, Contribution, EngineFacts, LoadRule, Selection
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
    contributions deferred to the request's next schedule."""

    def __init__(self, rule: LoadRule, names: Sequence[str], engine: EngineFacts, block_bytes: int = 0) -> None:
        rule.bind(engine)
        self._rule = rule
        self._names = tuple(names)
        self._block_size = engine.block_size
        self._block_bytes = block_bytes
        self._selected: dict[str, tuple[Selection, int]] = {}
        self._loading: dict[str, tuple[Contribution, ...]] = {}
        self._looked_up: set[str] = set()
        #: Request -> the synchronous part of its load, not yet given to its children.
        self.deferred: dict[str, Deferred] = {}
        #: A deferred part was given this step: its children load before the step's forward
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
        if self.deferred:
            self.deferred.pop(request_id, None)
        if selection.contributions:
            self._selected[request_id] = (selection, num_computed_tokens)
        else:
            self._selected.pop(request_id, None)

    def allocate(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> tuple[dict[int, int], tuple[int, ...]]:
        """At ``update_state_after_alloc``: each child's tokens (a child left out gets 0), and the
        children not to call now (their part is deferred). Records the load rule's split and
        what vLLM now waits for; at the request's first schedule after its asynchronous load,
        gives the deferred part instead."""
        request_id = request.request_id
        if self.deferred and request_id in self.deferred and request_id not in self.waiting:
            return self._resume(self.deferred.pop(request_id)), ()
        entry = self._selected.get(request_id)
        load = allocation.split(self._rule, entry[0], num_external_tokens) if entry is not None else None
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
        self.deferred[request_id] = allocation.defer(
            request, load, entry[1], blocks.get_block_ids()[0], self._block_size
        )
        return load.tokens(), load.held_children()

    def _resume(self, d: Deferred) -> dict[int, int]:
        """The request is scheduled after its asynchronous load: the rule's part for the deferred
        children (:func:`~kvcompose.rules.allocation.resume`), counted and told to the workers."""
        given = allocation.resume(self._rule, d)
        for c in given:
            self._count(c)
        if given != d.contributions:
            log.info(
                "%s: vLLM kept %d of the load's tokens beyond the local prefix (an awaited child failed); "
                "deferred %s given %s",
                d.request.request_id,
                allocation.kept(d),
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
        unloaded = allocation.unloaded_blocks(self.deferred, self.waiting)
        if unloaded:
            kv_cache_manager.evict_blocks(unloaded)
        if self.sync_load_now:
            scheduler_output.has_sync_kv_loads = True
            self.sync_load_now = False

    def contributions(self, request_id: str, num_external_tokens: int | None = None) -> tuple[Contribution, ...]:
        """Who loads the request (:func:`~kvcompose.rules.allocation.loaders`)."""
        entry = self._selected.get(request_id)
        return allocation.loaders(
            self._rule, entry[0] if entry is not None else None, self._loading.get(request_id), num_external_tokens
        )

    def loaders(self, request_id: str, deferred: bool = False) -> tuple[str, ...]:
        """Names of the children loading the request (:meth:`contributions`), or of those whose
        part waits for the request's next schedule (``deferred``)."""
        if deferred:
            d = self.deferred.get(request_id)
            contribs = d.contributions if d is not None else ()
        else:
            contribs = self.contributions(request_id)
        return tuple(self._names[c.child] for c in contribs)

    def loaded_groups(
        self, request: Request, fns: Mapping[int, Callable[[Request], Iterable[int]]]
    ) -> tuple[int, ...] | None:
        """The KV cache groups the request's loaders load (``fns``: each child's
        ``get_loaded_kv_cache_group_ids``), sorted; ``None`` when nothing loads it."""
        contribs = self.contributions(request.request_id)
        if not contribs:
            return None
        groups: set[int] = set()
        for c in contribs:
            if c.child in fns:
                groups.update(fns[c.child](request))
        return tuple(sorted(groups))

    def hit_sources(
        self, request: Request, num_external_tokens: int, fns: Mapping[int, Callable[[Request, int], dict[Any, int]]]
    ) -> dict[Any, int] | None:
        """Where the request's ``num_external_tokens`` come from: each loader's
        ``get_external_cache_hit_sources`` (``fns``) for its own part, summed by source;
        ``None`` when nothing loads it."""
        contribs = self.contributions(request.request_id, num_external_tokens)
        if not contribs:
            return None
        if len(contribs) == 1:  # one loader, the usual case: its own answer, not a copy
            fn = fns.get(contribs[0].child)
            return {} if fn is None else fn(request, contribs[0].tokens)
        sources: dict[Any, int] = {}
        for c in contribs:
            if c.child in fns:
                for source, n in fns[c.child](request, c.tokens).items():
                    sources[source] = sources.get(source, 0) + n
        return sources

    def finished(self, request_id: str, delaying: tuple[int, ...]) -> None:
        """The request finished; ``delaying`` children hold its blocks until they report. A
        deferred part not given yet is dropped."""
        if request_id in self.waiting:  # aborted mid-load: vLLM frees its blocks on the report
            self.counts().aborted()
        self._selected.pop(request_id, None)
        self._loading.pop(request_id, None)
        self._looked_up.discard(request_id)
        if self.deferred:
            self.deferred.pop(request_id, None)
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
