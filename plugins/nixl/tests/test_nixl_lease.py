"""A decode instance never computes from KV it read after the prefill's lease on it ended
(:mod:`kvcompose_nixl.lease`), with vLLM's own NIXL workers: over the kit's fake agent with a
link cut, and with a real prefill instance."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest
from vllm.v1.request import RequestStatus

from kvcompose.testing.harness import make_request, prefill_request
from kvcompose.testing.worker import WorkerHarness
from kvcompose_nixl import HANDSHAKE_TRY_S, LEASE_ANSWERS_KEY
from kvcompose_nixl.lease import ASK, HELLO, PREFIX, PROTOCOL, RELEASED
from kvcompose_nixl.patches import calm_progress_thread, set_ucx_error_handling
from kvcompose_nixl.testing.fake_nixl import PRODUCER, FakeNixl, nixl_worker
from kvcompose_nixl.testing.prefill_process import PrefillProcess
from kvcompose_nixl.testing.side_channel import LateListener, pulled
from kvcompose_tools.e2e.load import RELEASED_UNREAD

BLOCK = 32  # the CPU attention kernel's block size, which NIXL's worker checks
LEASE_S = 2
PREFILL_BLOCKS = 16


def composition(role: str, port: int, options: str = "", top: str = "") -> str:
    return f"""version: 1
{top}connectors:
  - name: pd
    type: nixl
    role: {role}
    options: {{side_channel_host: 127.0.0.1, side_channel_port: {port},
               progress_delay_us: 100, ucx_error_handling: none{options}}}
