"""Per-child load counters of the composed connector ("which child served the load")."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import Gauge, Histogram
from vllm.v1.request import RequestStatus

from kvcompose.testing.harness import make_request, step
from kvcompose.vllm.connector import KVComposeConnector
from kvcompose.vllm.loadstats import STATS_KEY, ChildLoadPromMetrics, ChildLoadStats
from kvcompose.vllm.metadata import ComposedStats

#: The kit's fixtures are factories (kvcompose_scheduler, kvcompose_worker).
Factory = Callable[..., Any]

TWO = """
version: 1
connectors:
  - {{name: a, type: record, options: {{matched_tokens: {a}, is_async: true}}}}
  - {{name: b, type: record, options: {{matched_tokens: {b}, is_async: true}}}}
"""


def test_the_winning_child_is_counted_with_its_tokens(kvcompose_scheduler: Factory) -> None:
    sched = kvcompose_scheduler(TWO.format(a=0, b=32))
    conn = sched.connector
    sched.add_request(make_request(64))
    sched.schedule()  # update_from_output would drain the stats into the scheduler's own
    stats = conn.get_kv_connector_stats()
    assert isinstance(stats, ComposedStats)
    loads = stats.data[STATS_KEY]
    kv = sched.kv_cache_config
    block_bytes = sum(t.size for t in kv.kv_cache_tensors) // kv.num_blocks  # every layer's share of a block
    blocks = 32 // sched.vllm_config.cache_config.block_size
    assert loads.data == {
        "lookups": 1,
        "withheld": 0,
        "aborted": 0,
        "loads": {"b": 1},
        "tokens": {"b": 32},
        "bytes": {"b": blocks * block_bytes},
    }
    # Reported once: the next report starts from zero.
    assert STATS_KEY not in (conn.get_kv_connector_stats() or ComposedStats()).data


def test_a_lookup_without_a_hit_counts_no_load(kvcompose_scheduler: Factory) -> None:
    sched = kvcompose_scheduler(TWO.format(a=0, b=0))
    conn = sched.connector
    sched.add_request(make_request(64))
    sched.schedule()  # update_from_output would drain the stats into the scheduler's own
    stats = conn.get_kv_connector_stats()
    assert isinstance(stats, ComposedStats)
    assert stats.data[STATS_KEY].data == {
        "lookups": 1,
        "withheld": 0,
        "aborted": 0,
        "loads": {},
        "tokens": {},
        "bytes": {},
    }


def test_counters_survive_the_trip_to_the_front_end(kvcompose_scheduler: Factory) -> None:
    sched = kvcompose_scheduler(TWO.format(a=16, b=0))
    conn = sched.connector
    sched.add_request(make_request(64))
    sched.schedule()  # update_from_output would drain the stats into the scheduler's own
    stats = conn.get_kv_connector_stats()
    assert stats is not None
    rebuilt = KVComposeConnector.build_kv_connector_stats(stats.to_dict())
    assert isinstance(rebuilt, ComposedStats)
    assert rebuilt.data[STATS_KEY].data["loads"] == {"a": 1}
    assert rebuilt.reduce()[f"{STATS_KEY}.a.loaded_tokens"] == 16


def test_aggregate_adds_per_child() -> None:
    x = ChildLoadStats(data={"lookups": 2, "loads": {"a": 1}, "tokens": {"a": 32}})
    x.aggregate(ChildLoadStats(data={"lookups": 1, "loads": {"a": 1, "b": 1}, "tokens": {"a": 8, "b": 4}}))
    assert x.data == {
        "lookups": 3,
        "withheld": 0,
        "aborted": 0,
        "loads": {"a": 2, "b": 1},
        "tokens": {"a": 40, "b": 4},
        "bytes": {},
    }


def test_prometheus_counters_labelled_by_child(kvcompose_scheduler: Factory) -> None:
    registry = CollectorRegistry()
    C = functools.partial(Counter, registry=registry)  # a private registry, not the process one
    sched = kvcompose_scheduler(TWO.format(a=0, b=32))
    types = {Counter: C, Gauge: Gauge, Histogram: Histogram}
    metrics = ChildLoadPromMetrics(sched.vllm_config, types, ["model_name", "engine"], {0: ["m", "0"]})  # type: ignore[arg-type]
    metrics.observe({"lookups": 3, "loads": {"b": 2}, "tokens": {"b": 64}})
    assert registry.get_sample_value("vllm:kvcompose_lookups_total", {"model_name": "m", "engine": "0"}) == 3
    assert (
        registry.get_sample_value("vllm:kvcompose_loads_total", {"model_name": "m", "engine": "0", "child": "b"}) == 2
    )
    assert (
        registry.get_sample_value(
            "vllm:kvcompose_loaded_tokens_total", {"model_name": "m", "engine": "0", "child": "b"}
        )
        == 64
    )


def test_the_front_end_finds_each_entrys_metrics_by_its_name(kvcompose_scheduler: Factory) -> None:
    # The path vLLM's front end takes: the composite's stats as a plain dict, into the metrics
    # the composite's class built from the engine's config.
    registry = CollectorRegistry()
    C = functools.partial(Counter, registry=registry)
    sched = kvcompose_scheduler(TWO.format(a=16, b=0))
    types = {Counter: C, Gauge: Gauge, Histogram: Histogram}
    labels = {"model_name": "m", "engine": "0"}
    prom = KVComposeConnector.build_prom_metrics(sched.vllm_config, types, list(labels), {0: list(labels.values())})  # type: ignore[arg-type]
    sched.add_request(make_request(64))
    sched.schedule()
    stats = sched.connector.get_kv_connector_stats()
    assert prom is not None and stats is not None
    prom.observe({**stats.to_dict(), "not-a-child": {"class": "x:Y", "data": {}}})  # an unknown name is skipped
    assert registry.get_sample_value("vllm:kvcompose_lookups_total", labels) == 1
    assert registry.get_sample_value("vllm:kvcompose_loads_total", {**labels, "child": "a"}) == 1


def test_a_request_aborted_while_its_load_is_in_flight_is_counted_once(kvcompose_scheduler: Factory) -> None:
    sched = kvcompose_scheduler(TWO.format(a=0, b=32))
    conn = sched.connector
    req = make_request(64)
    sched.add_request(req)
    step(sched)
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    sched.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
    stats = conn.get_kv_connector_stats()
    assert isinstance(stats, ComposedStats) and stats.data[STATS_KEY].data["aborted"] == 1
    # vLLM frees the request's blocks on its load report, which still reaches it (not withheld).
    step(sched, finished_recving={req.request_id})
    assert not sched.requests
