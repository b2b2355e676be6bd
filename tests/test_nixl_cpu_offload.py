"""NIXL + CPU offload composed from YAML, in vLLM's real scheduler (vllm#43871's scenarios and more)."""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector import SimpleCPUOffloadConnector
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.request import RequestStatus
from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadMetadata, SimpleCPUOffloadWorkerMetadata

from kvcompose.testing.harness import (
    assert_scheduler_empty,
    model_runner_output,
    decode_request,
    make_request,
    prefill_request,
    step,
)
from kvcompose.vllm.metadata import ComposedMetadata, ComposedWorkerMetadata
from tests.compose_util import composed_scheduler


def composition(role: str) -> str:
    return f"""
version: 1
connectors:
  - name: pd
    type: nixl
    role: {role}
    options: {{side_channel_host: 127.0.0.1, side_channel_port: 5633}}
  - name: host
    type: cpu-offload
    options: {{cpu_bytes: 1GiB}}
"""


def store_ack(conn, out) -> ComposedWorkerMetadata | None:  # type: ignore[no-untyped-def]
    """What the CPU tier's workers report once the step's stores are done."""
    meta = out.kv_connector_metadata.children["host"]
    if meta is None or meta.store_event < 0:
        return None
    workers = conn.child("host").scheduler_manager._expected_worker_count  # type: ignore[attr-defined]
    return ComposedWorkerMetadata({"pd": None, "host": SimpleCPUOffloadWorkerMetadata({meta.store_event: workers})})


def step_acked(sched, conn, *, eos: bool = False, **kv):  # type: ignore[no-untyped-def]
    """One step whose worker output also acknowledges the CPU tier's stores of that step."""
    out = sched.schedule()
    running = [sched.requests[r] for r in out.num_scheduled_tokens]
    eco = sched.update_from_output(out, model_runner_output(running, eos=eos, worker_meta=store_ack(conn, out), **kv))
    return out, eco


def test_hma_iff_every_child(tmp_path) -> None:  # type: ignore[no-untyped-def]
    sched, conn = composed_scheduler(composition("consumer"), sliding_window=128)
    assert not sched.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
    assert conn._all_hma and len(sched.kv_cache_config.kv_cache_groups) == 2


def test_nixl_wins_a_remote_prefill_and_the_cpu_child_loads_nothing() -> None:
    sched, conn = composed_scheduler(composition("consumer"))
    req = decode_request(64)
    sched.add_request(req)
    out, _ = step_acked(sched, conn)
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    meta = out.kv_connector_metadata
    assert isinstance(meta, ComposedMetadata) and list(meta.children) == ["pd", "host"]
    assert isinstance(meta.children["pd"], NixlConnectorMetadata)
    assert req.request_id in meta.children["pd"].reqs_to_recv
    assert isinstance(meta.children["host"], SimpleCPUOffloadMetadata)
    assert not meta.children["host"].load_gpu_blocks
    assert conn.get_external_cache_hit_sources(req, 63) == {CacheHitSource.P2P: 63}
    step_acked(sched, conn, finished_recving={req.request_id})
    out, _ = step_acked(sched, conn, eos=True)
    assert out.num_scheduled_tokens == {req.request_id: 1}  # 63 pulled, 1 recomputed
    assert req.num_computed_tokens == 64
    step_acked(sched, conn)
    assert_scheduler_empty(sched)


def test_store_to_all_then_the_cpu_tier_wins_a_repeated_prompt() -> None:
    sched, conn = composed_scheduler(composition("consumer"), num_blocks=12)
    a = make_request(64)
    sched.add_request(a)
    out, _ = step(sched)
    out2 = sched.schedule()
    assert out2.kv_connector_metadata.children["host"].store_event >= 0  # the cpu child stores, nixl present
    sched.update_from_output(out2, model_runner_output([a], eos=True, worker_meta=store_ack(conn, out2)))
    # Push A out of the device prefix cache.
    for _ in range(3):
        other = make_request(64, prompt=[7 + (i * 13 + _ * 101) % 500 for i in range(64)])
        sched.add_request(other)
        out, _o = step(sched, eos=True, worker_meta=None)
        out = sched.schedule()
        sched.update_from_output(out, model_runner_output([], worker_meta=store_ack(conn, out)))
    again = make_request(64, prompt=a.prompt_token_ids)
    toks, is_async = conn.get_num_new_matched_tokens(again, 0)
    assert toks and toks > 0 and is_async
    assert conn._load_owner[again.request_id][0] == 1  # host, since nixl has no remote params
    assert conn.get_external_cache_hit_sources(again, toks) == {CacheHitSource.HOST: toks}


def test_plain_request_finishes_with_no_async_save() -> None:
    sched, conn = composed_scheduler(composition("consumer"), sliding_window=128)
    req = make_request(40)
    assert conn.request_finished_all_groups(req, ([1, 2, 3], [1, 2, 3])) == (False, None)
    assert conn._new_saves == {}


def test_prefill_side_returns_nixl_params_with_blocks_held() -> None:
    sched, conn = composed_scheduler(composition("producer"))
    req = prefill_request(64)
    sched.add_request(req)
    out, eco = step_acked(sched, conn)
    outputs = [o for e in eco.values() for o in e.outputs]
    params = outputs[0].kv_transfer_params
    assert params["do_remote_prefill"] is True and params["remote_port"] == 5633
    assert params["remote_host"] == "127.0.0.1"
    assert len(params["remote_block_ids"][0]) == 4
    assert req.request_id in sched.requests  # blocks held until decode has read them
    out = sched.schedule()
    assert out.kv_connector_metadata.saves_owed == {req.request_id: (0,)}  # only nixl holds them
    sched.update_from_output(out, model_runner_output([], worker_meta=store_ack(conn, out)))
    step_acked(sched, conn, finished_sending={req.request_id})
    assert_scheduler_empty(sched)


def test_prompt_shorter_than_a_block_with_empty_remote_blocks_runs_locally() -> None:
    sched, conn = composed_scheduler(composition("consumer"))
    req = decode_request(10, remote_block_ids=[])
    sched.add_request(req)
    out, _ = step(sched, eos=True)
    assert out.num_scheduled_tokens == {req.request_id: 10}
    step(sched)
    assert_scheduler_empty(sched)


def test_prompt_shorter_than_a_block_with_a_partial_block_is_pulled() -> None:
    sched, conn = composed_scheduler(composition("consumer"))
    req = decode_request(10, remote_block_ids=[5])
    sched.add_request(req)
    out, _ = step(sched)
    assert req.request_id in out.kv_connector_metadata.children["pd"].reqs_to_recv
    step(sched, finished_recving={req.request_id})
    step(sched, eos=True)
    step(sched)
    assert_scheduler_empty(sched)


def test_the_cpu_child_is_the_real_vllm_class_family() -> None:
    sched, conn = composed_scheduler(composition("consumer"))
    assert isinstance(conn.child("host"), SimpleCPUOffloadConnector)
    assert sched.connector._connectors[1] is conn.child("host")
