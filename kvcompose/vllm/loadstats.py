"""Which child served each load: per-child load counters of the composed connector.

vLLM's own counters say where prompt tokens came from by *source* (``p2p``, ``host``, ...), not
by child, and two children of one type share a source. The composite's scheduler half counts,
per child name, the loads it handed to that child and their tokens, against the requests it
looked up. They travel as one entry of the composite's stats (``ComposedStats``) to the front
end and become Prometheus counters::

    vllm:kvcompose_lookups                    requests the composite looked up
    vllm:kvcompose_loads{child="host"}        requests whose external KV that child loaded
    vllm:kvcompose_loaded_tokens{child="pd"}  tokens that child loaded
    vllm:kvcompose_loaded_bytes{child="pd"}   bytes of KV it wrote into the engine's blocks
    vllm:kvcompose_withheld_reports           load reports vLLM no longer waited for, withheld
    vllm:kvcompose_aborted_loads              requests that finished while their load was in flight
    vllm:kvcompose_refused_params{child="pd",reason="signature"}
                                              requests whose kv_transfer_params that child refused
    vllm:kvcompose_pool_sources{child="host",by="index"}
                                              requests that child's pool gave a peer as their KV
                                              source, by who chose it (index, router), and the
                                              sources it gave up (gave_up)

A withheld report is one for a request vLLM's scheduler no longer waits for: a second worker's
duplicate, or a child's late report after the request's load was settled (an abort mid-pull
followed by the transfer's own completion). vLLM asserts on such a report
(``assert req_id in self.requests``) and its engine dies; the composite counts it instead. An
aborted load is a request that finished (vLLM aborts it: its client went away) while vLLM still
waited for its external KV; vLLM frees its blocks when the load reports.

A child may keep counters of its own, by attribute name (:data:`CHILD_COUNTERS`): one that checks
the ``kv_transfer_params`` it is handed (the nixl type, the p2p class: docs/security.md) counts the
sets it refused by reason in ``refused_params``; one with a fleet pool (the p2p class) counts the
sources it chose in ``pool_sources``. Each is a ``Counter`` the child only adds to; the
composite's scheduler half reports what it gained since the last report, each step.

Under ``load: ranges`` one request counts as a load of each child that served a range of it.
Bytes are the whole blocks of the child's range times the bytes of one block over every layer
(one worker's share of the KV cache; each tensor-parallel worker moves as much). A child's hit
rate is ``loads{child} / lookups``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

#: The key of the load counters among the composite's per-child stats. Not a valid child name
#: (names cannot contain ``:``), so it never collides with a child.
STATS_KEY = "kvcompose:loads"
#: The per-child counters, in the order :meth:`ChildLoadStats.load` takes them.
_PER_CHILD = ("loads", "tokens", "bytes")
#: The counters of the composite as a whole.
_TOTALS = ("lookups", "withheld", "aborted")


@dataclass(frozen=True)
class ChildCounter:
    """A counter a child keeps by label value (a ``Counter`` attribute), reported per child."""

    #: the child's attribute, and the key of its counts in the stats
    attribute: str
    #: the Prometheus counter, and the label its values go under (beside ``child``)
    metric: str
    label: str
    documentation: str


#: The children's own counters the composite reports.
CHILD_COUNTERS = (
    ChildCounter(
        "refused_params",
        "vllm:kvcompose_refused_params",
        "reason",
        "Requests whose kv_transfer_params the named child refused, by reason (docs/security.md); "
        "each was computed locally.",
    ),
    ChildCounter(
        "pool_sources",
        "vllm:kvcompose_pool_sources",
        "by",
        "Requests the named child's fleet pool gave a peer as their KV source, by who chose it (index, router); "
        "gave_up: sources whose lookup did not answer within wait_ms (the prompt computed here).",
    ),
)


@dataclass
class ChildLoadStats(KVConnectorStats):
    """``data = {"lookups": n, "withheld": n, "aborted": n, "loads": {child: n}, "tokens": {child: n},
    "bytes": {child: n}}`` since the last report."""

    def __post_init__(self) -> None:
        for key in _TOTALS:
            self.data.setdefault(key, 0)
        for key in _PER_CHILD:
            self.data.setdefault(key, {})

    def child_counts(self, attribute: str, child: str, counts: dict[str, int]) -> None:
        """Add ``counts`` (label value -> n) to the child's counter ``attribute`` (:data:`CHILD_COUNTERS`)."""
        mine = self.data.setdefault(attribute, {}).setdefault(child, {})
        for value, n in counts.items():
            mine[value] = mine.get(value, 0) + n

    def lookup(self) -> None:
        self.data["lookups"] += 1

    def withheld(self, reports: int) -> None:
        self.data["withheld"] += reports

    def aborted(self) -> None:
        self.data["aborted"] += 1

    def load(self, child: str, tokens: int, nbytes: int = 0) -> None:
        # Per load on the scheduler: plain updates (docs/performance.md, scheduler step).
        data = self.data
        loads, counted, counted_bytes = data["loads"], data["tokens"], data["bytes"]
        loads[child] = loads.get(child, 0) + 1
        counted[child] = counted.get(child, 0) + tokens
        counted_bytes[child] = counted_bytes.get(child, 0) + nbytes

    def reset(self) -> None:
        self.data = {**{key: 0 for key in _TOTALS}, **{key: {} for key in _PER_CHILD}}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key in _TOTALS:
            self.data[key] += other.data.get(key, 0)
        for key in _PER_CHILD:
            for child, n in other.data.get(key, {}).items():
                self.data[key][child] = self.data[key].get(child, 0) + n
        for counter in CHILD_COUNTERS:
            for child, counts in other.data.get(counter.attribute, {}).items():
                self.child_counts(counter.attribute, child, counts)
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {key: self.data[key] for key in _TOTALS}
        for child, n in self.data["loads"].items():
            out[f"{child}.loads"] = n
            out[f"{child}.loaded_tokens"] = self.data["tokens"].get(child, 0)
            out[f"{child}.loaded_bytes"] = self.data["bytes"].get(child, 0)
        for counter in CHILD_COUNTERS:
            for child, counts in self.data.get(counter.attribute, {}).items():
                for value, n in counts.items():
                    out[f"{child}.{counter.attribute}.{value}"] = n
        return out

    def is_empty(self) -> bool:
        return (
            not any(self.data[key] for key in _TOTALS)
            and not self.data["loads"]
            and not any(self.data.get(counter.attribute) for counter in CHILD_COUNTERS)
        )


