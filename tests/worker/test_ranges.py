"""``load: ranges`` on a decode instance: the host tier's prefix plus the rest over NIXL, byte for byte.

Two engines of the kit, each vLLM's real scheduler and workers: the prefill instance (a ``nixl``
producer) and the decode instance (``host`` then ``pd``, ``load: ranges``), their NIXL workers
talking through the fake agent, which copies the real bytes. A conversation's first turn runs on
the decode instance itself, so its host tier stores the turn's blocks; the decode's device KV is
then scrambled and its prefix cache dropped (what the traffic in between does in production).
The second turn comes from the prefill instance, and every block of the decode's request is
checked to hold the bytes the stand-in forward writes for that block's token prefix.
"""

from __future__ import annotations

from typing import Any

import pytest
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.request import Request, RequestStatus

from kvcompose.testing import inspector
from kvcompose.testing.harness import assert_scheduler_empty, make_request, prefill_request
from kvcompose.testing.kv import fill_random
from kvcompose.testing.worker import WorkerHarness
from kvcompose_nixl.testing.fake_nixl import FakeNixl, nixl_worker

BLOCK = 32  # the CPU attention kernel's block size, which NIXL's worker checks
PORT = 5641  # the prefill instance's side channel; the decode's is the next port


def prefill_yaml() -> str:
    return f"""
version: 1
connectors:
  - name: pd
    type: nixl
    role: producer
    options: {{side_channel_host: 127.0.0.1, side_channel_port: {PORT}}}
"""


def decode_yaml(load: str = "ranges", policy: str | None = None) -> str:
    failure = f"load_failure: {policy}\n" if policy else ""
    return f"""
version: 1
{failure}connectors:
  - name: host
    type: cpu-offload
    options: {{cpu_bytes: 4MiB}}
  - name: pd
    type: nixl
    role: consumer
    options: {{side_channel_host: 127.0.0.1, side_channel_port: {PORT + 1}}}
rules:
  load: {load}
"""


def tokens(n: int, seed: int = 0) -> list[int]:
    return [3 + (i * 37 + seed * 101) % 490 for i in range(n)]


def host_holds(d: WorkerHarness, prompt: list[int]) -> None:
    """The decode instance computes ``prompt`` itself (its host tier stores the full blocks), then
    loses it from the device: KV scrambled, prefix cache dropped."""
    req = make_request(len(prompt), block_size=BLOCK, prompt=prompt, max_tokens=1)
    d.scheduler.add_request(req)
    d.engine_step(write_blocks=True, eos=True)
    d.drain()
    assert_scheduler_empty(d.scheduler)
    fill_random(d.kv, seed=7)
    assert d.scheduler.reset_prefix_cache()


def prefill(p: WorkerHarness, prompt: list[int]) -> tuple[Request, dict[str, Any]]:
    """The prefill instance computes ``prompt`` (its forward writes every full block) and returns
    the params a proxy hands to the decode instance."""
    req = prefill_request(len(prompt), block_size=BLOCK, prompt=prompt)
    p.scheduler.add_request(req)
    _, eco = p.engine_step(write_blocks=True)
    (out,) = [o for outs in eco.values() for o in outs.outputs]
    return req, out.kv_transfer_params


def decode(d: WorkerHarness, prompt: list[int], params: dict[str, Any]) -> Request:
    req = make_request(len(prompt), block_size=BLOCK, prompt=prompt, max_tokens=2, kv_transfer_params=params)
    d.scheduler.add_request(req)
    return req


def until_loaded(
    d: WorkerHarness, req: Request, p: WorkerHarness, steps: int = 8, released: set[str] | None = None
) -> tuple[set[int], set[str]]:
    """Engine steps until vLLM's scheduler sees the request's load complete; the invalid blocks
    and failed loads the worker reported on the way (a child may report before the barrier).
    The host tier copies on its own thread, so its part may land a few steps (and moments) later.
    The prefill instance ``p`` steps beside the decode, as a running one does: it answers the
    decode's read (its blocks were held for it) and frees them; ``released`` collects its frees."""
    invalid: set[int] = set()
    failed: set[str] = set()
    loaded = False

    def seen(_outs: list[SchedulerOutput]) -> bool:
        nonlocal invalid, failed, loaded
        p.engine_step()
        if released is not None:
            released.update(p.last_output.finished_sending or ())
        out = d.last_output
        assert out is not None
        invalid |= out.invalid_block_ids or set()
        failed |= out.failed_recving or set()
        loaded = loaded or req.request_id in (out.finished_recving or ())
        return loaded

    # The step that started the load may have finished it too.
    d.step_until(seen, f"{req.request_id}: no finished_recving", max_steps=steps)
    return invalid, failed


