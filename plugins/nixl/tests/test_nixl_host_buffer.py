"""NIXL's host-buffer path (the TPU path) moving real bytes between two processes (marker ``engine``).

What is real: vLLM 0.32's NIXL worker and scheduler code on both sides with ``use_host_buffer``
on (host buffers allocated and registered by vLLM, ``save_kv_to_host`` on the prefill side's
save path, ``sync_recved_kv_to_device`` on the decode side once the read is done), vLLM's copy
op ``copy_kv_blocks`` handed over through the composed connector's ``set_host_xfer_buffer_ops``,
vLLM's ZMQ side-channel handshake, two real NIXL agents (UCX) in two processes, the cpu-offload
child's stores and loads, vLLM's scheduler on each side. What is simulated: the "device". Each
side's KV cache is host memory standing for accelerator memory, so the device <-> host copies
are host-to-host copies (the CUDA platform's block copies, which the CPU platform lacks), and
vLLM's platform is told it is a TPU in the three modules that decide the path
(:mod:`kvcompose_nixl.testing.host_buffer`, whose lines are pinned by ``test_nixl_kit_host_buffer.py``).

The prefill instance runs in a spawned process (:class:`~kvcompose_nixl.testing.prefill_process.PrefillProcess`);
the decode instance is a worker harness in the test process. The prefill forward is the kit's
stand-in writer: every block holds bytes derived from its token prefix and layer, so each block
the decode side ends up with is checked byte for byte, in its KV cache and in its host buffer.
The agents use the settings the project runs NIXL with on CPU hosts: a progress thread that
sleeps 100 us between polls and UCX error handling ``none``.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvcompose.testing import inspector
from kvcompose.testing.harness import assert_scheduler_empty, make_request
from kvcompose.testing.kv import fill_random
from kvcompose.testing.worker import WorkerHarness
from kvcompose_nixl.patches import calm_progress_thread, set_ucx_error_handling
from kvcompose_nixl.testing.host_buffer import host_buffer_setting
from kvcompose_nixl.testing.prefill_process import Prefilled, PrefillProcess
from kvcompose_nixl.testing.side_channel import pulled

pytestmark = pytest.mark.engine

BLOCK = 32  # the CPU attention kernel's block size, which NIXL's worker checks
NUM_BLOCKS = 32


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def nixl_child(role: str) -> str:
    return f"""
  - name: pd
    type: nixl
    role: {role}
    options: {{buffer_device: cpu, side_channel_host: 127.0.0.1, side_channel_port: {free_port()},
               progress_delay_us: 100, ucx_error_handling: none}}
"""


HOST = """
  - name: host
    type: cpu-offload
    options: {cpu_bytes: 4MiB}
"""


def composition(*children: str, load: str | None = None) -> str:
    rules = f"rules:\n  load: {load}\n" if load else ""
    return "version: 1\nconnectors:" + "".join(children) + rules


def tokens(n: int, seed: int) -> list[int]:
    return [3 + (i * 37 + seed * 101) % 490 for i in range(n)]


@pytest.fixture(scope="module")
def prefill() -> Iterator[PrefillProcess]:
    """The prefill instance: ``pd`` (NIXL producer, host buffer) and a host tier, in its own process."""
    pytest.importorskip("nixl")
    with PrefillProcess(
        composition(nixl_child("producer"), HOST), block_size=BLOCK, num_blocks=NUM_BLOCKS, host_buffer=True
    ) as p:
        yield p


@pytest.fixture
def decode_side() -> Iterator[Any]:
    """Factory for the decode instance's harness in this process (host-buffer path on)."""
    made: list[WorkerHarness] = []

    def make(source: str) -> WorkerHarness:
        h = WorkerHarness.from_yaml(source, block_size=BLOCK, num_blocks=NUM_BLOCKS, **host_buffer_setting())
        made.append(h)
        return h

    yield make
    for h in made:
        h.shutdown()
    calm_progress_thread(0)  # the nixl child set these process-wide for its agent
    set_ucx_error_handling(None)


