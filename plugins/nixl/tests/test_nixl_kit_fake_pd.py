"""vLLM's real NIXL workers, producer and consumer, do a P/D READ through the fake NIXL agent.

Both sides run vLLM's scheduler and worker-role NixlConnector over engine-shaped CPU KV
(``WorkerHarness.engine_step``); only the agent underneath is the kit's fake, which copies the
real bytes between the two caches. The handshake is ``FakeNixl.handshake`` (vLLM's side-channel
handshake minus the ZMQ fetch), pinned to vLLM's code below.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch

from kvcompose.testing.harness import assert_scheduler_empty, make_request, prefill_request
from kvcompose.testing.kv import fill_random
from kvcompose.testing.worker import WorkerHarness
from kvcompose_nixl.testing.fake_nixl import CONSUMER, PRODUCER, FakeNixl, nixl_worker

BLOCK = 32  # the CPU attention kernel's block size, which NIXL's worker checks
PROMPT = 3 * BLOCK


def _prefill(p: WorkerHarness) -> tuple[Any, dict[str, Any]]:
    """The prefill instance runs a P/D request; returns it and the params its output carries."""
    req = prefill_request(PROMPT, block_size=BLOCK)
    p.scheduler.add_request(req)
    _, eco = p.engine_step()
    (out,) = [o for outs in eco.values() for o in outs.outputs]
    assert out.kv_transfer_params["remote_engine_id"] == nixl_worker(p).engine_id
    return req, out.kv_transfer_params


def _decode_side(d: WorkerHarness, req: Any, params: dict[str, Any]) -> Any:
    """The proxy hands the prefill output's params to the decode instance with the same prompt."""
    dreq = make_request(PROMPT, block_size=BLOCK, prompt=req.prompt_token_ids, max_tokens=3, kv_transfer_params=params)
    d.scheduler.add_request(dreq)
    return dreq


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)  # random bytes are not all valid floats: compare bytes


def _until(h: WorkerHarness, field: str, steps: int = 8) -> tuple[int, set[str]]:
    """Engine steps until the worker's output reports something in ``field``; (step index, ids)."""
    for i in range(steps):
        h.engine_step()
        assert h.last_output is not None
        got = getattr(h.last_output, field)
        if got:
            return i, set(got)
    raise AssertionError(f"no {field} in {steps} engine steps")


def test_read_copies_the_producers_blocks_then_both_sides_finish(fake_nixl: FakeNixl) -> None:
    fake_nixl.cycles_before_done = 2
    p, d = fake_nixl.pair()
    req, params = _prefill(p)
    (remote_blocks,) = params["remote_block_ids"]
    assert len(remote_blocks) == PROMPT // BLOCK
    fill_random(p.kv, seed=1)  # what the prefill forward wrote
    before = d.kv.snapshot()
    dreq = _decode_side(d, req, params)

    step, recved = _until(d, "finished_recving")
    # The READ answered PROC for the configured checks, then DONE; vLLM reported it once.
    assert (step, recved) == (fake_nixl.cycles_before_done, {dreq.request_id})
    assert not d.last_output.invalid_block_ids and not d.last_output.failed_recving
    (local_blocks,) = d.scheduler.kv_cache_manager.get_block_ids(dreq.request_id)
    pulled = torch.tensor(local_blocks[: len(remote_blocks)])
    untouched = [b for b in range(d.kv.kv_cache_config.num_blocks) if b not in local_blocks]
    for layer in p.layer_names:
        assert torch.equal(
            _as_bytes(d.kv_caches[layer][pulled]), _as_bytes(p.kv_caches[layer][torch.tensor(remote_blocks)])
        ), layer
        assert torch.equal(_as_bytes(d.kv_caches[layer][untouched]), _as_bytes(before[layer][untouched])), layer

    # The consumer's notification frees the producer's blocks.
    _, sent = _until(p, "finished_sending")
    assert sent == {req.request_id}
    assert_scheduler_empty(p.scheduler)
    # The decode instance computes on the pulled KV to the end.
    for _ in range(4):
        d.engine_step()
    assert_scheduler_empty(d.scheduler)


