"""The composed connector in vLLM's real scheduler, with scripted children: MultiConnector's defects."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.outputs import KVConnectorOutput

from kvcompose.rules.metadata import MetadataMismatch
from kvcompose.testing import inspector
from kvcompose.testing.harness import make_request, step
from kvcompose.vllm.loadstats import STATS_KEY
from kvcompose.vllm.metadata import ComposedHandshakeMetadata, ComposedMetadata, ComposedStats, ComposedWorkerMetadata

#: The kit's fixtures are factories (kvcompose_scheduler, kvcompose_worker).
Factory = Callable[..., Any]

TWO = """
version: 1
connectors:
  - {{name: a, type: record, options: {{matched_tokens: {a}, is_async: true}}}}
  - {{name: b, type: record, options: {{matched_tokens: {b}, is_async: true}}}}
"""


def test_none_below_the_winner_does_not_block(kvcompose_scheduler: Factory) -> None:
    conn = kvcompose_scheduler(TWO.format(a=32, b="null")).connector
    req = make_request(64)
    assert conn.get_num_new_matched_tokens(req, 0) == (32, True)
    # b is not even asked: probing has side effects (CPU offload pins blocks when asked).
    assert inspector.child(conn, "b").called("get_num_new_matched_tokens") == []


def test_none_above_the_winner_waits(kvcompose_scheduler: Factory) -> None:
    conn = kvcompose_scheduler(TWO.format(a="null", b=32)).connector
    assert conn.get_num_new_matched_tokens(make_request(64), 0) == (None, False)


def test_zero_is_an_answer(kvcompose_scheduler: Factory) -> None:
    conn = kvcompose_scheduler(TWO.format(a=0, b=16)).connector
    req = make_request(64)
    assert conn.get_num_new_matched_tokens(req, 0) == (16, True)
    assert inspector.loaders(conn, req.request_id) == ("b",)
    inspector.child(conn, "b").matched_tokens = 0
    assert conn.get_num_new_matched_tokens(req, 0) == (0, False)
    assert inspector.loaders(conn, req.request_id) == ()  # a re-lookup with no hit clears the old winner


def test_winner_gets_external_tokens_others_zero_and_metadata_is_named(kvcompose_scheduler: Factory) -> None:
    sched = kvcompose_scheduler(TWO.format(a=0, b=32))
    conn = sched.connector
    req = make_request(64)
    sched.add_request(req)
    out, _ = step(sched)
    assert inspector.child(conn, "a").called("update_state_after_alloc") == [(req.request_id, 0)]
    assert inspector.child(conn, "b").called("update_state_after_alloc") == [(req.request_id, 32)]
    meta = out.kv_connector_metadata
    assert isinstance(meta, ComposedMetadata)
    assert list(meta.children) == ["a", "b"]
    assert meta.loads_awaited == {req.request_id: (1,)}
    pickle.loads(pickle.dumps(meta))


def test_finished_recving_only_from_the_owner_and_only_once(kvcompose_worker: Factory) -> None:
    h = kvcompose_worker(TWO.format(a=0, b=32), register=False)
    sched, conn, worker = h.scheduler, h.scheduler.connector, h.connector
    req = make_request(64)
    sched.add_request(req)
    out, _ = step(sched)
    worker.bind_connector_metadata(out.kv_connector_metadata)
    # The non-owner reports the request first: withheld (forwarding it would let vLLM run the
    # request before the owner's blocks arrived).
    inspector.child(worker, "a").results = KVConnectorTransferResults(finished_recving={req.request_id})
    assert worker.get_transfer_results(set()).finished_recving == set()
    inspector.child(worker, "b").results = KVConnectorTransferResults(finished_recving={req.request_id})
    first = worker.get_transfer_results(set())
    assert first.finished_recving == {req.request_id}
    inspector.child(worker, "b").results = KVConnectorTransferResults(finished_recving={req.request_id})
    assert worker.get_transfer_results(set()).finished_recving == set()  # a duplicate
    # Scheduler side: a duplicate that slipped through (another worker, a late report) is dropped
    # instead of tripping vLLM's `assert req_id in self.requests`.
    step(sched, finished_recving={req.request_id})
    step(sched, finished_recving={req.request_id})  # vLLM's assert would raise here
    # Counted for vllm:kvcompose_withheld_reports (a step drains the stats: one report here).
    conn.update_connector_output(KVConnectorOutput(finished_recving={req.request_id}))
    stats = conn.get_kv_connector_stats()
    assert stats is not None and stats.data[STATS_KEY].data["withheld"] == 1


def test_failed_recving_only_from_the_owner(kvcompose_worker: Factory) -> None:
    worker = kvcompose_worker(TWO.format(a=0, b=32), register=False).connector
    worker.bind_connector_metadata(ComposedMetadata({"a": None, "b": None}, loads_awaited={"r1": (1,)}))
    inspector.child(worker, "a").results = KVConnectorTransferResults(finished_recving={"r1"}, failed_recving={"r1"})
    assert worker.get_transfer_results(set()).failed_recving == set()
    inspector.child(worker, "b").results = KVConnectorTransferResults(finished_recving={"r1"}, failed_recving={"r1"})
    res = worker.get_transfer_results(set())
    assert res.failed_recving == {"r1"} and res.finished_recving == {"r1"}


def test_delayed_free_waits_for_every_saving_child(kvcompose_worker: Factory) -> None:
    text = """