class ChildLoadPromMetrics(KVConnectorPromMetrics):
    """The Prometheus counters of :class:`ChildLoadStats` (label ``child``)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        child_labels = [*labelnames, "child"]
        self._withheld = self._counter_cls(
            name="vllm:kvcompose_withheld_reports",
            labelnames=labelnames,
            documentation="Load reports for requests vLLM no longer waited for (late or duplicate), withheld from "
            "its scheduler, which asserts on them.",
        )
        self._aborted = self._counter_cls(
            name="vllm:kvcompose_aborted_loads",
            labelnames=labelnames,
            documentation="Requests that finished (were aborted) while their external KV was still loading.",
        )
        self._lookups = self._counter_cls(
            name="vllm:kvcompose_lookups",
            labelnames=labelnames,
            documentation="Requests the composed connector looked up for external KV.",
        )
        self._loads = self._counter_cls(
            name="vllm:kvcompose_loads",
            labelnames=child_labels,
            documentation="Requests whose external KV the named child loaded.",
        )
        self._tokens = self._counter_cls(
            name="vllm:kvcompose_loaded_tokens",
            labelnames=child_labels,
            documentation="Tokens of external KV the named child loaded.",
        )
        self._child_counters = {
            counter.attribute: self._counter_cls(
                name=counter.metric, labelnames=[*child_labels, counter.label], documentation=counter.documentation
            )
            for counter in CHILD_COUNTERS
        }
        self._bytes = self._counter_cls(
            name="vllm:kvcompose_loaded_bytes",
            labelnames=child_labels,
            documentation="Bytes of KV the named child loaded into this engine's blocks (one worker's share).",
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        if transfer_stats_data.get("lookups"):
            self._lookups.labels(*labels).inc(transfer_stats_data["lookups"])
        if transfer_stats_data.get("withheld"):
            self._withheld.labels(*labels).inc(transfer_stats_data["withheld"])
        if transfer_stats_data.get("aborted"):
            self._aborted.labels(*labels).inc(transfer_stats_data["aborted"])
        for key, counter in (("loads", self._loads), ("tokens", self._tokens), ("bytes", self._bytes)):
            for child, n in transfer_stats_data.get(key, {}).items():
                counter.labels(*labels, child).inc(n)
        for attribute, metric in self._child_counters.items():
            for child, counts in transfer_stats_data.get(attribute, {}).items():
                for value, n in counts.items():
                    metric.labels(*labels, child, value).inc(n)
