"""The scheduler half's per-request load state, kept between vLLM's calls.

The load rule decides; this records what it decided for each request until the request
finishes, what the workers must be told in the next step's metadata, and which child served
each load (the ``vllm:kvcompose_*`` counters).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvcompose.rules.contract import Contribution, EngineFacts, LoadRule, Selection
from kvcompose.vllm.loadstats import ChildLoadStats

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

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
    contributor, and whether vLLM waits for the load (``WAITING_FOR_REMOTE_KVS``)."""

    def __init__(self, rule: LoadRule, names: Sequence[str], engine: EngineFacts, block_bytes: int = 0) -> None:
        rule.bind(engine)
        self._rule = rule
        self._names = tuple(names)
        self._block_size = engine.block_size
        self._block_bytes = block_bytes
        self._selected: dict[str, Selection] = {}
        self._loading: dict[str, tuple[Contribution, ...]] = {}
        self._looked_up: set[str] = set()
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
        self.stats = ChildLoadStats()

    def selected(self, request_id: str, selection: Selection) -> None:
        """A lookup's answer (never a ``NOT_READY``); a re-lookup replaces the earlier one."""
        if request_id not in self._looked_up:
            self._looked_up.add(request_id)
            self.stats.lookup()
        if selection.contributions:
            self._selected[request_id] = selection
        else:
            self._selected.pop(request_id, None)

    def allocate(self, request_id: str, num_external_tokens: int) -> tuple[Contribution, ...]:
        """The load rule's split of what vLLM allocated; records it and what vLLM now waits for."""
        sel = self._selected.get(request_id)
        contribs = self._rule.allocate(sel, num_external_tokens) if sel is not None else ()
        if contribs:
            self._loading[request_id] = contribs
            for c in contribs:
                blocks = -(-c.tokens // self._block_size)  # a range starts on a block boundary
                self.stats.load(self._names[c.child], c.tokens, blocks * self._block_bytes)
            if len(contribs) > 1:
                log.debug(
                    "%s: %s (tokens beyond the local prefix)",
                    request_id,
                    " + ".join(f"{self._names[c.child]} [{c.start}, {c.start + c.tokens})" for c in contribs),
                )
            awaited = self._rule.awaited(contribs)
            if awaited:
                self.waiting.add(request_id)
                self.new_loads[request_id] = awaited
        return contribs

    def contributions(self, request_id: str, num_external_tokens: int | None = None) -> tuple[Contribution, ...]:
        """Who loads the request: the rule's split of ``num_external_tokens`` when given, else as
        allocated (or, asked before allocation, as selected)."""
        sel = self._selected.get(request_id)
        if sel is not None and num_external_tokens is not None:
            return self._rule.allocate(sel, num_external_tokens)
        contribs = self._loading.get(request_id)
        if contribs is None:
            contribs = sel.contributions if sel is not None else ()
        return contribs

    def finished(self, request_id: str, delaying: tuple[int, ...]) -> None:
        """The request finished; ``delaying`` children hold its blocks until they report."""
        if request_id in self.waiting:  # aborted mid-load: vLLM frees its blocks on the report
            self.stats.aborted()
        self._selected.pop(request_id, None)
        self._loading.pop(request_id, None)
        self._looked_up.discard(request_id)
        if delaying:
            self.new_saves[request_id] = delaying

    def abandon(self, child: int) -> None:
        """``child`` failed on the scheduler: the loads it was given that the workers have not
        been told of yet may never start (its scheduler half may not have recorded them)."""
        for request_id, children in self.new_loads.items():
            if child in children and child not in self.new_abandoned.get(request_id, ()):
                self.new_abandoned[request_id] = self.new_abandoned.get(request_id, ()) + (child,)

    def take_stats(self) -> ChildLoadStats | None:
        """The load counters since the last call, if any."""
        if self.stats.is_empty():
            return None
        stats, self.stats = self.stats, ChildLoadStats()
        return stats

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