def scheduled(d: WorkerHarness, req: Request, steps: int = 3) -> int:
    """Prompt tokens the decode instance computes for ``req`` once its load is over."""

    def ran(outs: list[SchedulerOutput]) -> bool:
        return any(req.request_id in o.num_scheduled_tokens for o in outs)

    outs = d.step_until(ran, f"{req.request_id} was not scheduled", max_steps=steps, eos=True)
    return int(outs[-1].num_scheduled_tokens[req.request_id])


def block_ids(d: WorkerHarness, req: Request) -> list[int]:
    (ids,) = d.scheduler.kv_cache_manager.get_block_ids(req.request_id)
    return list(ids)


def assert_blocks_hold(d: WorkerHarness, req: Request, prompt: list[int], full_blocks: int) -> None:
    ids = block_ids(d, req)
    for k in range(full_blocks):
        assert d.holds_prefix(ids[k], prompt[: (k + 1) * BLOCK]), f"block {k} (id {ids[k]})"


@pytest.fixture
def pd(fake_nixl: FakeNixl) -> tuple[WorkerHarness, WorkerHarness]:
    fake_nixl.cycles_before_done = 1
    return fake_nixl.pair(prefill_yaml(), decode_yaml(), num_blocks=32)


def test_host_prefix_then_the_rest_over_nixl(pd: tuple[WorkerHarness, WorkerHarness]) -> None:
    p, d = pd
    turn1 = tokens(4 * BLOCK)
    host_holds(d, turn1)
    turn2 = turn1 + tokens(2 * BLOCK, seed=1)  # 6 blocks: 4 in the host tier, 2 new
    preq, params = prefill(p, turn2)
    req = decode(d, turn2, params)

    out, _ = d.engine_step()
    conn = d.scheduler.connector
    assert inspector.loaders(conn, req.request_id) == ("host", "pd")
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    ids = block_ids(d, req)
    # NIXL's worker is handed exactly its range: the blocks after the host tier's four.
    (pull,) = out.kv_connector_metadata.children["pd"].reqs_to_recv[req.request_id].local_block_ids
    assert list(pull) == ids[4:6]
    assert len(out.kv_connector_metadata.children["host"].load_gpu_blocks) == 4
    # vLLM's prompt_tokens_by_source: each contributor's own tokens, under its own source.
    assert conn.get_external_cache_hit_sources(req, 191) == {CacheHitSource.HOST: 128, CacheHitSource.P2P: 63}

    released: set[str] = set()
    until_loaded(d, req, p, released=released)
    assert_blocks_hold(d, req, turn2, 6)
    assert scheduled(d, req) == 1  # 4 blocks + 63 tokens loaded, the last one computed
    d.engine_step()
    d.drain()
    assert_scheduler_empty(d.scheduler)
    # The decode's read notified the prefill instance, which freed its blocks.
    assert released == {preq.request_id}
    assert_scheduler_empty(p.scheduler)


def test_host_covers_every_full_block_and_nixl_the_partial_tail(pd: tuple[WorkerHarness, WorkerHarness]) -> None:
    p, d = pd
    turn1 = tokens(4 * BLOCK)
    host_holds(d, turn1)
    turn2 = turn1 + tokens(20, seed=2)  # 148 tokens: 4 full blocks in host, 20 in a partial fifth
    preq, params = prefill(p, turn2)
    req = decode(d, turn2, params)
    out, _ = d.engine_step()
    (pull,) = out.kv_connector_metadata.children["pd"].reqs_to_recv[req.request_id].local_block_ids
    assert list(pull) == block_ids(d, req)[4:5]  # one block: the tail
    until_loaded(d, req, p)
    assert_blocks_hold(d, req, turn2, 4)
    assert scheduled(d, req) == 1  # 128 from host, 19 pulled, 1 computed


