"""The portable worker's copies run on copy threads: races between them and the engine.

Each test holds a copy thread at a gate (the backend's public ``store`` or ``load``, wrapped),
lets the engine run on, and checks what vLLM's protocol promises: the step that issues a store
does not wait for it (the next step starts it); the scheduler keeps the blocks a copy reads or
writes out of every other request's hands until the copy is reported; a load is reported only
once its bytes are in place; a preemption flush and shutdown start the stores not yet started
and wait for the copies in flight.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadMetadata

from kvcompose.testing.harness import assert_scheduler_empty, make_request
from kvcompose.testing.kv import fill_random, make_engine_kv
from kvcompose.testing.worker import WorkerHarness
from kvcompose_cpu_offload.host_backend import HostCopyBackend
from kvcompose_cpu_offload.portable_worker import PortableSimpleCPUOffloadWorker

BLOCK = 16
PROMPT = 4 * BLOCK + 8


class Gate:
    """Holds every call of a backend method until opened; records whether a hold ran out."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, method: str) -> None:
        self.open_ = threading.Event()
        self.entered = threading.Event()
        self.ran_out = False
        original: Callable[..., None] = getattr(HostCopyBackend, method)

        def held(backend: HostCopyBackend, src: list[int], dst: list[int]) -> None:
            self.entered.set()
            # A generous bound only so that a broken worker fails instead of hanging the run.
            if not self.open_.wait(60):
                self.ran_out = True
            original(backend, src, dst)

        monkeypatch.setattr(HostCopyBackend, method, held)

    def open(self) -> None:
        self.open_.set()


