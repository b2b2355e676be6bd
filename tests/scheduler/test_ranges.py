"""``load: ranges`` in vLLM's real scheduler with scripted children: who is asked where, who gets
which tokens, the barrier over contributors, and a child that cannot load a range."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from vllm.v1.request import RequestStatus

from kvcompose.testing import inspector
from kvcompose.testing.harness import assert_scheduler_empty, make_request, step

Factory = Callable[..., Any]

CHAIN = """
version: 1
connectors:
  - {{name: host, type: {host}, options: {{matched_tokens: 32, is_async: true{faults}}}}}
  - {{name: plain, type: record, options: {{matched_tokens: 64, is_async: true}}}}
  - {{name: pd, type: record-range, options: {{matched_tokens: 16, is_async: true}}}}
rules: {{load: ranges}}
"""


def chain(host: str = "record-range", faults: str = "") -> str:
    return CHAIN.format(host=host, faults=faults)


def test_each_contributor_gets_its_tokens_and_a_plain_child_is_not_offered_a_range(
    kvcompose_scheduler: Factory,
) -> None:
    sched = kvcompose_scheduler(chain())
    conn = sched.connector
    req = make_request(96)
    sched.add_request(req)
    out, _ = step(sched)
    rid = req.request_id
    assert inspector.child(conn, "host").called("get_num_new_matched_tokens") == [(rid, 0)]
    assert inspector.child(conn, "plain").called("get_num_new_matched_tokens") == []  # it cannot start at 32
    assert inspector.child(conn, "pd").called("get_num_new_matched_tokens") == [(rid, 32)]
    assert inspector.loaders(conn, rid) == ("host", "pd")
    assert inspector.child(conn, "host").called("update_state_after_alloc") == [(rid, 32)]
    assert inspector.child(conn, "plain").called("update_state_after_alloc") == [(rid, 0)]  # store tracking
    assert inspector.child(conn, "pd").called("update_state_after_alloc") == [(rid, 16)]
    assert out.kv_connector_metadata.loads_awaited == {rid: (0, 2)}  # the workers' barrier
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS


def test_a_child_not_ready_above_the_last_contributor_makes_the_request_wait(kvcompose_scheduler: Factory) -> None:
    faults = ", faults: [{call: get_num_new_matched_tokens, action: none, times: 1}]"
    sched = kvcompose_scheduler(chain("faulty", faults))
    conn = sched.connector
    req = make_request(96)
    sched.add_request(req)
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {} and inspector.loaders(conn, req.request_id) == ()
    assert inspector.child(conn, "pd").called("get_num_new_matched_tokens") == []
    step(sched)  # asked again: now host answers, and pd is asked after it
    assert inspector.loaders(conn, req.request_id) == ("host", "pd")
    assert inspector.child(conn, "pd").called("get_num_new_matched_tokens") == [(req.request_id, 32)]


def test_the_request_runs_once_every_contributor_reported(kvcompose_scheduler: Factory) -> None:
    sched = kvcompose_scheduler(chain())
    req = make_request(96)
    sched.add_request(req)
    step(sched)
    rid = req.request_id
    out, _ = step(sched, finished_recving={rid})  # the scheduler sees the workers' settled report
    out, _ = step(sched, eos=True)
    assert out.num_scheduled_tokens == {rid: 96 - 48}
    step(sched)
    assert_scheduler_empty(sched)


def test_an_engine_with_several_kv_cache_groups_refuses_ranges_at_start(kvcompose_scheduler: Factory) -> None:
    with pytest.raises(ValueError, match="load rule 'ranges' serves models with one KV cache group; this one has 2"):
        kvcompose_scheduler(chain(), sliding_window=128)
    assert kvcompose_scheduler(chain().replace("ranges", "first-wins"), sliding_window=128).connector is not None
