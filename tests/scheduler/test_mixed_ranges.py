"""``load: ranges`` over synchronous and asynchronous children in vLLM's real scheduler.

A host tier (async), a disk tier (sync: it loads in the step that schedules the request, as
vLLM's ExampleConnector) and a P/D child (async) serve one 96-token request: host ``[0, 32)``,
disk ``[32, 80)``, pd ``[80, 96)``. vLLM waits for the async part; the disk's part is deferred
to the request's next schedule (``LoadRule.deferred``), given what vLLM kept of the load
(``LoadRule.resume``), and dropped when the request ends first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from vllm.v1.request import RequestStatus

from kvcompose.testing import inspector
from kvcompose.testing.harness import assert_scheduler_empty, make_request, model_runner_output, step
from kvcompose.vllm.loadstats import STATS_KEY

Factory = Callable[..., Any]

CHAIN = """
version: 1
connectors:
  - {{name: host, type: record-range, options: {{matched_tokens: 32, is_async: {host}}}}}
  - {{name: disk, type: record-range, options: {{matched_tokens: 48, is_async: {disk}}}}}
  - {{name: pd, type: record-range, options: {{matched_tokens: {pd}, is_async: {pd_async}}}}}
rules: {{load: ranges}}
load_failure: recompute
"""
CHILDREN = ("host", "disk", "pd")


def chain(host: bool = True, disk: bool = False, pd: int = 16, pd_async: bool = True) -> str:
    return CHAIN.format(host=str(host).lower(), disk=str(disk).lower(), pd=pd, pd_async=str(pd_async).lower())


def allocs(conn: Any, rid: str) -> dict[str, list[int]]:
    """Each child's ``update_state_after_alloc`` token counts for the request, in call order."""
    return {
        n: [t for r, t in inspector.child(conn, n).called("update_state_after_alloc") if r == rid] for n in CHILDREN
    }


def loaded_blocks(out: Any, child: str, rid: str) -> list[int] | None:
    """The blocks a record child was told to load in this step (its metadata), if any."""
    return out.kv_connector_metadata.children[child].loads.get(rid)


def start(sched: Any, num_tokens: int = 96) -> tuple[Any, Any]:
    req = make_request(num_tokens)
    sched.add_request(req)
    out, _ = step(sched)
    return req, out


def test_the_sync_range_loads_when_the_request_is_scheduled_after_the_async_ones(kvcompose_scheduler: Factory) -> None:
    sched = kvcompose_scheduler(chain())
    conn = sched.connector
    req, first = start(sched)
    rid = req.request_id
    assert inspector.child(conn, "disk").called("get_num_new_matched_tokens") == [(rid, 32)]
    assert inspector.child(conn, "pd").called("get_num_new_matched_tokens") == [(rid, 80)]
    assert inspector.loaders(conn, rid) == CHILDREN
    # The load is async (vLLM waits), the async children got their ranges, disk was not called.
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert allocs(conn, rid) == {"host": [32], "disk": [], "pd": [16]}
    assert inspector.deferred_loaders(conn, rid) == ("disk",)
    assert first.kv_connector_metadata.loads_awaited == {rid: (0, 2)}
    assert not first.has_sync_kv_loads
    blocks = sched.kv_cache_manager.get_block_ids(rid)[0]
    assert loaded_blocks(first, "host", rid) == blocks[0:2] and loaded_blocks(first, "pd", rid) == blocks[5:6]

    step(sched, finished_recving={rid})  # host and pd reported (the workers' barrier)
    again, _ = step(sched)
    # Scheduled again: disk gets its tokens and the blocks of its range, the others 0; its load
    # runs before the step's forward pass.
    assert again.num_scheduled_tokens == {rid: 1}  # vLLM recomputes the prompt's last token
    assert allocs(conn, rid) == {"host": [32, 0], "disk": [48], "pd": [16, 0]}
    assert loaded_blocks(again, "disk", rid) == blocks[2:5]
    assert sched.kv_cache_manager.get_block_ids(rid)[0] == blocks  # the same blocks as the first phase
    assert again.has_sync_kv_loads
    assert inspector.deferred_loaders(conn, rid) == ()

    later, _ = step(sched, eos=True)
    assert not later.has_sync_kv_loads  # only the step that loads the deferred range
    step(sched)
    assert_scheduler_empty(sched)


def test_the_load_counters_count_the_sync_range_when_it_loads(kvcompose_scheduler: Factory) -> None:
    sched = kvcompose_scheduler(chain())
    conn = sched.connector
    req = make_request(96)
    sched.add_request(req)
    out = sched.schedule()  # update_from_output would drain the stats into the scheduler's own
    assert conn.get_kv_connector_stats().data[STATS_KEY].data["tokens"] == {"host": 32, "pd": 16}
    sched.update_from_output(out, model_runner_output([]))
    step(sched, finished_recving={req.request_id})
    sched.schedule()
    assert conn.get_kv_connector_stats().data[STATS_KEY].data["tokens"] == {"disk": 48}


