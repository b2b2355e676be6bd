"""Each contained child's state under the faults rule, as a Prometheus gauge.

Every connector instance (the scheduler's, each worker's) keeps its own breaker over its
children, so a child may be open on a worker and closed on the scheduler. Each instance reports
a child's state when it changes, as one entry of the composite's stats (``ComposedStats``),
keyed by the instance; the front end keeps the latest state of every (instance, child) and sets::

    vllm:kvcompose_breaker_state{child="host"}   0 closed, 1 half-open, 2 open

to the worst of them: a child is open while any instance bypasses it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from kvcompose.contract import ChildState

#: The key of the state reports among the composite's per-child stats (not a valid child name).
STATS_KEY = "kvcompose:breaker"
#: The gauge's value per state: higher is worse, so the gauge shows the worst instance's.
STATE_VALUES: dict[ChildState, int] = {"closed": 0, "half-open": 1, "open": 2}


def instance_name(is_scheduler: bool) -> str:
    """``scheduler``, or ``worker<rank>`` (the rank in torch.distributed's world, 0 without one)."""
    if is_scheduler:
        return "scheduler"
    import torch.distributed as dist

    return f"worker{dist.get_rank() if dist.is_available() and dist.is_initialized() else 0}"


@dataclass
class ChildStateStats(KVConnectorStats):
    """``data = {"states": {instance: {child: state}}}``: the states that changed since the last report."""

    def __post_init__(self) -> None:
        self.data.setdefault("states", {})

    @classmethod
    def of(cls, instance: str, changes: dict[str, ChildState]) -> ChildStateStats:
        """The report of one connector instance whose children (by name) changed state."""
        return cls({"states": {instance: changes}})

    def reset(self) -> None:
        self.data = {"states": {}}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for instance, states in other.data.get("states", {}).items():
            self.data["states"].setdefault(instance, {}).update(states)
        return self

    def reduce(self) -> dict[str, int | float]:
        return {
            f"{child}.breaker@{instance}": STATE_VALUES[state]
            for instance, states in self.data["states"].items()
            for child, state in states.items()
        }

    def is_empty(self) -> bool:
        return not self.data["states"]


class ChildStatePromMetrics(KVConnectorPromMetrics):
    """The gauge of :class:`ChildStateStats` (label ``child``): the worst state over the instances."""

    def __init__(self, *args: Any) -> None:  # vLLM's (vllm_config, metric_types, labelnames, per_engine_labelvalues)
        super().__init__(*args)
        self._state = self._gauge_cls(
            name="vllm:kvcompose_breaker_state",
            labelnames=[*self._labelnames, "child"],
            documentation="A contained child's state under the faults rule: 0 closed, 1 half-open, 2 open "
            "(the worst over the scheduler and the workers).",
            multiprocess_mode="mostrecent",
        )
        #: engine -> child -> instance -> latest state value
        self._latest: dict[int, dict[str, dict[str, int]]] = {}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        latest = self._latest.setdefault(engine_idx, {})
        labels = self.per_engine_labelvalues[engine_idx]
        for instance, states in transfer_stats_data.get("states", {}).items():
            for child, state in states.items():
                latest.setdefault(child, {})[instance] = STATE_VALUES[state]
                self._state.labels(*labels, child).set(max(latest[child].values()))
