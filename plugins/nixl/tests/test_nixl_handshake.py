"""A decode worker asks a slow prefill instance's side channel again (``handshake_tries``).

The retry itself runs against real ZMQ sockets (a listener that answers late, or never); the
last test (marker ``engine``) puts a listener that answers its first request 7 s late in front
of a real prefill instance's side channel (:class:`~kvcompose.testing.prefill_process.PrefillProcess`)
and lets vLLM's own NIXL worker on the decode side read the prompt's KV through it.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from kvcompose.testing.harness import make_request
from kvcompose.testing.prefill_process import PrefillProcess
from kvcompose.testing.worker import WorkerHarness
from kvcompose_nixl import HANDSHAKE_TRY_S
from kvcompose_nixl.agent import calm_progress_thread, set_ucx_error_handling
from kvcompose_nixl.handshake import HandshakeTimeout, patient
from kvcompose_nixl.testing import LateListener

BLOCK = 32  # the CPU attention kernel's block size, which NIXL's worker checks
TRY_S = 1.0  # the unit tests' stand-in for vLLM's 5 s wait


@pytest.fixture
def listener(request: pytest.FixtureRequest) -> Iterator[LateListener]:
    late = LateListener(request.param)
    yield late
    late.close()


def ask(host: str, port: int, msg: bytes) -> bytes:
    """One request and one wait, as vLLM's ``_nixl_handshake`` does (ZMQ REQ, ``zmq.Again`` at the end)."""
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.RCVTIMEO, int(TRY_S * 1000))
        sock.connect(f"tcp://{host}:{port}")
        sock.send(msg)
        return bytes(sock.recv())
    finally:
        ctx.destroy(linger=0)


def test_vllm_asks_once_and_waits_the_time_the_plugin_quotes() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import NixlBaseConnectorWorker

    source = inspect.getsource(NixlBaseConnectorWorker._nixl_handshake)
    assert f"sock.setsockopt(zmq.RCVTIMEO, {HANDSHAKE_TRY_S * 1000})" in source
    # The wrapper is set on the worker instance: vLLM looks the method up at each new peer.
    assert "self._nixl_handshake," in inspect.getsource(NixlBaseConnectorWorker._ensure_handshake)


@pytest.mark.parametrize("listener", [[TRY_S + 1.0, 0.0]], indirect=True)
def test_a_late_side_channel_is_asked_again_and_its_answer_taken(
    listener: LateListener, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="kvcompose.nixl"):
        answer = patient(ask, tries=3, try_s=TRY_S)("127.0.0.1", listener.port, b"meta?")
    # The second try is answered at once; on a loaded host its connection may take a try more.
    assert answer == b"metadata:meta?" and listener.asked >= 2
    assert f"side channel at 127.0.0.1:{listener.port} did not answer in 1 s (try 1 of 3)" in caplog.messages[0]


@pytest.mark.parametrize("listener", [[None]], indirect=True)
def test_a_silent_side_channel_fails_after_the_last_try_saying_where_and_what_to_check(
    listener: LateListener, caplog: pytest.LogCaptureFixture
) -> None:
    start = time.monotonic()
    with pytest.raises(HandshakeTimeout) as err, caplog.at_level(logging.WARNING, logger="kvcompose.nixl"):
        patient(ask, tries=2, try_s=TRY_S)("127.0.0.1", listener.port, b"meta?")
    assert time.monotonic() - start >= 2 * TRY_S and len(caplog.messages) == 1 and "try 1 of 2" in caplog.messages[0]
    said = str(err.value)
    assert said.startswith(f"NIXL handshake: the side channel at 127.0.0.1:{listener.port} did not answer in 2 tries")
    assert "side_channel_port" in said and "handshake_tries" in said


def test_a_wrong_answer_is_not_asked_again() -> None:
    calls: list[str] = []

    def refused(host: str, port: int) -> bytes:
        calls.append(host)
        raise RuntimeError("NIXL compatibility hash mismatch")

    with pytest.raises(RuntimeError, match="hash mismatch"):
        patient(refused, tries=3)("10.0.0.9", 5600)
    assert calls == ["10.0.0.9"]
    with pytest.raises(ValueError, match="at least 1"):
        patient(refused, tries=0)


def composition(role: str, port: int, tries: int | None = None) -> str:
    option = "" if tries is None else f", handshake_tries: {tries}"
    return f"""version: 1
connectors:
  - name: pd
    type: nixl
    role: {role}
    options: {{side_channel_host: 127.0.0.1, side_channel_port: {port},
               progress_delay_us: 100, ucx_error_handling: none{option}}}
"""


@pytest.mark.engine
@pytest.mark.parametrize("tries", [None, 3])
def test_a_decode_worker_reads_through_a_side_channel_that_answers_7_s_late(tries: int | None) -> None:
    """vLLM's worker on the decode side, a real prefill instance behind a late side channel: with
    one try (vLLM's) the load fails and the request's blocks are reported invalid; with three a
    later try is answered (the second, unless the host is too busy) and every block arrives."""
    pytest.importorskip("nixl")
    from kvcompose.e2e.node import free_ports

    p_port, d_port = free_ports(2)
    with PrefillProcess(composition("producer", p_port), block_size=BLOCK, num_blocks=32) as prefill:
        late = LateListener([HANDSHAKE_TRY_S + 2, 0.0], upstream=("127.0.0.1", p_port))
        d = WorkerHarness.from_yaml(composition("consumer", d_port, tries), block_size=BLOCK, num_blocks=32)
        try:
            prompt = [3 + (i * 37) % 490 for i in range(3 * BLOCK)]
            done = prefill.prefill(prompt, "prefill-A")
            params: dict[str, Any] = {**done.params, "remote_port": late.port}
            d.scheduler.add_request(
                make_request(
                    len(prompt),
                    block_size=BLOCK,
                    prompt=prompt,
                    max_tokens=2,
                    request_id="A",
                    kv_transfer_params=params,
                )
            )
            d.engine_step()  # blocks allocated, the read waits for the handshake
            (ids,) = d.scheduler.kv_cache_manager.get_block_ids("A")
            failed: set[str] = set()
            invalid: set[int] = set()

            def settled(_outs: object) -> bool:
                out = d.last_output
                assert out is not None
                failed.update(out.failed_recving or ())
                invalid.update(out.invalid_block_ids or ())
                return "A" in (out.finished_recving or ()) or "A" in failed

            d.step_until(settled, "the load neither finished nor failed", timeout_s=60)
            if tries is None:
                assert late.asked == 1 and failed == {"A"} and invalid == set(ids)
            else:
                assert late.asked >= 2 and not failed and not invalid
                assert all(d.holds_prefix(ids[k], prompt[: (k + 1) * BLOCK]) for k in range(len(prompt) // BLOCK))
        finally:
            d.shutdown()
            late.close()
            calm_progress_thread(0)  # the nixl child set these process-wide for its agent
            set_ucx_error_handling(None)
