"""NIXL + CPU offload composed from YAML, in vLLM's real scheduler (vllm#43871's scenarios and more).

Where a scenario needs workers, the kit's harnesses run them: vLLM's NIXL workers talk through
the kit's fake NIXL agent (``fake_nixl.pair``: a producer and a consumer composition, handshaken)
and the CPU tier's worker stores and acknowledges its stores itself (``engine_step``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector import SimpleCPUOffloadConnector
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.request import Request, RequestStatus
from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadMetadata

from kvcompose.testing import inspector
from kvcompose.testing.harness import (
    assert_scheduler_empty,
    decode_request,
    make_request,
    prefill_request,
    step,
)
from kvcompose.testing.worker import WorkerHarness
from kvcompose.vllm.metadata import ComposedMetadata
from kvcompose_nixl.testing.fake_nixl import FakeNixl

Factory = Callable[..., Any]
BLOCK = 32  # with workers: the CPU attention kernel's block size, which NIXL's worker checks


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
    options: {{cpu_bytes: 16MiB}}  # plenty here; the CPU block pool is built per block, so keep it small
"""


def prefill_then_decode(p: WorkerHarness, d: WorkerHarness, n: int = 128) -> tuple[Request, dict[str, Any], Request]:
    """The prefill engine runs a P/D request; the proxy hands its params to the decode engine."""
    req = prefill_request(n, block_size=BLOCK)
    p.scheduler.add_request(req)
    _, eco = p.engine_step()
    (out,) = [o for e in eco.values() for o in e.outputs]
    dreq = make_request(n, block_size=BLOCK, prompt=req.prompt_token_ids, kv_transfer_params=out.kv_transfer_params)
    d.scheduler.add_request(dreq)
    return req, out.kv_transfer_params, dreq


def test_hma_iff_every_child(kvcompose_scheduler: Factory) -> None:
    sched = kvcompose_scheduler(composition("consumer"), sliding_window=128)
    assert not sched.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
    assert (
        all(supports_hma(c) for c in sched.connector.sub_connectors) and len(sched.kv_cache_config.kv_cache_groups) == 2
    )


def test_nixl_wins_a_remote_prefill_and_the_cpu_child_loads_nothing(fake_nixl: FakeNixl) -> None:
    fake_nixl.cycles_before_done = 1
    p, d = fake_nixl.pair(composition("producer"), composition("consumer"))
    _, _, req = prefill_then_decode(p, d)
    out, _ = d.engine_step()
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    meta = out.kv_connector_metadata
    assert isinstance(meta, ComposedMetadata) and list(meta.children) == ["pd", "host"]
    assert isinstance(meta.children["pd"], NixlConnectorMetadata)
    assert req.request_id in meta.children["pd"].reqs_to_recv
    assert isinstance(meta.children["host"], SimpleCPUOffloadMetadata)
    assert not meta.children["host"].load_gpu_blocks
    assert d.scheduler.connector.get_external_cache_hit_sources(req, 127) == {CacheHitSource.P2P: 127}
    # The NIXL worker's READ is DONE, and taken once the prefill answered that it held its blocks.
    d.step_until(lambda _o: (p.engine_step(), req.request_id in (d.last_output.finished_recving or ()))[1], "no read")
    assert not d.last_output.failed_recving
    out, _ = d.engine_step(eos=True)
    assert out.num_scheduled_tokens == {req.request_id: 1}  # 127 pulled, 1 recomputed
    assert req.num_computed_tokens == 128
    d.engine_step()
    d.drain()  # the host tier's stores of the pulled blocks, reported from its copy thread
    assert_scheduler_empty(d.scheduler)


def test_store_to_all_then_the_cpu_tier_wins_a_repeated_prompt(fake_nixl: FakeNixl, kvcompose_worker: Factory) -> None:
    h = kvcompose_worker(composition("consumer"), num_blocks=12, block_size=BLOCK)
    a = make_request(128, block_size=BLOCK)
    h.scheduler.add_request(a)
    h.engine_step()
    out2, _ = h.engine_step(eos=True)
    assert out2.kv_connector_metadata.children["host"].store_event >= 0  # the cpu child stores, nixl present
    h.drain()  # the store runs on the host tier's copy thread; the tier serves A once it is reported
    # Push A out of the device prefix cache.
    for k in range(3):
        h.scheduler.add_request(
            make_request(128, block_size=BLOCK, prompt=[7 + (i * 13 + k * 101) % 500 for i in range(128)])
        )
        h.engine_step(eos=True)
        h.engine_step()
    conn = h.scheduler.connector
    again = make_request(128, block_size=BLOCK, prompt=a.prompt_token_ids)
    toks, is_async = conn.get_num_new_matched_tokens(again, 0)
    assert toks and toks > 0 and is_async
    assert inspector.loaders(conn, again.request_id) == ("host",)  # host, since nixl has no remote params
    assert conn.get_external_cache_hit_sources(again, toks) == {CacheHitSource.HOST: toks}


