"""What the composed connector sends between vLLM's processes: every payload is keyed by child name."""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_events import KVCacheEvent, KVConnectorKVEvents
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvcompose.contract import TransferResults
from kvcompose.merge import merge_values

#: The fields of a transfer report that the completion rule reads (kvcompose's own class).
KNOWN_FIELDS = frozenset(f.name for f in dataclasses.fields(TransferResults))


class ResultsCodec:
    """Copies a vLLM transfer-results class to and from the rules' :class:`TransferResults`.

    The fields kvcompose knows go through the completion rule; every other field of vLLM's
    class (one a newer vLLM added) is *carried*: each child's value merged by
    :func:`kvcompose.merge.merge_values` and handed back to vLLM unchanged otherwise.
    """

    def __init__(self, vllm_cls: type[KVConnectorTransferResults]) -> None:
        self.vllm_cls = vllm_cls
        names = [f.name for f in dataclasses.fields(vllm_cls)]
        #: vLLM's fields the rules read, in vLLM's order.
        self.known: tuple[str, ...] = tuple(n for n in names if n in KNOWN_FIELDS)
        #: vLLM's fields kvcompose does not know: carried through, merged by type.
        self.carried: tuple[str, ...] = tuple(n for n in names if n not in KNOWN_FIELDS)

    def read(self, results: KVConnectorTransferResults | None) -> TransferResults | None:
        """A child's report as the completion rule reads it (copies: the rule may change them);
        ``None`` for a report of nothing, the usual step."""
        if results is None:
            return None
        values = [getattr(results, f) for f in self.known]
        if not any(values):
            return None
        return TransferResults(**{f: set(v) for f, v in zip(self.known, values, strict=True)})

    def merge_carried(self, reports: list[KVConnectorTransferResults | None]) -> dict[str, Any]:
        """The carried fields of the children's reports, each merged by type; a field no child
        filled in is left out (vLLM's default applies)."""
        out: dict[str, Any] = {}
        for name in self.carried:
            merged = merge_values([getattr(r, name, None) for r in reports if r is not None])
            if merged is not None:
                out[name] = merged
        return out

    def write(self, results: TransferResults, carried: Mapping[str, Any] | None = None) -> KVConnectorTransferResults:
        """vLLM's report: the rules' fields, and the carried ones."""
        return self.vllm_cls(**{f: getattr(results, f) for f in self.known}, **(carried or {}))


#: The codec of the installed vLLM's class.
RESULTS_CODEC = ResultsCodec(KVConnectorTransferResults)


@dataclass
class ComposedMetadata(KVConnectorMetadata):
    """Scheduler -> workers, once per step."""

    children: dict[str, KVConnectorMetadata]
    #: Loads the scheduler started since the last step: request id -> the children whose
    #: completion the load awaits (the load rule's ``awaited``).
    loads_awaited: dict[str, tuple[int, ...]] = field(default_factory=dict)
    #: Delayed frees announced since the last step: request id -> children that must report.
    saves_owed: dict[str, tuple[int, ...]] = field(default_factory=dict)
    #: Loads whose scheduler half failed before the workers were told of them: request id ->
    #: the children that will never load it (the workers report those loads failed).
    loads_abandoned: dict[str, tuple[int, ...]] = field(default_factory=dict)


@dataclass
class ComposedWorkerMetadata(KVConnectorWorkerMetadata):
    """Workers -> scheduler, once per step; aggregated across workers child by child."""

    children: dict[str, KVConnectorWorkerMetadata | None]

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, ComposedWorkerMetadata):
            raise TypeError(f"cannot aggregate {type(other).__name__} into composed worker metadata")
        merged: dict[str, KVConnectorWorkerMetadata | None] = dict(self.children)
        for name, meta in other.children.items():
            mine = merged.get(name)
            merged[name] = meta if mine is None else (mine if meta is None else mine.aggregate(meta))
        return ComposedWorkerMetadata(merged)


@dataclass
class ComposedHandshakeMetadata(KVConnectorHandshakeMetadata):
    """One worker's handshake payloads, one per child that has one."""

    children: dict[str, KVConnectorHandshakeMetadata]

    @staticmethod
    def of_child(
        metadata: Mapping[tuple[int, int], KVConnectorHandshakeMetadata], name: str
    ) -> dict[tuple[int, int], KVConnectorHandshakeMetadata]:
        """Every worker's (pp rank, tp rank) payload of the child ``name``, from the composite
        payloads vLLM gathered (``set_xfer_handshake_metadata_pp_aware``)."""
        return {
            rank: m.children[name]
            for rank, m in metadata.items()
            if isinstance(m, ComposedHandshakeMetadata) and name in m.children
        }


@functools.cache
def qualname(obj: type) -> str:
    """``module:Class``, importable again by the front end."""
    return f"{obj.__module__}:{obj.__qualname__}"


def _resolve(dotted: str) -> type:
    module, _, name = dotted.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass
class ComposedStats(KVConnectorStats):
    """Stats per child, keyed by the child's name (two children of one class stay apart).

    Each entry remembers its stats class, so the front end can rebuild it from a plain dict
    even for connectors that are not in vLLM's registry; the front end's Prometheus metrics
    find the child's class by the entry's name (:class:`~kvcompose.vllm.children.ComposedPromMetrics`).
    """

    def to_dict(self) -> dict[str, Any]:
        # Every step: a loop and cached class names (docs/performance.md: scheduler step, before/after).
        out: dict[str, Any] = {}
        for name, s in self.data.items():
            out[name] = {"class": qualname(type(s)), "data": s.to_dict()}
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ComposedStats:
        out: dict[str, KVConnectorStats] = {}
        for name, entry in data.items():
            out[name] = entry if isinstance(entry, KVConnectorStats) else _resolve(entry["class"])(data=entry["data"])
        return cls(data=out)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, stats in other.data.items():
            mine = self.data.get(name)
            self.data[name] = stats if mine is None else mine.aggregate(stats)
        return self

    def reset(self) -> None:
        for stats in self.data.values():
            stats.reset()

    def reduce(self) -> dict[str, Any]:
        return {f"{name}.{k}": v for name, s in self.data.items() for k, v in s.reduce().items()}

    def is_empty(self) -> bool:
        for s in self.data.values():  # every step: no generator (docs/performance.md: fifth round)
            if not s.is_empty():
                return False
        return True


class ComposedKVEvents(KVConnectorKVEvents):
    """Worker-side KV events of every child, kept per child (MultiConnector drops them)."""

    def __init__(self, children: dict[str, KVConnectorKVEvents]) -> None:
        self.children = children

    def add_events(self, events: list[KVCacheEvent]) -> None:
        raise TypeError("add events to a child's container, not to the composed one")

    def aggregate(self) -> ComposedKVEvents:
        return ComposedKVEvents({n: e.aggregate() for n, e in self.children.items()})

    def increment_workers(self, count: int = 1) -> None:
        for e in self.children.values():
            e.increment_workers(count)

    def get_all_events(self) -> list[KVCacheEvent]:
        return [ev for e in self.children.values() for ev in e.get_all_events()]

    def get_number_of_workers(self) -> int:
        return max((e.get_number_of_workers() for e in self.children.values()), default=0)

    def clear_events(self) -> None:
        for e in self.children.values():
            e.clear_events()

    def merge(self, other: KVConnectorKVEvents) -> ComposedKVEvents:
        if not isinstance(other, ComposedKVEvents):
            raise TypeError(f"cannot merge {type(other).__name__} into composed KV events")
        for name, events in other.children.items():
            mine = self.children.get(name)
            self.children[name] = events if mine is None else mine.merge(events)
        return self