def prefilled(p: PrefillProcess, prompt: list[int], request_id: str) -> Prefilled:
    """The prefill instance computes ``prompt`` and its save path stages every block in its host buffer."""
    done = p.prefill(prompt, request_id)
    full = len(prompt) // BLOCK
    assert done.device_ok == (True,) * full and done.host_buffer_ok == (True,) * full
    # save_kv_to_host: one device -> host copy of the request's blocks, through the op handed over.
    assert [(c.direction, c.blocks) for c in done.copies] == [("d2h", done.block_ids)]
    (remote,) = done.params["remote_block_ids"]
    assert tuple(remote) == done.block_ids
    return done


#: Prefill requests whose blocks the prefill instance freed while the decode read (its read answer).
RELEASED: set[str] = set()


def read(
    d: WorkerHarness, prompt: list[int], done: Prefilled, request_id: str, p: PrefillProcess
) -> tuple[list[int], int]:
    """The decode instance takes the proxy's request; engine steps until vLLM reports its load done,
    the prefill instance stepping beside it (it answers the read and frees the blocks, noted in
    :data:`RELEASED`). Returns the request's blocks and the bytes NIXL's worker reported moving."""
    d.scheduler.add_request(pulled(prompt, request_id, done.params, BLOCK))
    moved = 0

    def loaded(_outs: object) -> bool:
        nonlocal moved
        RELEASED.update(p.step().finished_sending)
        out = d.last_output
        if out is None:
            return False
        assert not out.failed_recving and not out.invalid_block_ids
        if out.kv_connector_stats is not None and "pd" in out.kv_connector_stats.data:
            moved += sum(out.kv_connector_stats.data["pd"].data["bytes_transferred"])
        return request_id in (out.finished_recving or ())

    d.step_until(loaded, f"{request_id}: no load", max_steps=20)
    (ids,) = d.scheduler.kv_cache_manager.get_block_ids(request_id)
    return list(ids), moved


def finish(d: WorkerHarness, p: PrefillProcess, prefill_id: str) -> None:
    """Both sides finish: the decode computes and drains (host-tier stores acknowledged), the
    prefill instance gets the read notification and frees the prompt's blocks."""
    d.step_until(lambda _: not d.scheduler.requests, "decode did not finish", eos=True)
    d.drain()
    assert_scheduler_empty(d.scheduler)
    stepped = p.step()
    RELEASED.update(stepped.finished_sending)
    assert prefill_id in RELEASED and stepped.requests == 0


def check_blocks(d: WorkerHarness, ids: list[int], prompt: list[int], blocks: range, *, host_buffer: bool) -> None:
    """Every byte of every layer of blocks ``blocks`` of a request is the prefill forward's."""
    for k in blocks:
        prefix = prompt[: (k + 1) * BLOCK]
        assert d.holds_prefix(ids[k], prefix), f"block {k} (id {ids[k]}) in the KV cache"
        if host_buffer:
            assert d.holds_prefix(ids[k], prefix, host_buffer=True), f"block {k} (id {ids[k]}) in the host buffer"


