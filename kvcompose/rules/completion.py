"""Completion rules: which child's transfer results reach vLLM's scheduler, and when.

vLLM's scheduler asserts on a ``finished_recving`` it did not expect and frees a request's blocks
on its first ``finished_sending``. MultiConnector forwards the union of every child's reports, so
a child that did not load a request can crash the engine or free blocks another child still reads
(vllm#51786, #53049). The ``owner`` rule accounts per (child, request).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvcompose import hookimpl
from kvcompose.catalog import Rule

log = logging.getLogger("kvcompose.rules.completion")


@dataclass
class ChildResults:
    """One child's report for a step (vLLM's ``KVConnectorTransferResults``, minus vLLM)."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)


@dataclass
class Forwarded:
    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)
    dropped: int = 0  # reports withheld (non-owner, duplicate or late)


class OwnerAccounting:
    """Worker-side and scheduler-side bookkeeping of who owes which completion.

    * A load has one owner (the child the load rule chose). Only the owner's
      ``finished_recving``/``failed_recving`` for that request is forwarded, once.
    * A delayed free (``request_finished`` returned True) may be owed by several children; the
      request's ``finished_sending`` is forwarded when the last of them reports it.
    """

    def __init__(self, names: Sequence[str]) -> None:
        self.names = tuple(names)
        self.load_owner: dict[str, int] = {}
        self.saves_owed: dict[str, set[int]] = {}

    # ---- told by the scheduler (through connector metadata on the worker side)
    def expect_load(self, req_id: str, child: int) -> None:
        self.load_owner[req_id] = child

    def expect_saves(self, req_id: str, children: Iterable[int]) -> None:
        self.saves_owed[req_id] = set(children)

    # ---- reported by the children
    def settle(self, results: Sequence[ChildResults]) -> Forwarded:
        out = Forwarded()
        for child, res in enumerate(results):
            for req in res.finished_recving:
                if self.load_owner.get(req) == child:
                    del self.load_owner[req]
                    out.finished_recving.add(req)
                    if req in res.failed_recving:
                        out.failed_recving.add(req)
                else:
                    out.dropped += 1
                    log.debug("finished_recving of %s from %s withheld: %s", req, self.names[child],
                              "duplicate or late" if req not in self.load_owner else
                              f"{self.names[self.load_owner[req]]} loads it")
            for req in res.finished_sending:
                owed = self.saves_owed.get(req)
                if owed is None:
                    # Nothing was announced for it: a single child's own delayed free.
                    out.finished_sending.add(req)
                    continue
                owed.discard(child)
                if not owed:
                    del self.saves_owed[req]
                    out.finished_sending.add(req)
        return out


@hookimpl
def kvcompose_rules() -> list[Rule]:
    return [
        Rule("completion", "owner", "only the loading child's finished_recving is forwarded, once; a delayed free ends when every saving child reported",
             lambda children, params: (lambda: OwnerAccounting([c.name for c in children])),
             explain=lambda ch, p: "completion: a load's completion is taken only from the child that loads it, once; blocks held by several children are freed when the last one is done"),
    ]