"""


#: heartbeats every step and each extends the lease to 4 s from when it is read: with the default
#: 2 s margin, beats sent in the lease's first 4 s would push a 6 s lease to 8 s if they counted
CUT_LEASE_S = 6
#: heartbeats every 2 s, each extending the lease to 8 s: a queued request keeps its blocks even
#: when a starved test process steps its engines seconds apart (a full suite beside engines)
QUEUED_LEASE_S = 12


def test_heartbeats_sent_while_the_link_is_cut_do_not_extend_the_lease(fake_nixl: FakeNixl) -> None:
    """The link is cut while the decode's read is in flight: the decode goes on sending
    heartbeats, none reaches the prefill, whose lease ends and frees the blocks. When the link is
    back the read completes; the heartbeats were sent, not received, so the read counts as
    failed, not done (an earlier LeaseWatch extended the lease by heartbeats sent and took it)."""
    options = f", lease_seconds: {CUT_LEASE_S}"
    p, d = fake_nixl.pair(
        composition("producer", 5801, options), composition("consumer", 5802, options, top="load_failure: recompute\n")
    )
    req = prefill_request(3 * BLOCK, block_size=BLOCK)
    p.scheduler.add_request(req)
    _, eco = p.engine_step()
    (out,) = [o for e in eco.values() for o in e.outputs]
    params = out.kv_transfer_params
    expires = params["remote_blocks_expiry_time"]  # one process: the scheduler's clock is ours
    dreq = make_request(3 * BLOCK, block_size=BLOCK, prompt=req.prompt_token_ids, kv_transfer_params=params)
    d.scheduler.add_request(dreq)
    fake_nixl.cut()
    d.engine_step()  # the read is posted and waits on the cut link
    released: set[str] = set()
    while time.perf_counter() < expires + 1.0:
        p.engine_step()
        released |= p.last_output.finished_sending or set()
        d.engine_step()
        assert not (d.last_output.finished_recving or d.last_output.failed_recving)
        time.sleep(0.1)
    assert released == {req.request_id}, "the prefill instance kept the blocks past its lease"
    consumer = nixl_worker(d).nixl_wrapper  # the fake agent
    assert any(msg.startswith(b"HB:") for _, msg in consumer.called("send_notif")), "no heartbeat was sent"
    fake_nixl.restore()
    d.engine_step()
    out = d.last_output
    assert out.failed_recving == {dreq.request_id} and len(out.invalid_block_ids) == 3  # recomputed, not used
    watch = d.child("pd").leases
    assert watch is not None and watch.late_reads == 1


def _queued_behind(d: Any, blocks: int) -> Any:
    """A local request on the decode that holds ``blocks`` of its KV cache and keeps generating."""
    local = make_request(blocks * BLOCK, block_size=BLOCK, prompt=prompt_of(9, blocks), max_tokens=10_000)
    d.scheduler.add_request(local)
    d.engine_step()
    return local


def _kv_notes(worker: Any) -> list[bytes]:
    return [msg for _, msg in worker.nixl_wrapper.called("send_notif") if msg.startswith(PREFIX)]


def test_a_read_queued_past_its_first_deadline_is_taken_when_the_prefill_answered_its_heartbeats(
    fake_nixl: FakeNixl, caplog: pytest.LogCaptureFixture
) -> None:
    """A burst in small: the decode has no room for the request, which waits (vLLM heartbeats
    it) past the lease's end the prefill stamped. The prefill answers the question after each
    beat with the time its lease now runs, so when room frees the read is taken, not refused (an
    earlier LeaseWatch refused it: no heartbeat moved the end it checked), and the prefill held
    the blocks until the read's own notification."""
    options = f", lease_seconds: {QUEUED_LEASE_S}"
    p, d = fake_nixl.pair(composition("producer", 5805, options), composition("consumer", 5806, options), num_blocks=16)
    req = prefill_request(3 * BLOCK, block_size=BLOCK)
    p.scheduler.add_request(req)
    _, eco = p.engine_step()
    (out,) = [o for e in eco.values() for o in e.outputs]
    params = out.kv_transfer_params
    assert params[LEASE_ANSWERS_KEY] == PROTOCOL
    expires = params["remote_blocks_expiry_time"]
    local = _queued_behind(d, 13)  # 15 usable blocks: 2 left, and the pull needs 3
    dreq = make_request(3 * BLOCK, block_size=BLOCK, prompt=req.prompt_token_ids, kv_transfer_params=params)
    d.scheduler.add_request(dreq)
    released: set[str] = set()
    with caplog.at_level(logging.INFO):
        while time.perf_counter() < expires + 2.0:
            d.engine_step()
            p.engine_step()
            released |= p.last_output.finished_sending or set()
            time.sleep(0.2)
        assert dreq.status == RequestStatus.WAITING_FOR_REMOTE_KVS or dreq.num_computed_tokens == 0
        assert not released, "the prefill released the blocks the decode's heartbeats renewed"
        d.scheduler.finish_requests(local.request_id, RequestStatus.FINISHED_ABORTED)
        recvd: set[str] = set()

        def read(_outs: object) -> bool:
            p.engine_step()
            released.update(p.last_output.finished_sending or ())
            out = d.last_output
            assert out is not None and not out.failed_recving, "the read was refused"
            recvd.update(out.finished_recving or ())
            return dreq.request_id in recvd

        d.step_until(read, "the read did not finish", timeout_s=10)
        # The decode took the read once the prefill answered that its notification found the
        # blocks held: the prefill freed them on that notification, before the decode's report.
        assert released == {req.request_id}, "the prefill kept the blocks"
    watch = d.child("pd").leases
    assert watch is not None and watch.late_reads == 0
    assert not [r for r in caplog.records if "Potentially invalid KV blocks" in r.getMessage()]
    notes = _kv_notes(nixl_worker(d))
    assert notes[0].startswith(HELLO) and sum(n.startswith(ASK) for n in notes) >= 3


