"""The composite's per-step worker shortcuts answer exactly what the full path would.

The worker hooks skip a child that inherits vLLM's constant base answer (``None``, an empty
set) and skip settling transfer results on a step where no child reported any; these tests
pin that the answers are unchanged (the time saved is measured by ``kvcompose bench``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

Factory = Callable[..., Any]

#: A recording child (its own answer to every hook) beside vLLM's CPU-offload connector, which
#: inherits the base class's KV events, load errors and (on the scheduler) worker metadata.
MIXED = """
version: 1
connectors:
  - {name: rec, type: record}
  - {name: host, type: cpu-offload, options: {cpu_bytes: 16MiB}}
"""


def test_children_with_their_own_answer_are_asked_every_step(kvcompose_worker: Factory) -> None:
    h = kvcompose_worker(MIXED, num_layers=2)
    rec = h.connector.child("rec")
    meta = h.idle_metadata()  # runs one step itself
    hooks = (
        "get_kv_connector_kv_cache_events",
        "get_block_ids_with_load_errors",
        "build_connector_worker_meta",
        "get_kv_connector_stats",
        "get_transfer_results",
        "clear_connector_metadata",
    )
    before = {hook: len(rec.called(hook)) for hook in hooks}
    for _ in range(3):
        h.step(meta)
    assert {hook: len(rec.called(hook)) - before[hook] for hook in hooks} == dict.fromkeys(hooks, 3)


def test_an_instance_patch_counts_as_the_childs_own_answer(kvcompose_worker: Factory) -> None:
    h = kvcompose_worker(MIXED, num_layers=2)
    # cpu-offload inherits get_block_ids_with_load_errors from vLLM's base class; patched on the
    # instance before the first call, it must be asked.
    h.connector.child("host").get_block_ids_with_load_errors = lambda: {7}
    assert h.connector.get_block_ids_with_load_errors() == {7}
    assert h.connector.get_kv_connector_kv_cache_events() is None  # nobody has events


def test_idle_step_reports_nothing_and_a_report_still_goes_through(kvcompose_worker: Factory) -> None:
    h = kvcompose_worker(MIXED, num_layers=2)
    out = h.step(h.idle_metadata())
    assert (out.finished_sending, out.finished_recving, out.failed_recving) == (set(), set(), set())
    # A delayed free that only this child announced is forwarded on its own report.
    h.connector.child("rec").results = KVConnectorTransferResults(finished_sending={"r1"})
    assert h.connector.get_transfer_results(set()).finished_sending == {"r1"}
