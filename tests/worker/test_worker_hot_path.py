"""The composite's per-step worker shortcuts answer exactly what the full path would.

The worker hooks skip a child that inherits vLLM's default where it does nothing
(``kvcompose.vllm.calls.INHERITED_DEFAULT_DOES_NOTHING``) and a child whose plugin declares a
hook empty (``ConnectorType.empty_calls``), and settle no transfer results on a step where no
child reported any; these tests pin that the answers are unchanged and which child code runs
(the time saved is measured by ``kvcompose bench``; the declarations are pinned against the
classes in ``tests/adapter/test_calls.py``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import CodeType, FrameType
from typing import Any

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from kvcompose.testing import inspector
from kvcompose.testing.bodies import has_empty_body

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
    rec = inspector.child(h.connector, "rec")
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
    # instance (the composite's table made again, as when a child is let back), it must be asked.
    inspector.child(h.connector, "host").get_block_ids_with_load_errors = lambda: {7}
    inspector.call_again(h.connector, "host")
    assert h.connector.get_block_ids_with_load_errors() == {7}
    assert h.connector.get_kv_connector_kv_cache_events() is None  # nobody has events


def test_idle_step_reports_nothing_and_a_report_still_goes_through(kvcompose_worker: Factory) -> None:
    h = kvcompose_worker(MIXED, num_layers=2)
    out = h.step(h.idle_metadata())
    assert (out.finished_sending, out.finished_recving, out.failed_recving) == (set(), set(), set())
    # A delayed free that only this child announced is forwarded on its own report.
    inspector.child(h.connector, "rec").results = KVConnectorTransferResults(finished_sending={"r1"})
    assert h.connector.get_transfer_results(set()).finished_sending == {"r1"}


@contextmanager
def runs_of(*codes: CodeType) -> Iterator[list[FrameType]]:
    """The frames of any of ``codes`` that start while the block runs, in call order.

    One profile hook watches them all: ``sys.setprofile`` holds a single hook, so a ``runs_of``
    inside another would replace the outer one's and leave it seeing nothing; it refuses to.
    """
    watched = {id(code) for code in codes}  # by identity: equal code objects of other functions are not these
    frames: list[FrameType] = []

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and id(frame.f_code) in watched:
            frames.append(frame)

    if sys.getprofile() is not None:
        raise RuntimeError("runs_of: a profile hook is already set; watch every code object in one runs_of")
    sys.setprofile(profile)
    try:
        yield frames
    finally:
        sys.setprofile(None)


def test_a_childs_empty_per_layer_hooks_are_not_called(kvcompose_worker: Factory) -> None:
    h = kvcompose_worker(MIXED, num_layers=2)
    meta = h.idle_metadata()
    host, rec = inspector.child(h.connector, "host"), inspector.child(h.connector, "rec")
    # vLLM's CPU-offload connector saves nothing per layer: its hooks are empty bodies, and its plugin says so.
    assert has_empty_body(host.save_kv_layer) and has_empty_body(host.wait_for_layer_load)
    before = len(rec.called("save_kv_layer"))
    with runs_of(host.save_kv_layer.__func__.__code__, host.wait_for_layer_load.__func__.__code__) as runs:
        h.step(meta)
    assert [frame.f_code.co_name for frame in runs] == []
    assert len(rec.called("save_kv_layer")) - before == 2  # the child with a body: every layer


def test_tracing_calls_every_child_even_an_empty_hook(
    kvcompose_worker: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVCOMPOSE_TRACE", "1")
    h = kvcompose_worker(MIXED, num_layers=2)
    meta = h.idle_metadata()
    host = inspector.child(h.connector, "host")
    with runs_of(host.save_kv_layer.__func__.__code__, host.wait_for_layer_load.__func__.__code__) as runs:
        h.step(meta)
    assert [frame.f_code.co_name for frame in runs] == ["wait_for_layer_load", "save_kv_layer"] * 2  # per layer