def test_no_question_goes_to_a_prefill_with_vllms_own_connector(fake_nixl: FakeNixl) -> None:
    """vLLM's own NixlConnector stamps no lease and would take a question for a read of an
    unknown request: the decode, heartbeating a queued request, asks it nothing and takes the
    read as vLLM does."""
    p, d = fake_nixl.pair(PRODUCER, composition("consumer", 5808, f", lease_seconds: {CUT_LEASE_S}"), num_blocks=16)
    req = prefill_request(3 * BLOCK, block_size=BLOCK)
    p.scheduler.add_request(req)
    _, eco = p.engine_step()
    (out,) = [o for e in eco.values() for o in e.outputs]
    assert LEASE_ANSWERS_KEY not in out.kv_transfer_params
    local = _queued_behind(d, 13)
    dreq = make_request(
        3 * BLOCK, block_size=BLOCK, prompt=req.prompt_token_ids, kv_transfer_params=out.kv_transfer_params
    )
    d.scheduler.add_request(dreq)
    until = time.perf_counter() + 3.0
    while time.perf_counter() < until:
        d.engine_step()
        p.engine_step()
        time.sleep(0.2)
    d.scheduler.finish_requests(local.request_id, RequestStatus.FINISHED_ABORTED)
    d.step_until(lambda _o: dreq.request_id in (d.last_output.finished_recving or ()), "the read did not finish")
    consumer = nixl_worker(d)
    beats = [msg for _, msg in consumer.nixl_wrapper.called("send_notif") if msg.startswith(b"HB:")]
    assert len(beats) >= 2 and _kv_notes(consumer) == []