@pytest.mark.parametrize(
    ("failed_block", "disk", "computed"),
    [
        (5, [48], 80),  # pd's block: vLLM keeps [0, 80), disk's range is still needed
        (1, [0], 16),  # host's second block: vLLM computes from 16, disk's range is dropped
    ],
    ids=["pd-block", "host-block"],
)
def test_invalid_blocks_of_an_async_child_cut_the_sync_range_to_what_vllm_kept(
    kvcompose_scheduler: Factory, failed_block: int, disk: list[int], computed: int
) -> None:
    sched = kvcompose_scheduler(chain())
    conn = sched.connector
    req, _ = start(sched)
    rid = req.request_id
    invalid = {sched.kv_cache_manager.get_block_ids(rid)[0][failed_block]}
    step(sched, finished_recving={rid}, invalid_block_ids=invalid)
    again, _ = step(sched)
    assert again.num_scheduled_tokens == {rid: 96 - computed}
    assert allocs(conn, rid)["disk"] == disk
    assert again.has_sync_kv_loads is bool(disk[0])
    step(sched, eos=True)
    step(sched)
    assert_scheduler_empty(sched)


def test_a_failed_load_drops_the_sync_range_and_the_next_lookup_starts_over(kvcompose_scheduler: Factory) -> None:
    """``failed_recving``: vLLM 0.32 keeps nothing of the load, frees its blocks and looks the
    request up again; the first load's deferred range is dropped, the new load defers its own."""
    sched = kvcompose_scheduler(chain())
    conn = sched.connector
    req, _ = start(sched)
    rid = req.request_id
    step(sched, finished_recving={rid}, failed_recving={rid})
    again, _ = step(sched)
    assert again.num_scheduled_tokens == {} and req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert inspector.child(conn, "disk").called("get_num_new_matched_tokens") == [(rid, 32)] * 2
    assert allocs(conn, rid) == {"host": [32, 32], "disk": [], "pd": [16, 16]}
    assert inspector.deferred_loaders(conn, rid) == ("disk",)
    step(sched, finished_recving={rid})
    step(sched)
    assert allocs(conn, rid)["disk"] == [48]
    step(sched, eos=True)
    step(sched)
    assert_scheduler_empty(sched)


def test_a_request_aborted_while_its_async_part_loads_drops_the_sync_part(kvcompose_scheduler: Factory) -> None:
    sched = kvcompose_scheduler(chain())
    conn = sched.connector
    req, _ = start(sched)
    rid = req.request_id
    sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
    assert inspector.deferred_loaders(conn, rid) == () and inspector.loaders(conn, rid) == ()
    step(sched, finished_recving={rid})  # vLLM frees the blocks on the load's report
    step(sched)
    assert allocs(conn, rid)["disk"] == []  # never asked to load for a request that is gone
    assert_scheduler_empty(sched)


def test_sync_blocks_cached_before_they_were_loaded_are_evicted_from_the_prefix_cache(
    kvcompose_scheduler: Factory,
) -> None:
    """vLLM caches a request's blocks when its async load arrives; when it cannot schedule the
    request in that pass, the deferred range's blocks are taken out of its prefix cache so that
    no other request hits them before they are loaded."""
    sched = kvcompose_scheduler(chain(pd=0), num_blocks=20)
    conn = sched.connector
    prompt = [3 + (i * 11) % 400 for i in range(128)]
    req = make_request(prompt=prompt)
    sched.add_request(req)
    step(sched)
    rid = req.request_id
    assert inspector.loaders(conn, rid) == ("host", "disk") and inspector.deferred_loaders(conn, rid) == ("disk",)
    step(sched, finished_recving={rid})
    pool = sched.kv_cache_manager.block_pool
    taken = pool.get_new_blocks(pool.get_num_free_blocks())  # no block for the rest of the prompt
    stalled, _ = step(sched)
    assert stalled.num_scheduled_tokens == {}
    assert inspector.deferred_loaders(conn, rid) == ("disk",)
    # host's blocks stay cached; disk's [32, 80) is not offered to a request with the same prompt.
    assert sched.kv_cache_manager.get_computed_blocks(make_request(prompt=prompt))[1] == 32
    pool.free_blocks(taken)
    again, _ = step(sched)
    assert again.num_scheduled_tokens == {rid: 128 - 80}
    assert allocs(conn, rid)["disk"] == [48] and again.has_sync_kv_loads
    step(sched, eos=True)
    step(sched)
    assert_scheduler_empty(sched)


@pytest.mark.parametrize("is_async", [False, True], ids=["all-sync", "all-async"])
def test_chains_of_one_mode_load_in_one_phase(kvcompose_scheduler: Factory, is_async: bool) -> None:
    # A synchronous load leaves vLLM the prompt's last token to compute: pd answers 15.
    pd = 16 if is_async else 15
    sched = kvcompose_scheduler(chain(host=is_async, disk=is_async, pd=pd, pd_async=is_async))
    conn = sched.connector
    req, first = start(sched)
    rid = req.request_id
    assert allocs(conn, rid) == {"host": [32], "disk": [48], "pd": [pd]}
    assert inspector.deferred_loaders(conn, rid) == ()
    if is_async:
        assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        assert first.kv_connector_metadata.loads_awaited == {rid: (0, 1, 2)}
        step(sched, finished_recving={rid})
        step(sched)
        assert allocs(conn, rid) == {"host": [32, 0], "disk": [48, 0], "pd": [16, 0]}
    else:
        # A synchronous load: scheduled at once, loaded before this step's forward pass.
        assert first.num_scheduled_tokens == {rid: 1} and first.has_sync_kv_loads
        assert first.kv_connector_metadata.loads_awaited == {}
    step(sched, eos=True)
    step(sched)
    assert_scheduler_empty(sched)