def test_host_covers_the_whole_prompt_and_the_prefill_instance_is_freed_at_once(
    pd: tuple[WorkerHarness, WorkerHarness],
) -> None:
    p, d = pd
    prompt = tokens(4 * BLOCK + 1)  # vLLM computes the last token: host's 4 blocks are all there is to load
    host_holds(d, prompt)
    preq, params = prefill(p, prompt)
    assert p.scheduler.kv_cache_manager.usage > 0  # the prefill instance holds the prompt for the decode
    req = decode(d, prompt, params)
    out, _ = d.engine_step()
    assert inspector.loaders(d.scheduler.connector, req.request_id) == ("host",)
    # NIXL was told 0 tokens: it reads nothing and notifies the prefill instance.
    assert out.kv_connector_metadata.children["pd"].reqs_to_recv[req.request_id].local_block_ids == ()
    released: set[str] = set()
    until_loaded(d, req, p, released=released)
    assert_blocks_hold(d, req, prompt, 4)
    assert released == {preq.request_id}  # not at lease expiry
    assert_scheduler_empty(p.scheduler)
    assert p.scheduler.kv_cache_manager.usage == 0
    assert scheduled(d, req) == 1


def test_a_failed_nixl_range_invalidates_only_its_blocks_and_recompute_keeps_the_host_prefix(
    fake_nixl: FakeNixl,
) -> None:
    fake_nixl.cycles_before_done = 1
    p, d = fake_nixl.pair(prefill_yaml(), decode_yaml(policy="recompute"), num_blocks=32)
    turn1 = tokens(4 * BLOCK)
    host_holds(d, turn1)
    turn2 = turn1 + tokens(2 * BLOCK, seed=3)
    _, params = prefill(p, turn2)
    req = decode(d, turn2, params)
    fake_nixl.fail_next("err")
    d.engine_step()
    ids = block_ids(d, req)
    invalid, failed = until_loaded(d, req, p)
    assert failed == {req.request_id}
    assert invalid == set(ids[4:6])  # NIXL's range only
    assert_blocks_hold(d, req, turn2, 4)  # the host tier's range stays
    assert scheduled(d, req) == 2 * BLOCK  # recomputed from the first invalid block


def test_a_failed_nixl_range_under_fail_ends_the_request_with_an_error(
    pd: tuple[WorkerHarness, WorkerHarness], fake_nixl: FakeNixl
) -> None:
    p, d = pd
    turn1 = tokens(4 * BLOCK)
    host_holds(d, turn1)
    turn2 = turn1 + tokens(2 * BLOCK, seed=4)
    _, params = prefill(p, turn2)
    req = decode(d, turn2, params)
    fake_nixl.fail_next("err")
    until_loaded(d, req, p)
    assert req.is_finished() and req.get_finished_reason().name == "ERROR"
    d.drain()
    assert_scheduler_empty(d.scheduler)


def test_a_failed_host_range_invalidates_only_its_blocks(fake_nixl: FakeNixl) -> None:
    host = "{name: host, type: faulty, options: {matched_tokens: 128, is_async: true, "
    host += "faults: [{call: get_transfer_results, action: fail-load}]}}"
    decode_side = decode_yaml(policy="recompute").replace(
        "  - name: host\n    type: cpu-offload\n    options: {cpu_bytes: 4MiB}", "  - " + host
    )
    fake_nixl.cycles_before_done = 1
    p, d = fake_nixl.pair(prefill_yaml(), decode_side, num_blocks=32)
    prompt = tokens(6 * BLOCK, seed=5)
    _, params = prefill(p, prompt)
    req = decode(d, prompt, params)
    out, _ = d.engine_step()
    assert inspector.loaders(d.scheduler.connector, req.request_id) == ("host", "pd")
    ids = block_ids(d, req)
    assert list(out.kv_connector_metadata.children["pd"].reqs_to_recv[req.request_id].local_block_ids[0]) == ids[4:6]
    early = set(d.last_output.invalid_block_ids or ())  # the host tier failed at once
    invalid, failed = until_loaded(d, req, p)  # the barrier: both ranges reported, one failed
    assert failed == {req.request_id}
    assert early | invalid == set(ids[:4])
    for k in (4, 5):  # NIXL's range arrived
        assert d.holds_prefix(ids[k], prompt[: (k + 1) * BLOCK])
    # vLLM recomputes from block 0: it looks the request up again, and the double now has nothing.
    inspector.child(d.scheduler.connector, "host").matched_tokens = 0
    assert scheduled(d, req) == 6 * BLOCK