def test_a_request_aborted_before_its_read_is_logged_as_released_without_a_read(
    fake_nixl: FakeNixl, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM only notifies the prefill of a decode request aborted before its read; the prefill
    logs that notification as a read of released blocks when it comes after the lease (a cut
    link), so the decode's log names it as no read (what the soak and the link-cut drive match)."""
    p, d = fake_nixl.pair(composition("producer", 5803), composition("consumer", 5804))
    req = prefill_request(3 * BLOCK, block_size=BLOCK)
    p.scheduler.add_request(req)
    _, eco = p.engine_step()
    (out,) = [o for e in eco.values() for o in e.outputs]
    dreq = make_request(
        3 * BLOCK, block_size=BLOCK, prompt=req.prompt_token_ids, kv_transfer_params=out.kv_transfer_params
    )
    d.scheduler.add_request(dreq)
    d.scheduler.finish_requests(dreq.request_id, RequestStatus.FINISHED_ABORTED)
    with caplog.at_level(logging.INFO, logger="vllm.kvcompose.nixl"):
        d.engine_step()
    (line,) = [r.getMessage() for r in caplog.records if RELEASED in r.getMessage()]
    assert line == f"{RELEASED} {dreq.request_id} (prefill request {req.request_id})"
    assert RELEASED_UNREAD.findall(line) == [req.request_id]


def prompt_of(seed: int, blocks: int) -> list[int]:
    return [3 + (i * 37 + seed * 101) % 490 for i in range(blocks * BLOCK)]


@pytest.mark.engine
def test_a_read_that_ends_after_the_lease_is_recomputed_not_used() -> None:
    """The prefill instance's lease on request A's blocks ends while the decode's handshake is
    still unanswered (its side channel answers the first try 7 s late), the prefill gives the
    blocks to request B, and only then does the decode read them: it copies B's KV. The read
    counts as failed, vLLM's scheduler recomputes A's blocks (``load_failure: recompute``), and
    A's blocks end up holding A's KV, not B's."""
    pytest.importorskip("nixl")
    from kvcompose_tools.e2e.ports import free_ports

    p_port, d_port = free_ports(2)
    producer = composition("producer", p_port, f", lease_seconds: {LEASE_S}")
    with PrefillProcess(producer, block_size=BLOCK, num_blocks=PREFILL_BLOCKS) as prefill:
        late = LateListener([HANDSHAKE_TRY_S + 2, 0.0], upstream=("127.0.0.1", p_port))
        consumer = composition("consumer", d_port, ", handshake_tries: 3", top="load_failure: recompute\n")
        d = WorkerHarness.from_yaml(consumer, block_size=BLOCK, num_blocks=32)
        try:
            prompt = prompt_of(1, 3)
            done = prefill.prefill(prompt, "prefill-A")
            assert done.params["remote_blocks_expiry_time"] is not None  # the lease's end, stamped
            params: dict[str, Any] = {**done.params, "remote_port": late.port}
            d.scheduler.add_request(pulled(prompt, "A", params, BLOCK))
            d.engine_step(write_blocks=True)  # blocks allocated; the read waits for the handshake
            (ids,) = d.scheduler.kv_cache_manager.get_block_ids("A")
            reused: set[int] = set()
            failed: set[str] = set()
            invalid: set[int] = set()

            def settled(_outs: object) -> bool:
                if not reused and prefill.step().finished_sending:  # the lease ended: B takes the blocks
                    b = prefill.prefill(prompt_of(2, PREFILL_BLOCKS - 2), "prefill-B")
                    reused.update(set(b.block_ids) & set(done.block_ids))
                out = d.last_output
                assert out is not None
                failed.update(out.failed_recving or ())
                invalid.update(out.invalid_block_ids or ())
                return "A" in failed or "A" in (out.finished_recving or ())

            d.step_until(settled, "the load neither finished nor failed", timeout_s=90, write_blocks=True)
            assert reused, "the prefill instance did not give A's blocks to B"
            assert failed == {"A"} and invalid == set(ids)
            watch = d.child("pd").leases
            assert watch is not None and watch.late_reads == 1
            # What the read brought is B's KV: computing from it would have been silently wrong.
            full = range(len(prompt) // BLOCK)
            assert not all(d.holds_prefix(ids[k], prompt[: (k + 1) * BLOCK]) for k in full)
            request = d.scheduler.requests["A"]
            d.step_until(
                lambda _outs: request.num_computed_tokens >= len(prompt), "A not recomputed", write_blocks=True
            )
            (now,) = d.scheduler.kv_cache_manager.get_block_ids("A")
            assert all(d.holds_prefix(now[k], prompt[: (k + 1) * BLOCK]) for k in full)
        finally:
            d.shutdown()
            late.close()
            calm_progress_thread(0)  # the nixl child set these process-wide for its agent
            set_ucx_error_handling(None)


@pytest.mark.engine
def test_over_real_nixl_a_read_queued_past_its_first_deadline_is_taken_and_holds_its_kv() -> None:
    """As the fake-agent test above, between two processes with real NIXL agents: the decode's
    hello loads its address into the prefill's agent, the prefill's answers come back over NIXL,
    the queued read is taken after the stamped end and its blocks hold the prompt's KV."""
    pytest.importorskip("nixl")
    from kvcompose_tools.e2e.ports import free_ports

    p_port, d_port = free_ports(2)
    options = f", lease_seconds: {QUEUED_LEASE_S}"
    producer = composition("producer", p_port, options)
    with PrefillProcess(producer, block_size=BLOCK, num_blocks=PREFILL_BLOCKS) as prefill:
        d = WorkerHarness.from_yaml(composition("consumer", d_port, options), block_size=BLOCK, num_blocks=16)
        try:
            prompt = prompt_of(1, 3)
            done = prefill.prefill(prompt, "prefill-A")
            expires = done.params["remote_blocks_expiry_time"]  # perf_counter: one host, one monotonic clock
            local = _queued_behind(d, 13)
            d.scheduler.add_request(pulled(prompt, "A", done.params, BLOCK))
            released: set[str] = set()
            while time.perf_counter() < expires + 2.0:
                d.engine_step(write_blocks=True)
                released |= prefill.step().finished_sending
                time.sleep(0.2)
            assert not released, "the prefill released the blocks the decode's heartbeats renewed"
            d.scheduler.finish_requests(local.request_id, RequestStatus.FINISHED_ABORTED)

            def read(_outs: object) -> bool:
                released.update(prefill.step().finished_sending)  # it answers the read, frees the blocks
                out = d.last_output
                assert out is not None and not out.failed_recving, "the read was refused"
                return "A" in (out.finished_recving or ())

            d.step_until(read, "the read did not finish", timeout_s=30, write_blocks=True)
            watch = d.child("pd").leases
            assert watch is not None and watch.late_reads == 0 and watch.unheld_reads == 0
            assert released == {"prefill-A"}  # on the read's notification, held for it
            (ids,) = d.scheduler.kv_cache_manager.get_block_ids("A")
            assert all(d.holds_prefix(ids[k], prompt[: (k + 1) * BLOCK]) for k in range(len(prompt) // BLOCK))
        finally:
            d.shutdown()
            calm_progress_thread(0)  # the nixl child set these process-wide for its agent
            set_ucx_error_handling(None)
