"""Completion rules: which child's transfer results reach vLLM's scheduler, and when.

vLLM's scheduler asserts on a ``finished_recving`` it did not expect and frees a request's blocks
on its first ``finished_sending``. MultiConnector forwards the union of every child's reports, so
a child that did not load a request can crash the engine or free blocks another child still reads
(vllm#51786, #53049). The ``owner`` rule accounts per (child, request).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvcompose import hookimpl
from kvcompose.catalog import Child, Rule
from kvcompose.contract import CompletionRule, CompletionTracker, TransferResults

log = logging.getLogger("kvcompose.rules.completion")

#: How many forwarded frees a tracker remembers to drop their duplicates (request ids are
#: unique, so a duplicate arrives within a few steps, not thousands of requests later).
FREED_KEPT = 4096


@dataclass
class _Load:
    """A load this worker waits for: the children still to report, and whether one failed."""

    awaited: set[int]
    failed: bool = False


@dataclass
class OwnerAccounting(CompletionTracker):
    """Bookkeeping of who owes which completion, per (child, request).

    * A load awaits the children the load rule named. Only their ``finished_recving`` counts,
      each once; the request's ``finished_recving`` is forwarded when the last of them reported,
      and with ``failed_recving`` when any of them failed.
    * A delayed free may be owed by several children; the request's ``finished_sending`` is
      forwarded when the last of them reported it.
    """

    names: tuple[str, ...]
    loads: dict[str, _Load] = field(default_factory=dict)
    saves_owed: dict[str, set[int]] = field(default_factory=dict)
    abandoned: dict[int, set[str]] = field(default_factory=dict)
    #: Delayed frees no child owes any more since a bypassed child was released from them.
    released: set[str] = field(default_factory=set)
    #: Requests whose free was forwarded, newest last, at most :data:`FREED_KEPT`: a repeated
    #: finished_sending for one of them would hit vLLM's ``assert req_id in self.requests``.
    freed: dict[str, None] = field(default_factory=dict)

    # ---- worker half: told by the scheduler through the step's metadata
    def expect_load(self, request_id: str, children: tuple[int, ...]) -> None:
        self.loads[request_id] = _Load(set(children))

    def expect_saves(self, request_id: str, children: tuple[int, ...]) -> None:
        self.saves_owed[request_id] = set(children)

    def owed_by(self, child: int) -> set[str]:
        return {r for r, load in self.loads.items() if child in load.awaited}

    def abandon(self, child: int, request_ids: Collection[str]) -> None:
        self.abandoned.setdefault(child, set()).update(request_ids)

    def release(self, child: int) -> None:
        """Frees no longer wait for ``child``: it may never come back, and holding its blocks for
        it could exhaust the engine's. Its own late ``finished_sending`` is then a duplicate,
        dropped in :meth:`settle`."""
        for req, owed in list(self.saves_owed.items()):
            owed.discard(child)
            if not owed:
                del self.saves_owed[req]
                self.released.add(req)

    # ---- worker half: reported by the children
    def settle(self, results: Sequence[TransferResults | None]) -> tuple[TransferResults, int]:
        out = TransferResults()
        dropped = 0
        if self.released:
            for req in self.released:
                self._freed(req)
            out.finished_sending |= self.released
            self.released = set()
        for child, res in enumerate(results):
            gone = self.abandoned.pop(child, None)
            if gone:
                res = res or TransferResults()
                res.finished_recving |= gone
                res.failed_recving |= gone
            if not res:
                continue
            for req in res.finished_recving:
                load = self.loads.get(req)
                if load is None or child not in load.awaited:
                    dropped += 1
                    log.debug(
                        "finished_recving of %s from %s withheld: %s",
                        req,
                        self.names[child],
                        "duplicate or late" if load is None else "it is not one of the request's loaders",
                    )
                    continue
                load.awaited.discard(child)
                load.failed = load.failed or req in res.failed_recving
                if not load.awaited:
                    del self.loads[req]
                    out.finished_recving.add(req)
                    if load.failed:
                        out.failed_recving.add(req)
            for req in res.finished_sending:
                owed = self.saves_owed.get(req)
                if owed is None:
                    if req in self.freed:  # a duplicate after the free was forwarded
                        dropped += 1
                        continue
                    # Nothing was announced for it: a single child's own delayed free.
                    self._freed(req)
                    out.finished_sending.add(req)
                    continue
                owed.discard(child)
                if not owed:
                    del self.saves_owed[req]
                    self._freed(req)
                    out.finished_sending.add(req)
        return out, dropped

    def _freed(self, req: str) -> None:
        self.freed[req] = None
        if len(self.freed) > FREED_KEPT:
            del self.freed[next(iter(self.freed))]

    # ---- scheduler half
    def admit(self, finished_recving: set[str], waiting: Collection[str]) -> set[str]:
        """Only reports vLLM waits for: another worker's duplicate or a late report after an
        abort would trip vLLM's ``assert req_id in self.requests``."""
        return {r for r in finished_recving if r in waiting}


@dataclass(frozen=True)
class Owner(CompletionRule):
    names: tuple[str, ...]

    def tracker(self) -> OwnerAccounting:
        return OwnerAccounting(self.names)


def _owner(children: tuple[Child, ...], params: None) -> Owner:
    return Owner(tuple(c.name for c in children))


@hookimpl
def kvcompose_rules() -> list[Rule[Any]]:
    return [
        Rule(
            "completion",
            "owner",
            "only the loading children's finished_recving is forwarded, once, when the last of them reported; "
            "a delayed free ends when every saving child reported",
            _owner,
            explain=lambda ch, p: (
                "completion: a load's completion is taken only from the children that load it, each once; "
                "blocks held by several children are freed when the last one is done"
            ),
        ),
    ]