version: 1
connectors:
  - {name: a, type: record, options: {delay_free: true}}
  - {name: b, type: record, options: {delay_free: true}}
"""
    h = kvcompose_worker(text, register=False)
    sched, worker = h.scheduler, h.connector
    req = make_request(32, max_tokens=1)
    sched.add_request(req)
    step(sched)  # prefill + 1 token: finished, both children hold the blocks
    out = sched.schedule()
    assert out.kv_connector_metadata.saves_owed == {req.request_id: (0, 1)}
    worker.bind_connector_metadata(out.kv_connector_metadata)
    inspector.child(worker, "a").results = KVConnectorTransferResults(finished_sending={req.request_id})
    assert worker.get_transfer_results(set()).finished_sending == set()
    inspector.child(worker, "b").results = KVConnectorTransferResults(finished_sending={req.request_id})
    assert worker.get_transfer_results(set()).finished_sending == {req.request_id}


def test_metadata_name_mismatch_is_an_error(kvcompose_worker: Factory) -> None:
    worker = kvcompose_worker(TWO.format(a=0, b=0), register=False).connector
    with pytest.raises(MetadataMismatch, match="missing: \\['b'\\]"):
        worker.bind_connector_metadata(ComposedMetadata({"a": None}))
    with pytest.raises(MetadataMismatch, match="unexpected: \\['c'\\]"):
        worker.bind_connector_metadata(ComposedMetadata({"a": None, "b": None, "c": None}))


def test_handshake_metadata_is_kept_per_child(kvcompose_scheduler: Factory) -> None:
    text = """
version: 1
connectors:
  - {name: a, type: record-pd}
  - {name: b, type: record}
"""
    conn = kvcompose_scheduler(text).connector
    got: dict[str, object] = {}
    inspector.child(conn, "a").set_xfer_handshake_metadata_pp_aware = lambda m: got.__setitem__("a", m)  # type: ignore[method-assign]
    inspector.child(conn, "b").set_xfer_handshake_metadata_pp_aware = lambda m: got.__setitem__("b", m)  # type: ignore[method-assign]
    payload = ComposedHandshakeMetadata({"a": "A-meta"})  # type: ignore[dict-item]
    conn.set_xfer_handshake_metadata_pp_aware({(0, 0): payload})
    assert got == {"a": {(0, 0): "A-meta"}}  # b gets nothing that is not its own


def test_child_may_carry_its_own_engine_id() -> None:
    from vllm.config import KVTransferConfig

    from kvcompose.vllm.children import composite_of_transfer

    ktc = KVTransferConfig(
        kv_connector="MultiConnector",
        kv_role="kv_both",
        engine_id="top",
        kv_connector_extra_config={
            "connectors": [
                {"kv_connector": "NixlConnector", "kv_role": "kv_both", "engine_id": "mine"},
                {"kv_connector": "ExampleConnector", "kv_role": "kv_both"},
            ]
        },
    )
    configs = composite_of_transfer(ktc).configs
    assert [c.engine_id for c in configs] == ["mine", "top"]


def test_each_child_is_handed_the_engines_load_failure_policy() -> None:
    """vLLM's scheduler applies the engine's ``kv_load_failure_policy`` only; a child acting on it
    (the nixl type fails a refused request under ``fail``) sees that one, not an entry's default."""
    from vllm.config import KVTransferConfig, VllmConfig

    from kvcompose.vllm.children import composite_of_transfer

    entries = [{"kv_connector": "ExampleConnector", "kv_role": "kv_both"}] * 2
    for policy in ("recompute", "fail"):
        ktc = KVTransferConfig(
            kv_connector="MultiConnector",
            kv_role="kv_both",
            kv_load_failure_policy=policy,
            kv_connector_extra_config={"connectors": entries},
        )
        composite = composite_of_transfer(ktc)
        vllm_config = VllmConfig.__new__(VllmConfig)  # only its kv_transfer_config is read
        vllm_config.kv_transfer_config = ktc
        handed = [cfg.kv_transfer_config.kv_load_failure_policy for _, cfg in composite.child_classes(vllm_config)]
        assert handed == [policy, policy]
        # The configs it caches (shared by every composite of this plan) keep the entries' own.
        assert [c.kv_load_failure_policy for c in composite.configs] == ["fail", "fail"]