def test_plain_request_finishes_with_no_async_save(kvcompose_scheduler: Factory) -> None:
    sched = kvcompose_scheduler(composition("consumer"), sliding_window=128)
    req = make_request(40)
    assert sched.connector.request_finished_all_groups(req, ([1, 2, 3], [1, 2, 3])) == (False, None)
    assert sched.schedule().kv_connector_metadata.saves_owed == {}  # no child delays the free


def test_prefill_side_returns_nixl_params_with_blocks_held(fake_nixl: FakeNixl) -> None:
    p, d = fake_nixl.pair(composition("producer"), composition("consumer"))
    req, params, _ = prefill_then_decode(p, d)
    assert params["do_remote_prefill"] is True and params["remote_port"] == 5633
    assert params["remote_host"] == "127.0.0.1"
    assert len(params["remote_block_ids"][0]) == 4
    assert req.request_id in p.scheduler.requests  # blocks held until decode has read them
    out, _ = p.engine_step()
    assert out.kv_connector_metadata.saves_owed == {req.request_id: (0,)}  # only nixl holds them
    assert req.request_id in p.scheduler.requests
    d.engine_step()  # the decode engine reads the blocks and notifies
    p.engine_step()
    assert p.last_output.finished_sending == {req.request_id}
    p.drain()  # the prefill's host tier stored the prompt on its copy thread
    assert_scheduler_empty(p.scheduler)


def test_prompt_shorter_than_a_block_with_empty_remote_blocks_runs_locally(kvcompose_scheduler: Factory) -> None:
    sched = kvcompose_scheduler(composition("consumer"))
    req = decode_request(10, remote_block_ids=[])
    sched.add_request(req)
    out, _ = step(sched, eos=True)
    assert out.num_scheduled_tokens == {req.request_id: 10}
    step(sched)
    assert_scheduler_empty(sched)


def test_prompt_shorter_than_a_block_with_a_partial_block_is_pulled(kvcompose_scheduler: Factory) -> None:
    sched = kvcompose_scheduler(composition("consumer"))
    req = decode_request(10, remote_block_ids=[5])
    sched.add_request(req)
    out, _ = step(sched)
    assert req.request_id in out.kv_connector_metadata.children["pd"].reqs_to_recv
    step(sched, finished_recving={req.request_id})
    step(sched, eos=True)
    step(sched)
    assert_scheduler_empty(sched)


def test_the_cpu_child_is_the_real_vllm_class_family(kvcompose_scheduler: Factory) -> None:
    sched = kvcompose_scheduler(composition("consumer"))
    assert isinstance(inspector.child(sched.connector, "host"), SimpleCPUOffloadConnector)
    assert sched.connector.sub_connectors[1] is inspector.child(sched.connector, "host")


def test_the_pd_read_is_posted_before_the_host_tier_loads_whatever_the_yaml_order(
    fake_nixl: FakeNixl, kvcompose_worker: Factory
) -> None:
    """The host tier is listed first (it loads first under ``first-wins``), but in a worker step
    NIXL's ``start_load_kv`` runs before its: a read waiting behind the host tier's copies on the
    engine's thread would reach the prefill instance that much later."""
    host_first = """
version: 1
connectors:
  - name: host
    type: cpu-offload
    options: {cpu_bytes: 16MiB}
  - name: pd
    type: nixl
    role: consumer
    options: {side_channel_host: 127.0.0.1, side_channel_port: 5634}
"""
    h = kvcompose_worker(host_first, num_blocks=12, block_size=BLOCK)
    conn = h.connector
    calls: list[str] = []
    for name in ("host", "pd"):
        child = inspector.child(conn, name)
        child.start_load_kv = (lambda f, n: lambda *a, **k: (calls.append(n), f(*a, **k))[1])(child.start_load_kv, name)
    h.step(h.idle_metadata())
    assert calls and calls == ["pd", "host"] * (len(calls) // 2)
    assert conn.names == ("host", "pd")