@pytest.fixture(autouse=True)
def every_copy_on_a_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are about the copy threads: no copy is small enough to be done in place."""
    monkeypatch.setattr(HostCopyBackend, "inline_copy_bytes", 0)


@pytest.fixture
def engine() -> Iterator[WorkerHarness]:
    h = WorkerHarness(
        {
            "kv_connector": "SimpleCPUOffloadConnector",
            "kv_connector_module_path": "kvcompose_cpu_offload.connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 20},
        },
        num_layers=2,
        num_blocks=12,
        block_size=BLOCK,
    )
    yield h
    h.shutdown()


def prompt(seed: int) -> list[int]:
    return [3 + (seed * 131 + i * 17) % 500 for i in range(PROMPT)]


def request(seed: int, rid: str) -> Request:
    return make_request(prompt=prompt(seed), max_tokens=2, block_size=BLOCK, request_id=rid)


def stored_blocks(outs: list[SchedulerOutput]) -> list[int]:
    return [b for o in outs for b in o.kv_connector_metadata.store_gpu_blocks]  # type: ignore[union-attr]


def test_a_store_in_flight_keeps_its_blocks_from_every_other_request(
    engine: WorkerHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    h = engine
    gate = Gate(monkeypatch, "store")
    a = request(0, "A")
    h.scheduler.add_request(a)
    # The engine steps, and A finishes, while A's store is held: no step waits for a store.
    outs = h.step_until(lambda _: a.is_finished(), "A did not finish", max_steps=10, write_blocks=True)
    held = stored_blocks(outs)
    assert len(held) == 4 and h.scheduler.connector.has_pending_push_work()
    h.engine_step(write_blocks=True)  # the step after the one that issued the store starts it
    assert gate.entered.wait(60)
    pool = h.scheduler.kv_cache_manager.block_pool
    assert all(pool.blocks[b].ref_cnt > 0 for b in held)

    # Three prompts that between them want the whole 11-block pool run while the store reads
    # A's blocks: the scheduler must give none of those blocks to them, so the stand-in forward
    # (which writes every block a step completes) never overwrites what the store is reading.
    others = [request(seed, f"E{seed}") for seed in (1, 2, 3)]
    for r in others:
        h.scheduler.add_request(r)
    for _ in range(12):
        h.engine_step(write_blocks=True)
        for r in others:
            if r.request_id in h.scheduler.requests and not r.is_finished():
                (ids,) = h.scheduler.kv_cache_manager.get_block_ids(r.request_id)
                assert not set(ids) & set(held), (r.request_id, ids, held)
        for k, b in enumerate(held):
            assert h.holds_prefix(b, a.prompt_token_ids[: (k + 1) * BLOCK]), (k, b)

    gate.open()
    h.step_until(lambda _: all(r.is_finished() for r in others), "the others did not finish", write_blocks=True)
    h.drain(write_blocks=True)
    assert not gate.ran_out
    assert_scheduler_empty(h.scheduler)

    # The late store copied A's bytes: scramble the device, forget its prefix cache, load A.
    fill_random(h.kv, seed=5)
    assert h.scheduler.reset_prefix_cache()
    a2 = request(0, "A2")
    h.scheduler.add_request(a2)
    h.step_until(lambda _: a2.status == RequestStatus.RUNNING or a2.is_finished(), "A2 never ran", write_blocks=True)
    (ids,) = h.scheduler.kv_cache_manager.get_block_ids("A2")
    for k in range(4):
        assert h.holds_prefix(ids[k], a.prompt_token_ids[: (k + 1) * BLOCK]), k


def test_a_load_is_reported_only_once_its_bytes_are_in_place(
    engine: WorkerHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    h = engine
    a = request(0, "A")
    h.scheduler.add_request(a)
    h.step_until(lambda _: a.is_finished(), "A did not finish", max_steps=10, write_blocks=True)
    h.drain(write_blocks=True)
    fill_random(h.kv, seed=9)
    assert h.scheduler.reset_prefix_cache()

    gate = Gate(monkeypatch, "load")
    a2 = request(0, "A2")
    h.scheduler.add_request(a2)
    for _ in range(6):
        h.engine_step(write_blocks=True)
        # While the copy is held nothing reports it, and A2 is not scheduled.
        assert a2.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        assert "A2" not in (h.last_output.finished_recving or ())  # type: ignore[union-attr]
    assert gate.entered.wait(60)
    gate.open()
    h.step_until(lambda _: "A2" in h.scheduler.finished_recving_kv_req_ids, "A2's load not reported")
    (ids,) = h.scheduler.kv_cache_manager.get_block_ids("A2")
    for k in range(4):
        assert h.holds_prefix(ids[k], a.prompt_token_ids[: (k + 1) * BLOCK]), k
    assert not gate.ran_out


def _worker_after_a_storing_step(seed: int) -> tuple[Any, PortableSimpleCPUOffloadWorker]:
    """A worker on random engine KV, after one engine step that stored device blocks 3, 4 and 9
    to pool blocks 0, 1 and 2 (store event 0); the next step has not begun."""
    kv = make_engine_kv(num_blocks=16)
    fill_random(kv, seed=seed)
    worker = PortableSimpleCPUOffloadWorker(kv.vllm_config, kv.kv_cache_config, 1 << 20)
    worker.register_kv_caches(kv.kv_caches)
    worker.bind_connector_metadata(
        SimpleCPUOffloadMetadata(store_event=0, store_gpu_blocks=[3, 4, 9], store_cpu_blocks=[0, 1, 2])
    )
    worker.start_load_kv()
    worker.wait_for_save()
    worker.clear_connector_metadata()
    return kv, worker


def _worker_with_a_held_store(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Gate, Any]:
    kv, worker = _worker_after_a_storing_step(seed=4)
    gate = Gate(monkeypatch, "store")
    worker.bind_connector_metadata(SimpleCPUOffloadMetadata())  # the next step starts it
    assert gate.entered.wait(60)
    assert worker.get_finished(set()) == (None, None) and worker.build_connector_worker_meta() is None
    return kv, gate, worker


def _pool_holds_the_store(kv: Any, worker: PortableSimpleCPUOffloadWorker) -> bool:
    assert worker.cpu_kv_caches is not None and worker.gpu_kv_caches is not None
    return all(
        torch.equal(worker.cpu_kv_caches[n][[0, 1, 2]], worker.gpu_kv_caches[n][[3, 4, 9]])
        for n in worker.gpu_kv_caches
    )


def test_the_step_that_issues_a_store_ends_before_the_store_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """A store is handed to the store thread when the next step binds its metadata, not in the
    step whose forward pass produced its KV (that step's tokens are sampled after
    ``wait_for_save`` and ``get_finished``); it is reported only once copied."""
    gate = Gate(monkeypatch, "store")
    gate.open()
    kv, worker = _worker_after_a_storing_step(seed=6)
    assert worker.get_finished(set()) == (None, None)
    assert not gate.entered.is_set() and not _pool_holds_the_store(kv, worker)
    assert worker.build_connector_worker_meta() is None

    worker.bind_connector_metadata(SimpleCPUOffloadMetadata())  # the next step, with nothing of its own
    assert gate.entered.wait(60)
    worker.handle_preemptions(SimpleCPUOffloadMetadata(need_flush=True))
    worker.get_finished(set())
    assert worker.build_connector_worker_meta().completed_store_events == {0: 1}
    assert _pool_holds_the_store(kv, worker)
    worker.shutdown()


@pytest.mark.parametrize("store", ["in flight", "not yet started"])
@pytest.mark.parametrize("how", ["preemption flush", "shutdown"])
def test_a_preemption_flush_and_shutdown_wait_for_every_store(
    monkeypatch: pytest.MonkeyPatch, how: str, store: str
) -> None:
    """A store held on the store thread, or one whose step ended and whose next step has not
    begun: the flush and shutdown return only once its bytes are in the pool."""
    if store == "in flight":
        kv, gate, worker = _worker_with_a_held_store(monkeypatch)
        # The gate opens from another thread while the engine's thread waits in the call below.
        threading.Timer(0.2, gate.open).start()
    else:
        kv, worker = _worker_after_a_storing_step(seed=7)
        gate = None
    if how == "shutdown":
        worker.shutdown()
    else:
        worker.handle_preemptions(SimpleCPUOffloadMetadata(need_flush=True))
        worker.get_finished(set())
        assert worker.build_connector_worker_meta().completed_store_events == {0: 1}
        worker.shutdown()
    assert _pool_holds_the_store(kv, worker)
    assert gate is None or not gate.ran_out


def test_the_engines_wait_on_a_copy_thread_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's preemption flush waits on the engine's thread for every copy in flight: a copy that
    never ends fails the wait with a clear error instead of holding the engine for good."""
    from kvcompose_cpu_offload import copy_threads

    monkeypatch.setattr(copy_threads, "SYNC_TIMEOUT_S", 0.05)
    stuck = copy_threads.ThreadEvent("host copy store")
    with pytest.raises(TimeoutError, match=r"KV offload host copy store still running after 0.05 s"):
        stuck.synchronize()
    stuck.set_done()
    stuck.synchronize()