def test_stats_per_child_name_and_rebuilt_from_plain_data(kvcompose_worker: Factory) -> None:
    worker = kvcompose_worker(TWO.format(a=0, b=0), register=False).connector
    inspector.child(worker, "a").get_kv_connector_stats = lambda: KVConnectorStats(data={"n": 1})  # type: ignore[method-assign]
    inspector.child(worker, "b").get_kv_connector_stats = lambda: KVConnectorStats(data={"n": 2})  # type: ignore[method-assign]
    stats = worker.get_kv_connector_stats()
    assert isinstance(stats, ComposedStats) and set(stats.data) == {"a", "b"}  # same class, kept apart
    rebuilt = type(worker).build_kv_connector_stats(stats.to_dict())
    assert rebuilt.data["b"].data == {"n": 2}


def test_aggregating_stats_keeps_every_entry_and_leaves_the_next_report_alone(kvcompose_worker: Factory) -> None:
    worker = kvcompose_worker(TWO.format(a=0, b=0), register=False).connector
    inspector.child(worker, "a").get_kv_connector_stats = lambda: KVConnectorStats(data={"n": 1})  # type: ignore[method-assign]
    first = worker.get_kv_connector_stats()
    assert first is not None
    first.aggregate(ComposedStats(data={"x": KVConnectorStats(data={"n": 3})}))
    assert set(first.to_dict()) == {"a", "x"}
    second = worker.get_kv_connector_stats()
    assert second is not None and set(second.data) == {"a"}  # the next report is this connector's own


def test_worker_meta_aggregates_per_child() -> None:
    class M:
        def __init__(self, n: int) -> None:
            self.n = n

        def aggregate(self, other: M) -> M:
            return M(self.n + other.n)

    x = ComposedWorkerMetadata({"a": M(1), "b": None})  # type: ignore[dict-item]
    y = ComposedWorkerMetadata({"a": M(2), "b": M(5)})  # type: ignore[dict-item]
    z = x.aggregate(y)
    assert z.children["a"].n == 3 and z.children["b"].n == 5  # type: ignore[union-attr]


def test_host_buffer_ops_only_to_the_owner(kvcompose_worker: Factory) -> None:
    worker = kvcompose_worker(
        """
version: 1
connectors:
  - {name: host, type: record}
  - {name: pd, type: record-pd}
""",
        register=False,
    ).connector
    op = object()
    worker.set_host_xfer_buffer_ops(op)  # type: ignore[arg-type]
    assert inspector.child(worker, "pd").called("set_host_xfer_buffer_ops") == [(op,)]
    assert inspector.child(worker, "host").called("set_host_xfer_buffer_ops") == []


def test_store_only_routes_save_hooks(kvcompose_worker: Factory) -> None:
    worker = kvcompose_worker(
        """
version: 1
connectors:
  - {name: pd, type: record}
  - {name: host, type: record}
rules:
  store: {use: only, children: [host]}
""",
        register=False,
    ).connector
    worker.save_kv_layer("layer0", None, None)  # type: ignore[arg-type]
    worker.wait_for_save()
    assert inspector.child(worker, "pd").called("save_kv_layer") == []
    assert inspector.child(worker, "host").called("save_kv_layer") == [("layer0",)]


def test_best_effort_child_is_disabled_and_its_load_fails_over_to_recompute(kvcompose_worker: Factory) -> None:
    worker = kvcompose_worker(
        """
version: 1
connectors:
  - {name: pd, type: record}
  - {name: host, type: record}
rules:
  faults: {use: isolate, children: [host]}
""",
        register=False,
    ).connector
    worker.bind_connector_metadata(ComposedMetadata({"pd": None, "host": None}, loads_awaited={"r1": (1,)}))

    def boom(*a: object) -> None:
        raise RuntimeError("disk gone")

    inspector.child(worker, "host").wait_for_save = boom  # type: ignore[method-assign]
    worker.wait_for_save()  # contained, logged
    assert inspector.bypassed(worker) == ("host",)
    res = worker.get_transfer_results(set())
    assert res.failed_recving == {"r1"} and res.finished_recving == {"r1"}