def test_an_abort_during_the_load_frees_everything_and_no_late_report_reaches_vllm(
    pd: tuple[WorkerHarness, WorkerHarness], fake_nixl: FakeNixl
) -> None:
    p, d = pd
    fake_nixl.cycles_before_done = 3
    turn1 = tokens(4 * BLOCK)
    host_holds(d, turn1)
    turn2 = turn1 + tokens(2 * BLOCK, seed=6)
    preq, params = prefill(p, turn2)
    req = decode(d, turn2, params)
    d.engine_step()
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    d.scheduler.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
    seen: list[set[str]] = []

    def reported(outs: list[SchedulerOutput]) -> bool:
        if outs:
            assert d.last_output is not None
            seen.append(set(d.last_output.finished_recving or ()))
        return any(req.request_id in s for s in seen)

    d.step_until(reported, "the aborted load was never reported", max_steps=8)
    for _ in range(4):
        d.engine_step()
        assert d.last_output is not None
        seen.append(set(d.last_output.finished_recving or ()))
    # vLLM frees a request aborted mid-load on its one load report, which comes once.
    assert sum(req.request_id in s for s in seen) == 1
    d.drain()
    assert_scheduler_empty(d.scheduler)
    for _ in range(3):
        p.engine_step()
    p.drain()
    assert_scheduler_empty(p.scheduler)  # the prefill instance was notified and freed its blocks


def test_a_prompt_shorter_than_a_block_is_pulled_whole(pd: tuple[WorkerHarness, WorkerHarness]) -> None:
    p, d = pd
    prompt = tokens(10, seed=8)
    _, params = prefill(p, prompt)
    req = decode(d, prompt, params)
    d.engine_step()
    assert inspector.loaders(d.scheduler.connector, req.request_id) == ("pd",)
    until_loaded(d, req, p)
    assert scheduled(d, req) == 1


def test_a_preemption_during_the_load_leaves_the_ranges_whole(fake_nixl: FakeNixl) -> None:
    # 12 usable blocks: the loading request takes 6, the running one grows into the rest and is
    # preempted while the NIXL range is still in flight.
    fake_nixl.cycles_before_done = 40
    p, d = fake_nixl.pair(prefill_yaml(), decode_yaml(), num_blocks=13)
    turn1 = tokens(4 * BLOCK)
    host_holds(d, turn1)
    other = make_request(5 * BLOCK, block_size=BLOCK, prompt=tokens(5 * BLOCK, seed=9), max_tokens=64)
    d.scheduler.add_request(other)
    d.engine_step(write_blocks=True)
    turn2 = turn1 + tokens(2 * BLOCK, seed=10)
    _, params = prefill(p, turn2)
    req = decode(d, turn2, params)
    d.engine_step(write_blocks=True)
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS and other.status == RequestStatus.RUNNING
    invalid: set[int] = set()
    for _ in range(BLOCK + 2):
        d.engine_step(write_blocks=True)
        invalid |= d.last_output.invalid_block_ids or set()
        if other.status == RequestStatus.PREEMPTED:
            break
    assert other.status == RequestStatus.PREEMPTED and req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    more, failed = until_loaded(d, req, p, steps=20)
    assert not invalid | more and not failed
    assert_blocks_hold(d, req, turn2, 6)
    assert scheduled(d, req) == 1
    for _ in range(80):
        d.engine_step(write_blocks=True)
        if other.is_finished() and req.is_finished():
            break
    assert other.is_finished() and req.is_finished()
    d.drain()
    assert_scheduler_empty(d.scheduler)


def test_a_range_loads_nothing_from_params_of_another_prompt(fake_nixl: FakeNixl) -> None:
    """Issue 60 under ``ranges``: the host tier holds turn 1, the client sends turn 2 plus ten
    tokens with turn 2's params. NIXL's range (the rest) would be the prefill's positions of
    another prompt: the params are refused (``prompt``), the host tier loads its prefix, the rest
    is computed here (``load_failure: recompute``; under ``fail`` the request ends with an
    error), and nothing is read."""
    fake_nixl.cycles_before_done = 1
    p, d = fake_nixl.pair(prefill_yaml(), decode_yaml(policy="recompute"), num_blocks=32)
    turn1 = tokens(4 * BLOCK)
    host_holds(d, turn1)
    turn2 = turn1 + tokens(2 * BLOCK, seed=11)
    _, params = prefill(p, turn2)
    longer = turn2 + tokens(10, seed=12)
    req = decode(d, longer, params)
    out, _ = d.engine_step()
    assert inspector.loaders(d.scheduler.connector, req.request_id) == ("host",)
    assert req.request_id not in out.kv_connector_metadata.children["pd"].reqs_to_recv
    until_loaded(d, req, p)
    assert_blocks_hold(d, req, longer, 4)  # the host tier's prefix
    assert scheduled(d, req) == len(longer) - 4 * BLOCK  # the rest computed here
    assert not nixl_worker(d).nixl_wrapper.called("transfer")  # nothing read
