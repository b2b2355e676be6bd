"""The composite's per-step worker shortcuts answer exactly what the full path would.

The worker hooks skip a child that inherits vLLM's constant base answer (an empty set), a
child whose hook has an empty body (it does nothing and answers ``None``), both where the
composite declares that the call's combination drops that answer, and settling transfer results on a step
where no child reported any; these tests pin that the answers are unchanged and
which child code runs (the time saved is measured by ``kvcompose bench``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import CodeType, FrameType
from typing import Any
from unittest import mock

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from kvcompose.testing import inspector
from kvcompose.vllm.connector import KVComposeConnector
from kvcompose.vllm.forward import declared, has_empty_body

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
    # instance before the first call, it must be asked.
    inspector.child(h.connector, "host").get_block_ids_with_load_errors = lambda: {7}
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
def runs_of(code: CodeType) -> Iterator[list[FrameType]]:
    """The frames of ``code`` that start while the block runs."""
    frames: list[FrameType] = []

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code is code:
            frames.append(frame)

    sys.setprofile(profile)
    try:
        yield frames
    finally:
        sys.setprofile(None)


def test_a_childs_empty_per_layer_hooks_are_not_called(kvcompose_worker: Factory) -> None:
    h = kvcompose_worker(MIXED, num_layers=2)
    meta = h.idle_metadata()
    host, rec = inspector.child(h.connector, "host"), inspector.child(h.connector, "rec")
    # vLLM's CPU-offload connector saves nothing per layer: its hooks are empty bodies.
    assert has_empty_body(host.save_kv_layer) and has_empty_body(host.wait_for_layer_load)
    before = len(rec.called("save_kv_layer"))
    with runs_of(host.save_kv_layer.__func__.__code__) as saves, runs_of(host.wait_for_layer_load.__func__.__code__):
        h.step(meta)
    assert saves == []
    assert len(rec.called("save_kv_layer")) - before == 2  # the child with a body: every layer


def test_tracing_calls_every_child_even_an_empty_hook(
    kvcompose_worker: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVCOMPOSE_TRACE", "1")
    h = kvcompose_worker(MIXED, num_layers=2)
    meta = h.idle_metadata()
    host = inspector.child(h.connector, "host")
    with runs_of(host.save_kv_layer.__func__.__code__) as saves:
        h.step(meta)
    assert len(saves) == 2


def _pass() -> None:
    pass


def _doc() -> None:
    """Only a docstring."""


def _ellipsis(*args: Any, **kwargs: Any) -> None: ...


def _bare_return(x: int) -> None:
    return


def _none() -> None:
    return None


def _zero() -> int:
    return 0


def _effect(log: list[int]) -> None:
    log.append(1)


def _generator() -> Iterator[int]:
    yield from ()


class _Child:
    def hook(self, layer: str) -> None:
        """Nothing to do per layer."""

    @staticmethod
    def static() -> None:
        pass


@pytest.mark.parametrize(
    "fn", [_pass, _doc, _ellipsis, _bare_return, _none, _Child().hook, _Child.static, lambda: None]
)
def test_functions_that_do_nothing_have_an_empty_body(fn: Callable[..., Any]) -> None:
    assert has_empty_body(fn)


@pytest.mark.parametrize("fn", [_zero, _effect, _generator, print, mock.Mock(), lambda: 0])
def test_functions_that_do_or_answer_something_have_a_body(fn: Callable[..., Any]) -> None:
    assert not has_empty_body(fn)


def test_the_calls_whose_base_answer_is_neutral_answer_it() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    calls = declared(KVComposeConnector)
    marked = [name for name, c in calls.items() if c.base_neutral]
    assert marked  # a child inheriting one of these is not called
    for name in marked:
        c = calls[name]
        base = getattr(KVConnectorBase_V1, name)
        # A misspelt or renamed method would silently never be skipped.
        assert callable(base), name
        # The base answer is a constant, and exactly what the call's combination drops.
        assert not has_empty_body(base), name
        assert base(None, *[None] * (base.__code__.co_argcount - 1)) == c.neutral, name
        assert c.how in ("any", "union", "concat"), name
