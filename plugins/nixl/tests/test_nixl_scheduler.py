"""kvcompose_nixl.connector under vLLM's real Scheduler (scheduler role, CPU, no NIXL agent).

The scheduler role of the NIXL connector creates no NIXL agent (only its worker does), so these
tests need no NIXL hardware, no model weights and no network: the model is a local
``config.json`` from kvcompose's test kit.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from typing import Any

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata
from vllm.v1.request import FinishReason, RequestStatus

from kvcompose.testing.harness import (
    assert_scheduler_empty,
    decode_request,
    model_runner_output,
    prefill_request,
    scheduler_for,
    step,
)
from kvcompose_nixl.connector import NixlConnector, NixlPushConnector, has_remote_blocks
from kvcompose_nixl.plugin import PARAM_KEYS

BLOCK_SIZE = 16
SHORT = BLOCK_SIZE - 6  # a prompt shorter than one block

#: Where kvcompose's connector classes live; leaving it out loads vLLM's own classes.
OURS = "kvcompose_nixl.connector"

SchedulerFactory = Callable[..., Any]


@pytest.fixture
def make_nixl_scheduler() -> SchedulerFactory:
    """``make_nixl_scheduler(role, module=OURS, connector="NixlConnector", **extra_config)``."""

    def make(
        role: str,
        *,
        module: str | None = OURS,
        connector: str = "NixlConnector",
        data_parallel_index: int = 0,
        num_blocks: int = 100,
        **extra: Any,
    ) -> Any:
        ktc: dict[str, Any] = {"kv_connector": connector, "kv_role": role, "kv_connector_extra_config": extra}
        if module is not None:
            ktc["kv_connector_module_path"] = module
        return scheduler_for(ktc, block_size=BLOCK_SIZE, num_blocks=num_blocks, data_parallel_index=data_parallel_index)

    return make


def assert_connector_idle(scheduler: Any) -> None:
    """No read queued, no heartbeat, no lease, no request tracked by the NIXL scheduler half."""
    cs = scheduler.connector.connector_scheduler
    assert not cs._reqs_need_recv
    assert not cs._heartbeat_by_engine and not cs._heartbeat_req_engine
    assert not cs._reqs_need_send and not cs._reqs_need_save
    assert not cs._reqs_in_batch and not cs._reqs_not_processed


def finish(scheduler: Any, request: Any, decode_steps: int = 2) -> Any:
    """Run a scheduled request through ``decode_steps`` tokens, the last one EOS."""
    eco = None
    for i in range(decode_steps):
        out, eco = step(scheduler, eos=i == decode_steps - 1)
        assert out.num_scheduled_tokens.get(request.request_id) == 1
    assert request.is_finished()
    return eco


def meta_of(out: Any) -> NixlConnectorMetadata:
    meta = out.kv_connector_metadata
    assert isinstance(meta, NixlConnectorMetadata)
    return meta


# ------------------------------------------------------------------------- (a) the upstream bug


def test_upstream_asserts_on_short_prompt_without_remote_blocks(
    make_nixl_scheduler: SchedulerFactory,
) -> None:
    """Documents the vLLM 0.32 defect this package fixes: vLLM's own NixlConnector asserts.

    ``get_num_new_matched_tokens`` reports the whole prompt as an async remote hit, then
    ``update_state_after_alloc`` finds no ``remote_block_ids`` and fails
    ``assert num_external_tokens == 0``; in an engine this takes the engine core down.
    """
    scheduler = make_nixl_scheduler("kv_consumer", module=None)
    assert type(scheduler.connector).__module__.startswith("vllm.")
    request = decode_request(SHORT, block_size=BLOCK_SIZE, remote_block_ids=[])
    scheduler.add_request(request)
    with pytest.raises(AssertionError) as excinfo:
        scheduler.schedule()
    last = traceback.extract_tb(excinfo.value.__traceback__)[-1]
    assert last.filename.endswith("kv_connector/v1/nixl/pull_scheduler.py")
    assert last.name == "update_state_after_alloc"
    assert last.line == "assert num_external_tokens == 0"


@pytest.mark.parametrize(
    "remote_block_ids",
    [[], [[]], None],
    ids=["empty-list", "empty-groups", "missing"],
)
@pytest.mark.parametrize("num_tokens", [SHORT, 1, 3 * BLOCK_SIZE + 5], ids=["short", "one-token", "multi-block"])
def test_remote_prefill_without_remote_blocks_is_computed_locally(
    make_nixl_scheduler: SchedulerFactory, remote_block_ids: Any, num_tokens: int
) -> None:
    scheduler = make_nixl_scheduler("kv_consumer")
    assert isinstance(scheduler.connector, NixlConnector)
    request = decode_request(num_tokens, block_size=BLOCK_SIZE, remote_block_ids=[])
    if remote_block_ids is None:
        del request.kv_transfer_params["remote_block_ids"]
    else:
        request.kv_transfer_params["remote_block_ids"] = remote_block_ids
    scheduler.add_request(request)
    # vLLM starts lease heartbeats on arrival; with nothing held on the prefill side, none.
    assert_connector_idle(scheduler)

    out, _ = step(scheduler)
    # The whole prompt is scheduled for local compute, now, with no async read.
    assert out.num_scheduled_tokens[request.request_id] == num_tokens
    assert request.status == RequestStatus.RUNNING
    assert request.request_id not in meta_of(out).reqs_to_recv
    assert request.kv_transfer_params["do_remote_prefill"] is False
    assert_connector_idle(scheduler)

    eco = finish(scheduler, request)
    assert request.get_finished_reason() == FinishReason.STOP
    # A decode instance returns no params (not bidirectional), so nothing is held for anyone.
    (output,) = eco[0].outputs
    assert output.kv_transfer_params is None
    assert_scheduler_empty(scheduler)
    assert_connector_idle(scheduler)


def test_bidirectional_decode_keeps_vllm_bookkeeping(make_nixl_scheduler: SchedulerFactory) -> None:
    """With ``bidirectional_kv_xfer`` a decode instance keeps a finished request's blocks for
    the prefill instance's turn-2 readback; that must hold for a locally computed prompt too,
    so the fix leaves ``do_remote_prefill`` for vLLM to clear (vLLM marks the request "in
    batch" for the worker, which then releases the blocks when the TTL passes)."""
    scheduler = make_nixl_scheduler("kv_consumer", bidirectional_kv_xfer=True)
    request = decode_request(SHORT, block_size=BLOCK_SIZE, remote_block_ids=[])
    rid = request.request_id
    scheduler.add_request(request)
    out, _ = step(scheduler)
    assert out.num_scheduled_tokens[rid] == SHORT
    assert rid in meta_of(out).reqs_in_batch
    assert rid not in meta_of(out).reqs_to_recv

    eco = finish(scheduler, request)
    (output,) = eco[0].outputs
    params = output.kv_transfer_params
    assert params is not None and params["do_remote_decode"] is True
    assert params["remote_blocks_expiry_time"] is not None
    step(scheduler, finished_sending={rid})
    assert_scheduler_empty(scheduler)


def test_upstream_parks_empty_group_request_on_a_read_of_nothing(
    make_nixl_scheduler: SchedulerFactory,
) -> None:
    """What vLLM does with ``[[]]`` (a prefill instance's reply when it holds no block): no
    assert, but it parks the request waiting for a read of zero remote blocks into its local
    ones. kvcompose computes such a request locally instead (test above)."""
    scheduler = make_nixl_scheduler("kv_consumer", module=None)
    request = decode_request(SHORT, block_size=BLOCK_SIZE, remote_block_ids=[[]])
    scheduler.add_request(request)
    out = scheduler.schedule()
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    queued = meta_of(out).reqs_to_recv[request.request_id]
    assert queued.remote is not None and list(queued.remote.block_ids) == [[]]
    assert any(queued.local_block_ids)


def test_abort_before_schedule_without_remote_blocks_leaves_nothing(
    make_nixl_scheduler: SchedulerFactory,
) -> None:
    """vLLM queues an empty read on abort so the worker tells the prefill instance to free its
    blocks (a handshake with it); with no remote blocks there is nothing to free."""
    ours = make_nixl_scheduler("kv_consumer")
    upstream = make_nixl_scheduler("kv_consumer", module=None)
    for scheduler in (ours, upstream):
        request = decode_request(SHORT, block_size=BLOCK_SIZE, remote_block_ids=[])
        scheduler.add_request(request)
        scheduler.finish_requests(request.request_id, RequestStatus.FINISHED_ABORTED)
        out = scheduler.schedule()
        queued = meta_of(out).reqs_to_recv
        if scheduler is upstream:
            assert request.request_id in queued  # a notification to a peer holding nothing
        else:
            assert not queued
            assert_connector_idle(scheduler)
        scheduler.update_from_output(out, model_runner_output([]))
        assert_scheduler_empty(scheduler)


# ----------------------------------------------------------------- (b), (c) reads still happen


@pytest.mark.parametrize(
    ("num_tokens", "remote_block_ids"),
    [
        (SHORT, [[7]]),  # (b) shorter than a block: its one partial block is pulled
        (4 * BLOCK_SIZE + 6, [[10, 11, 12, 13, 14]]),  # (c) 4 full blocks + a partial one
        (3 * BLOCK_SIZE, [20, 21, 22]),  # flat list, as routers and vLLM's tests send it
    ],
    ids=["short-partial-block", "multi-block", "flat-list"],
)
def test_remote_prefill_with_blocks_is_pulled(
    make_nixl_scheduler: SchedulerFactory, num_tokens: int, remote_block_ids: list[Any]
) -> None:
    scheduler = make_nixl_scheduler("kv_consumer")
    request = decode_request(num_tokens, block_size=BLOCK_SIZE, remote_block_ids=remote_block_ids)
    rid = request.request_id
    scheduler.add_request(request)
    cs = scheduler.connector.connector_scheduler
    assert rid in cs._heartbeat_req_engine  # the prefill instance's lease is kept alive

    # Step 1: the read is queued and the request parks; nothing is computed.
    out, _ = step(scheduler)
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert rid not in out.num_scheduled_tokens
    recv = meta_of(out).reqs_to_recv[rid]
    assert recv.remote is not None
    assert list(recv.remote.block_ids) == list(remote_block_ids)
    n_blocks = -(-num_tokens // BLOCK_SIZE)
    assert [len(g) for g in recv.local_block_ids] == [n_blocks]
    assert recv.awaiting_kvs

    # Step 2: the worker reports the read done.
    out, _ = step(scheduler, finished_recving={rid})
    assert rid not in cs._heartbeat_req_engine

    # Step 3: every prompt token but the last came from the prefill instance.
    out, _ = step(scheduler)
    assert out.num_scheduled_tokens[rid] == 1
    assert request.num_computed_tokens == num_tokens
    assert request.kv_transfer_params["do_remote_prefill"] is False

    finish(scheduler, request, decode_steps=1)
    assert_scheduler_empty(scheduler)
    assert_connector_idle(scheduler)


def test_has_remote_blocks_shapes() -> None:
    assert not has_remote_blocks(None)
    assert not has_remote_blocks([])
    assert not has_remote_blocks(())
    assert not has_remote_blocks([[]])
    assert not has_remote_blocks(([], []))
    assert has_remote_blocks([0])
    assert has_remote_blocks([[7]])
    assert has_remote_blocks(([], [3]))


# ------------------------------------------------------------------- (d) prefill side, options


def test_prefill_returns_params_with_side_channel_from_options(
    make_nixl_scheduler: SchedulerFactory,
) -> None:
    scheduler = make_nixl_scheduler(
        "kv_producer",
        kvcompose_side_channel_host="10.1.2.3",
        kvcompose_side_channel_port=6123,
        kvcompose_insecure_side_channel=True,  # keyless beyond loopback is refused otherwise
    )
    num_tokens = 2 * BLOCK_SIZE + 3
    request = prefill_request(num_tokens, block_size=BLOCK_SIZE)
    rid = request.request_id
    scheduler.add_request(request)

    out, eco = step(scheduler)
    assert out.num_scheduled_tokens[rid] == num_tokens
    assert request.get_finished_reason() == FinishReason.LENGTH
    (output,) = eco[0].outputs
    params = output.kv_transfer_params
    assert params is not None
    assert params["remote_host"] == "10.1.2.3"
    assert params["remote_port"] == 6123
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_engine_id"] == scheduler.connector.engine_id
    assert params["remote_request_id"] == rid
    assert [len(g) for g in params["remote_block_ids"]] == [3]
    assert params["transfer_mode"] == "pull"
    # The plugin declares every key vLLM returns (the scheduler itself adds the P-side cache
    # hit count for the decode side's usage report; that key is vLLM's, not NIXL's).
    assert set(params) - {"remote_prefill_cached_tokens"} <= PARAM_KEYS

    # The lease's end, in the scheduler's clock, for the decode side's late-read check.
    lease_end = scheduler.connector.connector_scheduler._reqs_need_send[rid]
    assert params["remote_blocks_expiry_time"] == lease_end
    assert 29 < lease_end - time.perf_counter() <= 30

    # Blocks stay held for the decode instance until it reports the read done.
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() < pool.num_gpu_blocks - 1
    # ... under a lease deadline that the next step hands to the worker.
    assert rid in scheduler.connector.connector_scheduler._reqs_need_send
    step(scheduler, finished_sending={rid})
    assert_scheduler_empty(scheduler)


def test_side_channel_port_keeps_data_parallel_offset(make_nixl_scheduler: SchedulerFactory) -> None:
    scheduler = make_nixl_scheduler("kv_producer", data_parallel_index=2, kvcompose_side_channel_port=6100)
    cs = scheduler.connector.connector_scheduler
    assert cs.side_channel_port == 6102


def test_side_channel_defaults_to_vllm_environment(make_nixl_scheduler: SchedulerFactory) -> None:
    from vllm import envs

    cs = make_nixl_scheduler("kv_producer").connector.connector_scheduler
    assert cs.side_channel_host == envs.VLLM_NIXL_SIDE_CHANNEL_HOST
    assert cs.side_channel_port == envs.VLLM_NIXL_SIDE_CHANNEL_PORT


def test_push_connector_uses_side_channel_options(make_nixl_scheduler: SchedulerFactory) -> None:
    """In push mode the decode instance sends its own side channel to the prefill instance."""
    scheduler = make_nixl_scheduler(
        "kv_consumer",
        connector="NixlPushConnector",
        kvcompose_side_channel_host="10.9.9.9",
        kvcompose_side_channel_port=7000,
        kvcompose_insecure_side_channel=True,  # keyless beyond loopback is refused otherwise
    )
    assert isinstance(scheduler.connector, NixlPushConnector)
    # Push mode never reads remote_block_ids on the decode side: empty is the normal case.
    request = decode_request(SHORT, block_size=BLOCK_SIZE, remote_block_ids=[])
    scheduler.add_request(request)
    out, _ = step(scheduler)
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    registration = meta_of(out).push_registrations[request.request_id]
    assert (registration["decode_host"], registration["decode_port"]) == ("10.9.9.9", 7000)


def test_classes_keep_vllms_class_names_and_base_classes() -> None:
    """vLLM resolves ``getattr(module, kv_connector)`` and checks names like "NixlConnector"."""
    import importlib

    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import connector as upstream

    module = importlib.import_module(OURS)
    assert module.NixlConnector.__name__ == "NixlConnector"
    assert module.NixlPushConnector.__name__ == "NixlPushConnector"
    assert issubclass(module.NixlConnector, upstream.NixlPullConnector)
    assert issubclass(module.NixlPushConnector, upstream.NixlPushConnector)
    assert module.NixlPullConnector is module.NixlConnector