def test_prefill_to_decode_through_host_buffers_every_byte_then_the_host_tier_serves_it(
    prefill: PrefillProcess, decode_side: Any
) -> None:
    d = decode_side(composition(nixl_child("consumer"), HOST))
    # The copy op reached the NIXL child only, on both sides; vLLM's workers took the path.
    assert prefill.started.host_buffer_ops_to == ("pd",) and prefill.started.use_host_buffer
    assert d.host_buffer_ops_to == ["pd"]
    # The decode instance has served something before, so its blocks differ from the prefill's.
    d.scheduler.add_request(make_request(4 * BLOCK, block_size=BLOCK, prompt=tokens(4 * BLOCK, 9), max_tokens=1))
    d.engine_step(write_blocks=True, eos=True)
    d.drain()

    prompt = tokens(4 * BLOCK, 1)
    done = prefilled(prefill, prompt, "prefill-A")
    fill_random(d.kv, seed=3)  # nothing the decode side held before can pass for the prompt's KV
    before = d.kv.snapshot()
    ids, nixl_bytes = read(d, prompt, done, "decode-A", prefill)

    assert set(ids).isdisjoint(done.block_ids)
    # sync_recved_kv_to_device: one host -> device copy of exactly the request's blocks.
    assert [(c.direction, list(c.blocks)) for c in d.copy_op.copies] == [("h2d", ids)]
    moved = d.copy_op.nbytes("h2d")
    assert moved == nixl_bytes == sum(c.nbytes for c in done.copies) == 4 * 2 * d.kv_caches[d.layer_names[0]][0].nbytes
    check_blocks(d, ids, prompt, range(4), host_buffer=True)
    others = torch.tensor([b for b in range(NUM_BLOCKS) if b not in ids])
    for layer in d.layer_names:  # no other block of the KV cache changed
        assert torch.equal(d.kv_caches[layer][others].view(torch.int8), before[layer][others].view(torch.int8)), layer
    print(
        f"\nhost-buffer path: prefill d2h blocks {list(done.block_ids)} ({moved} B) -> NIXL READ {nixl_bytes} B "
        f"-> decode h2d blocks {ids} ({moved} B); every byte of {len(ids)} blocks x {len(d.layer_names)} layers "
        f"checked in the decode's KV cache and host buffer; copy op handed to: prefill "
        f"{list(prefill.started.host_buffer_ops_to or ())}, decode {d.host_buffer_ops_to} "
        f"(never to: {[n for n in d.connector.names if n not in d.host_buffer_ops_to]})"
    )
    finish(d, prefill, "prefill-A")

    # The host tier stored the blocks NIXL delivered; a repeated prompt is served from it.
    fill_random(d.kv, seed=4)
    assert d.scheduler.reset_prefix_cache()
    again = make_request(len(prompt), block_size=BLOCK, prompt=prompt, max_tokens=1, request_id="decode-A-again")
    d.scheduler.add_request(again)
    d.engine_step()
    assert inspector.loaders(d.scheduler.connector, again.request_id) == ("host",)
    d.step_until(lambda _: again.request_id in (d.last_output.finished_recving or ()), "no host-tier load")
    (ids,) = d.scheduler.kv_cache_manager.get_block_ids(again.request_id)
    check_blocks(d, list(ids), prompt, range(3), host_buffer=False)  # the 4th holds the last token: computed
    assert len(d.copy_op.copies) == 1  # no host-buffer copy: NIXL took no part
    print(f"repeated prompt: blocks {list(ids[:3])} loaded by the host tier, every byte checked")


def test_ranges_assemble_a_request_from_the_host_tier_and_nixl_through_host_buffers(
    prefill: PrefillProcess, decode_side: Any
) -> None:
    d = decode_side(composition(HOST, nixl_child("consumer"), load="ranges"))
    assert d.host_buffer_ops_to == ["pd"]
    turn1 = tokens(4 * BLOCK, 2)
    ids, _ = read(d, turn1, prefilled(prefill, turn1, "prefill-T1"), "decode-T1", prefill)
    check_blocks(d, ids, turn1, range(4), host_buffer=True)
    finish(d, prefill, "prefill-T1")  # the host tier stores turn 1 as NIXL delivered it

    fill_random(d.kv, seed=5)  # the traffic in between: device KV overwritten, prefix cache gone
    assert d.scheduler.reset_prefix_cache()
    copies = len(d.copy_op.copies)
    turn2 = turn1 + tokens(2 * BLOCK, 3)  # 6 blocks: 4 in the host tier, 2 new
    done = prefilled(prefill, turn2, "prefill-T2")
    ids, nixl_bytes = read(d, turn2, done, "decode-T2", prefill)
    assert inspector.loaders(d.scheduler.connector, "decode-T2") == ("host", "pd")
    # NIXL read the last two blocks only, through the host buffer, into the request's blocks 4 and 5.
    assert [(c.direction, list(c.blocks)) for c in d.copy_op.copies[copies:]] == [("h2d", ids[4:6])]
    assert nixl_bytes == d.copy_op.copies[-1].nbytes == 2 * 2 * d.kv_caches[d.layer_names[0]][0].nbytes
    check_blocks(d, ids, turn2, range(4), host_buffer=False)  # from the host tier
    check_blocks(d, ids, turn2, range(4, 6), host_buffer=True)  # over NIXL
    print(
        f"\nranges: blocks {ids[:4]} from the host tier, {ids[4:6]} over NIXL through the host buffer "
        f"({nixl_bytes} B), every byte of 6 blocks x {len(d.layer_names)} layers checked"
    )
    finish(d, prefill, "prefill-T2")