@pytest.mark.parametrize("kind", ["err", "raise"])
def test_a_failed_read_reports_the_blocks_invalid_and_fails_the_request(fake_nixl: FakeNixl, kind: str) -> None:
    fake_nixl.cycles_before_done = 1
    p, d = fake_nixl.pair()
    req, params = _prefill(p)
    fill_random(p.kv, seed=2)
    dreq = _decode_side(d, req, params)
    fake_nixl.fail_next(kind)

    _, recved = _until(d, "finished_recving")
    out = d.last_output
    (local_blocks,) = d.scheduler.kv_cache_manager.get_block_ids(dreq.request_id) or ([],)
    assert recved == out.failed_recving == {dreq.request_id}
    assert out.invalid_block_ids == set(range(1, 1 + PROMPT // BLOCK))  # the blocks the READ was to fill
    # vLLM 0.32's default kv_load_failure_policy "fail": the request ends in error, nothing leaks.
    assert dreq.is_finished() and dreq.get_finished_reason().name == "ERROR"
    assert_scheduler_empty(d.scheduler)
    assert not d.kv.raw.any()  # no byte arrived
    # No notification: the producer keeps its blocks (until its lease expires) and reports nothing.
    for _ in range(3):
        p.engine_step()
        assert not p.last_output.finished_sending
    assert req.request_id in p.scheduler.requests


def test_recompute_policy_computes_the_prompt_locally_after_a_failed_read(fake_nixl: FakeNixl) -> None:
    p, d = fake_nixl.pair(consumer={**CONSUMER, "kv_load_failure_policy": "recompute"})
    req, params = _prefill(p)
    dreq = _decode_side(d, req, params)
    fake_nixl.fail_next("err")
    _until(d, "finished_recving")
    assert d.last_output.invalid_block_ids
    scheduled = []
    for _ in range(5):
        so, _ = d.engine_step()
        scheduled.append(so.num_scheduled_tokens.get(dreq.request_id, 0))
    assert scheduled[0] == PROMPT  # the whole prompt runs on the decode instance
    assert dreq.is_finished() and dreq.get_finished_reason().name == "LENGTH"
    assert_scheduler_empty(d.scheduler)


def test_a_dropped_notification_leaves_the_producer_holding_its_blocks(fake_nixl: FakeNixl) -> None:
    p, d = fake_nixl.pair()
    req, params = _prefill(p)
    dreq = _decode_side(d, req, params)
    fake_nixl.fail_next("drop-notif")
    assert _until(d, "finished_recving")[1] == {dreq.request_id}
    assert not d.last_output.invalid_block_ids
    for _ in range(3):
        p.engine_step()
        assert not p.last_output.finished_sending
    assert req.request_id in p.scheduler.requests


def test_a_composed_consumer_pulls_through_its_nixl_child(fake_nixl: FakeNixl) -> None:
    consumer = """
version: 1
connectors:
  - {name: host, type: cpu-offload, options: {cpu_bytes: 4MiB}}
  - {name: pd, type: nixl, role: consumer}
"""
    p, d = fake_nixl.pair(PRODUCER, consumer)
    assert nixl_worker(d) is d.child("pd").connector_worker
    req, params = _prefill(p)
    fill_random(p.kv, seed=3)
    dreq = _decode_side(d, req, params)
    assert _until(d, "finished_recving")[1] == {dreq.request_id}
    (local_blocks,) = d.scheduler.kv_cache_manager.get_block_ids(dreq.request_id)
    (remote_blocks,) = params["remote_block_ids"]
    layer = p.layer_names[0]
    assert torch.equal(
        _as_bytes(d.kv_caches[layer][torch.tensor(local_blocks[:3])]),
        _as_bytes(p.kv_caches[layer][torch.tensor(remote_blocks)]),
    )
    assert _until(p, "finished_sending")[1] == {req.request_id}


def test_handshake_follows_vllms_side_channel_handshake() -> None:
    """FakeNixl.handshake repeats what follows the ZMQ fetch in vLLM's handshake: pin that code."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import NixlBaseConnectorWorker

    shake = inspect.getsource(NixlBaseConnectorWorker._nixl_handshake)
    for step in (
        "Decoder(NixlHandshakePayload)",
        "compatibility_hash != self.compat_hash",
        "Decoder(NixlAgentMetadata)",
        "_validate_remote_parallel_config(metadata)",
        "self.add_remote_agent(",
        "remote_rank_to_agent_name[remote_ranks] = remote_agent_name",
    ):
        assert step in shake, f"vLLM's _nixl_handshake changed ({step!r}): update FakeNixl.handshake"
    done = inspect.getsource(NixlBaseConnectorWorker._ensure_handshake)
    for field in ("self._remote_agents[eid]", "self._engine_clock_offset[eid]", "self._engine_last_active[eid]"):
        assert field in done, f"vLLM's handshake bookkeeping changed ({field}): update FakeNixl.handshake"


def test_handshake_before_registration_and_without_nixl_are_errors(fake_nixl: FakeNixl) -> None:
    p = WorkerHarness(PRODUCER, block_size=BLOCK, register=False)
    d = WorkerHarness(CONSUMER, block_size=BLOCK)
    try:
        with pytest.raises(RuntimeError, match="has not registered its KV caches"):
            fake_nixl.handshake(d, p)
        with pytest.raises(ValueError, match="0 NIXL workers"):
            nixl_worker(object())
    finally:
        p.shutdown()
        d.shutdown()
