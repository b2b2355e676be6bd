"""vLLM's real Scheduler with the cpu-offload connector as its only connector: store, evict, load.

Both halves run, through the kit's :class:`~kvcompose.testing.worker.WorkerHarness`: the
scheduler builds its connector through vLLM's factory (our module path), and a worker-role
connector with the portable worker moves the bytes of engine-layout KV caches. Every engine step
writes (``write_blocks=True``), into each block it completes, bytes determined by the block's
token prefix, so a block that comes back from the host tier must hold exactly its prefix's bytes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadMetadata

from kvcompose.testing.harness import assert_scheduler_empty, make_request
from kvcompose.testing.worker import WorkerHarness
from kvcompose_cpu_offload.connector import SimpleCPUOffloadConnector
from kvcompose_cpu_offload.portable_worker import PortableSimpleCPUOffloadWorker, StepMetadata

BLOCK = 16
PROMPT = 4 * BLOCK + 8  # four full blocks and a partial one


def offload_engine(lazy: bool = False) -> WorkerHarness:
    """Scheduler and worker of the plain cpu-offload connector over a 12-block KV cache."""
    return WorkerHarness(
        {
            "kv_connector": "SimpleCPUOffloadConnector",
            "kv_connector_module_path": "kvcompose_cpu_offload.connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 20, "lazy_offload": lazy},
        },
        num_layers=2,
        num_blocks=12,
        block_size=BLOCK,
    )


@pytest.fixture(params=[False, True], ids=["eager", "lazy"])
def engine(request: pytest.FixtureRequest) -> Iterator[WorkerHarness]:
    h = offload_engine(lazy=request.param)
    yield h
    h.shutdown()


def metas(outs: list[SchedulerOutput]) -> list[SimpleCPUOffloadMetadata]:
    found = [o.kv_connector_metadata for o in outs]
    assert all(isinstance(m, SimpleCPUOffloadMetadata) for m in found)
    return found  # type: ignore[return-value]


def run(h: WorkerHarness, req: Request, max_steps: int = 20) -> list[SchedulerOutput]:
    """Engine steps (with the stand-in forward) until ``req`` finishes and the tier has stored
    what it took from it (its copies run on the worker's store thread); the scheduler outputs."""
    h.scheduler.add_request(req)
    outs = h.step_until(
        lambda _: req.is_finished(), f"{req.request_id} did not finish", max_steps=max_steps, write_blocks=True
    )
    return outs + h.drain(write_blocks=True)


def prompt(seed: int) -> list[int]:
    return [3 + (seed * 131 + i * 17) % 500 for i in range(PROMPT)]


def test_store_evict_load(engine: WorkerHarness) -> None:
    h = engine
    assert isinstance(h.scheduler.connector, SimpleCPUOffloadConnector)
    assert isinstance(h.connector.worker_handler, PortableSimpleCPUOffloadWorker)  # type: ignore[attr-defined]

    a = prompt(0)
    outs = run(h, make_request(prompt=a, max_tokens=2, block_size=BLOCK, request_id="A1"))
    # Three other prompts need the whole 11-block pool between them and push A out.
    for seed in (1, 2, 3):
        outs += run(h, make_request(prompt=prompt(seed), max_tokens=2, block_size=BLOCK, request_id=f"E{seed}"))
    outs += h.drain(write_blocks=True)
    before = metas(outs)
    assert sum(len(m.store_gpu_blocks) for m in before) >= 4
    assert not any(m.load_gpu_blocks for m in before)

    a2 = make_request(prompt=a, max_tokens=2, block_size=BLOCK, request_id="A2")
    _, local_hit, _ = h.scheduler.kv_cache_manager.get_computed_blocks(a2)
    assert local_hit == 0, "A is still in the device prefix cache; nothing was evicted"

    h.scheduler.add_request(a2)
    first, _ = h.engine_step(write_blocks=True)
    # The host tier hit: A2 waits for its KV, nothing is computed this step.
    assert first.num_scheduled_tokens == {}
    (load,) = [m for m in metas([first]) if m.load_gpu_blocks]
    assert len(load.load_gpu_blocks) == 4 and load.load_event_to_reqs[load.load_event] == ["A2"]

    # The portable worker copies on its load thread and reports A2 in finished_recving once
    # the bytes are in place; until then A2 waits. Then the scheduler computes only the tail.
    waited = h.step_until(lambda _: "A2" in h.scheduler.finished_recving_kv_req_ids, "A2's load not reported")
    assert all(o.num_scheduled_tokens == {} for o in waited)
    assert a2.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    second, _ = h.engine_step(write_blocks=True)
    assert not metas([second])[0].load_gpu_blocks
    assert second.num_scheduled_tokens == {"A2": PROMPT - 4 * BLOCK}
    assert a2.num_computed_tokens == PROMPT and a2.status == RequestStatus.RUNNING

    # The loaded blocks hold exactly A's prefix bytes (the second step wrote only the tail).
    block_ids = h.scheduler.kv_cache_manager.get_block_ids("A2")[0]
    for b in range(4):
        for name in h.layer_names:
            got = h.block_bytes(name, block_ids[b])
            assert torch.equal(got, h.expected_block(a[: (b + 1) * BLOCK], name)), (b, name)

    while not a2.is_finished():
        h.engine_step(write_blocks=True)
    h.drain(write_blocks=True)
    assert_scheduler_empty(h.scheduler)


def test_the_store_of_a_request_that_ends_at_its_first_token_is_done_in_the_step_after_it() -> None:
    """vLLM steps on while a store is pending (``has_pending_push_work``). A request that ends at
    its first token has its blocks stored when it finishes (vLLM queues them then), so the store
    goes out with the next step, which schedules nothing: it runs no forward pass, its metadata
    says so, and the store is copied in that step and reported by it. The engine then has
    nothing left to step for (not one step per poll of a copy thread)."""
    h = offload_engine()
    try:
        r = make_request(prompt=prompt(0), max_tokens=1, block_size=BLOCK, request_id="R")
        h.scheduler.add_request(r)
        (token_step,) = h.step_until(lambda _: r.is_finished(), "R did not finish", write_blocks=True)
        assert token_step.total_num_scheduled_tokens == PROMPT and metas([token_step])[0].forward
        assert h.scheduler.connector.has_pending_push_work()

        after, _ = h.engine_step(write_blocks=True)
        (meta,) = metas([after])
        assert after.total_num_scheduled_tokens == 0
        assert isinstance(meta, StepMetadata) and not meta.forward and len(meta.store_gpu_blocks) == 4
        assert h.last_output.kv_connector_worker_meta.completed_store_events == {meta.store_event: 1}
        assert not h.scheduler.connector.has_pending_push_work()
        assert_scheduler_empty(h.scheduler)
    finally:
        h.shutdown()


def test_a_store_planned_in_a_requests_last_token_step_is_copied_in_the_step_after_it() -> None:
    """The eager store of blocks computed before a request's last step (here its prompt; in P/D
    the blocks a decode pulled) goes out with that step, whose forward pass produces the token,
    so it waits for the next step. That step has no forward pass: it copies the store in place
    and reports it, although vLLM's model runner hands its metadata to ``handle_preemptions``
    (which the kit calls, as vLLM does) before ``bind_connector_metadata``."""
    h = offload_engine()
    try:
        r = make_request(prompt=prompt(0), max_tokens=2, block_size=BLOCK, request_id="R")
        h.scheduler.add_request(r)
        outs = h.step_until(lambda _: r.is_finished(), "R did not finish", write_blocks=True)
        last = metas(outs)[-1]
        assert outs[-1].total_num_scheduled_tokens == 1 and len(last.store_gpu_blocks) == 4

        after, _ = h.engine_step(write_blocks=True)
        assert after.total_num_scheduled_tokens == 0
        assert h.last_output.kv_connector_worker_meta.completed_store_events == {last.store_event: 1}
        assert not h.scheduler.connector.has_pending_push_work()
        assert_scheduler_empty(h.scheduler)
    finally:
        h.shutdown()


def test_no_hit_without_a_store() -> None:
    """A prompt the tier never saw gets no external tokens and is computed normally."""
    h = offload_engine()
    req = make_request(prompt=prompt(9), max_tokens=1, block_size=BLOCK, request_id="fresh")
    h.scheduler.add_request(req)
    out, _ = h.engine_step(write_blocks=True)
    assert out.num_scheduled_tokens == {"fresh": PROMPT}
    outs = [out] + h.drain(write_blocks=True)
    assert not any(m.load_gpu_blocks for m in metas(outs))
    assert_scheduler_empty(h.scheduler)
    h.shutdown()


def test_stats_ship_only_when_they_can_have_changed_and_none_is_lost(engine: WorkerHarness) -> None:
    """vLLM asks for the connector's stats every step and sends them with the step's output.
    The connector answers only after a hook that can change them, so the steps of an engine that
    waits (here: idle steps) carry none; what it ships, counters summed and gauges last, is what
    vLLM's own every-step stats would have added up to."""
    from vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector import (
        SimpleCPUOffloadConnector as VllmConnector,
    )
    from vllm.v1.simple_kv_offload.metrics import MetricName, SimpleCPUOffloadStats

    h = engine
    shipped = SimpleCPUOffloadStats()
    carried: list[bool] = []

    def step() -> SchedulerOutput:
        out, eco = h.engine_step(write_blocks=True)
        payload = eco[0].scheduler_stats.kv_connector_stats if eco else None
        carried.append(payload is not None)
        if payload is not None:
            shipped.aggregate(SimpleCPUOffloadStats(data=payload))
        return out

    a = prompt(0)
    for rid, p in (("A1", a), ("E1", prompt(1)), ("E2", prompt(2)), ("E3", prompt(3)), ("A2", a)):
        r = make_request(prompt=p, max_tokens=2, block_size=BLOCK, request_id=rid)
        h.scheduler.add_request(r)
        deadline = time.monotonic() + 30  # the copies run on the worker's copy threads
        while not r.is_finished() or h.scheduler.connector.has_pending_push_work():
            assert time.monotonic() < deadline, f"{rid} not finished and stored"
            step()
    idle = len(carried)
    for _ in range(3):
        step()
    assert carried[idle:] == [False] * 3

    totals = shipped.reduce()
    assert totals[MetricName.LOAD_BLOCKS] == 4  # A2 loaded A's four blocks from the host tier
    # vLLM's own stats, asked now: no counter has grown since the last shipped ones, and every
    # gauge is as last shipped.
    now = VllmConnector.get_kv_connector_stats(h.scheduler.connector)
    assert isinstance(now, SimpleCPUOffloadStats)
    gauges = (MetricName.USED_BLOCKS, MetricName.PENDING_STORE_BLOCKS)
    assert now.reduce() == {key: totals[key] for key in gauges}


def test_a_lookup_ships_stats_only_when_it_pins_or_releases_blocks() -> None:
    """A lookup that finds nothing leaves vLLM's stats as they were (a P/D decode's lookups all
    miss), so none ship after it, nor after another child's finished load; one that pins blocks,
    and the next lookup or allocation that releases the pin, change the used-blocks gauge, and
    stats ship after each."""
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.simple_kv_offload.metrics import MetricName

    h = offload_engine()
    try:
        run(h, make_request(prompt=prompt(0), max_tokens=1, block_size=BLOCK, request_id="stored"))
        connector = h.scheduler.connector
        deadline = time.monotonic() + 30  # the copies run on the worker's copy threads
        while connector.has_pending_push_work():
            assert time.monotonic() < deadline, "the store did not finish"
            h.engine_step(write_blocks=True)
        connector.get_kv_connector_stats()  # what was shipped so far

        def used(stats: object) -> int:
            assert stats is not None
            return stats.reduce()[MetricName.USED_BLOCKS]

        miss = make_request(prompt=prompt(9), max_tokens=1, block_size=BLOCK, request_id="miss")
        assert connector.get_num_new_matched_tokens(miss, 0) == (0, False)
        assert connector.get_kv_connector_stats() is None
        connector.update_connector_output(KVConnectorOutput(finished_recving={"miss"}))  # its NIXL pull
        assert connector.get_kv_connector_stats() is None

        hit = make_request(prompt=prompt(0), max_tokens=1, block_size=BLOCK, request_id="hit")
        assert connector.get_num_new_matched_tokens(hit, 0) == (4 * BLOCK, True)
        pinned = used(connector.get_kv_connector_stats())
        # Looked up again where nothing is left to find: the first lookup's pin is released.
        assert connector.get_num_new_matched_tokens(hit, 4 * BLOCK) == (0, False)
        assert used(connector.get_kv_connector_stats()) < pinned
        assert connector.get_kv_connector_stats() is None

        # An allocation that takes no external tokens releases the pin too.
        again = make_request(prompt=prompt(0), max_tokens=1, block_size=BLOCK, request_id="again")
        assert connector.get_num_new_matched_tokens(again, 0) == (4 * BLOCK, True)
        pinned = used(connector.get_kv_connector_stats())
        connector.update_state_after_alloc(again, h.scheduler.kv_cache_manager.empty_kv_cache_blocks, 0)
        assert used(connector.get_kv_connector_stats()) < pinned
    finally:
        h.shutdown()
