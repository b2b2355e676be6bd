"""The ``faulty`` test type injects the faults a test names, where it names them."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, SupportsHMA
from vllm.v1.core.sched.scheduler import Scheduler

from kvcompose.errors import CompositionError
from kvcompose.testing import inspector, versions
from kvcompose.testing.connectors import FaultInjected, FaultyConnector
from kvcompose.testing.harness import assert_scheduler_empty, make_request, model_runner_output, step
from kvcompose.testing.types import fault_calls
from kvcompose.testing.worker import WorkerHarness

FAULTY = """
version: 1
connectors:
  - name: f
    type: faulty
    options:
      matched_tokens: {tokens}
      is_async: true
      faults: {faults}
"""


def test_every_fault_call_is_a_connector_method() -> None:
    """Pinned to vLLM's class: a call renamed there fails here, not in a user's test."""
    methods = {n for cls in (KVConnectorBase_V1, SupportsHMA) for n, _ in inspect.getmembers(cls, inspect.isfunction)}
    installed = fault_calls() - versions.INSTALLED_LACKS  # the sleep-mode calls from vLLM 0.33 on
    assert installed <= methods, sorted(installed - methods)


def test_unknown_call_is_a_located_error(kvcompose_scheduler: Callable[..., Scheduler]) -> None:
    with pytest.raises(CompositionError, match=r"get_num_matched_tokens.*is not a connector call") as info:
        kvcompose_scheduler(FAULTY.format(tokens=0, faults="[{call: get_num_matched_tokens, action: raise}]"))
    assert "faults[0]" in str(info.value)


def test_raise_only_for_the_named_request(kvcompose_scheduler: Callable[..., Scheduler]) -> None:
    sched = kvcompose_scheduler(
        FAULTY.format(tokens=0, faults="[{call: get_num_new_matched_tokens, action: raise, requests: [bad]}]")
    )
    assert sched.connector is not None
    assert sched.connector.get_num_new_matched_tokens(make_request(32, request_id="good"), 0) == (0, False)
    with pytest.raises(FaultInjected, match="'f': injected failure in get_num_new_matched_tokens for request bad"):
        sched.connector.get_num_new_matched_tokens(make_request(32, request_id="bad"), 0)


def test_none_and_times(kvcompose_scheduler: Callable[..., Scheduler]) -> None:
    sched = kvcompose_scheduler(
        FAULTY.format(tokens=16, faults="[{call: get_num_new_matched_tokens, action: none, times: 1}]")
    )
    req = make_request(64)
    sched.add_request(req)
    out, _ = step(sched)  # the first lookup says "ask again later": nothing is scheduled
    assert not out.num_scheduled_tokens
    step(sched)  # asked again: 16 tokens to load, the request now waits for them
    child = inspector.child(sched.connector, "f")  # type: ignore[union-attr]
    assert child.called("update_state_after_alloc") == [(req.request_id, 16)]  # type: ignore[attr-defined]
    assert isinstance(child, FaultyConnector)
    assert child.fired == [("get_num_new_matched_tokens", "none", req.request_id)]


def test_a_failed_load_reaches_vllm_failure_policy(
    kvcompose_scheduler: Callable[..., Scheduler], kvcompose_worker: Callable[..., WorkerHarness]
) -> None:
    text = FAULTY.format(tokens=32, faults="[{call: get_transfer_results, action: fail-load}]")
    sched = kvcompose_scheduler(text)
    worker = kvcompose_worker(text, num_blocks=100)
    req = make_request(64)
    sched.add_request(req)
    out = sched.schedule()  # allocates the 32 external tokens and waits for the load
    kv_out = worker.step(out)
    assert kv_out.finished_recving == {req.request_id} == kv_out.failed_recving
    assert kv_out.invalid_block_ids  # the blocks the load was to fill
    mro = model_runner_output([])
    mro.kv_connector_output = kv_out
    sched.update_from_output(out, mro)
    # vLLM's default kv_load_failure_policy ("fail") ends the request; nothing is left behind.
    assert req.request_id not in sched.requests
    assert_scheduler_empty(sched)


def test_stall_then_answer(kvcompose_worker: Callable[..., WorkerHarness]) -> None:
    h = kvcompose_worker(FAULTY.format(tokens=0, faults="[{call: wait_for_save, action: stall, seconds: 0.01}]"))
    h.step(h.idle_metadata())
    child = h.child("f")
    assert isinstance(child, FaultyConnector)
    assert child.fired == [("wait_for_save", "stall", None)] * 2  # the idle step and this one
    assert child.called("wait_for_save")  # it answered after stalling
