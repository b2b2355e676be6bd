"""A prefill's params are read once, by one decode, while the prefill still holds their blocks
(issue 60, :mod:`kvcompose_nixl.lease`): one prefill and two decodes over the kit's fake agent,
with vLLM's own NIXL workers and schedulers. NIXL's READ is one-sided, so the prefill cannot
refuse a read; it answers each read's notification (held or not) and the decode takes only a
read answered held. vLLM's own decode is the control: it takes a read of reused blocks."""

from __future__ import annotations

from typing import Any

import pytest
from vllm.v1.request import RequestStatus

from kvcompose.testing.harness import make_request, prefill_request
from kvcompose.testing.worker import WorkerHarness
from kvcompose_nixl.testing.fake_nixl import FakeNixl

BLOCK = 32
#: Usable prefill blocks: G takes 3, and four other prompts of 3 blocks reuse all of them.
PREFILL_BLOCKS = 10


def composition(role: str, port: int, top: str = "load_failure: recompute\n") -> str:
    return f"""version: 1
{top}connectors:
  - name: pd
    type: nixl
    role: {role}
    options: {{side_channel_host: 127.0.0.1, side_channel_port: {port}}}
"""


#: vLLM's own NixlConnector on a decode (the control), with vLLM's kv_load_failure_policy recompute.
VLLMS_DECODE = {
    "kv_connector": "NixlConnector",
    "kv_role": "kv_consumer",
    "engine_id": "vllm-decode",
    "kv_load_failure_policy": "recompute",
}


def prompt_of(seed: int, blocks: int = 3) -> list[int]:
    return [3 + (i * 37 + seed * 101) % 490 for i in range(blocks * BLOCK)]


def prefilled(p: WorkerHarness, prompt: list[int]) -> tuple[Any, dict[str, Any]]:
    req = prefill_request(len(prompt), block_size=BLOCK, prompt=prompt)
    p.scheduler.add_request(req)
    _, eco = p.engine_step(write_blocks=True)
    (params,) = [o.kv_transfer_params for e in eco.values() for o in e.outputs if o.kv_transfer_params]
    return req, dict(params)


def read(d: WorkerHarness, p: WorkerHarness, prompt: list[int], params: dict[str, Any]) -> tuple[Any, bool]:
    """``prompt`` with ``params`` on the decode ``d`` (the prefill ``p`` stepping beside it) until its
    load is reported: the request, and whether the load failed."""
    req = make_request(len(prompt), block_size=BLOCK, prompt=prompt, max_tokens=2, kv_transfer_params=params)
    d.scheduler.add_request(req)
    failed = False

    def reported(_o: object) -> bool:
        nonlocal failed
        p.engine_step(write_blocks=True)
        out = d.last_output
        if out is None:
            return False
        failed = failed or req.request_id in (out.failed_recving or ())
        return req.request_id in (out.finished_recving or ())

    d.step_until(reported, f"{req.request_id}: no load reported", max_steps=40)
    return req, failed


def holds(d: WorkerHarness, req: Any, prompt: list[int]) -> bool:
    """Whether the decode's blocks of ``req`` hold the KV of ``prompt``, block by block."""
    (ids,) = d.scheduler.kv_cache_manager.get_block_ids(req.request_id)
    return all(d.holds_prefix(b, prompt[: (k + 1) * BLOCK]) for k, b in enumerate(ids))


def reuse_the_prefills_blocks(p: WorkerHarness) -> None:
    """Four other prompts through the prefill, each read by nobody and released: every block of
    the prefill's cache is written again (the prefix cache reset first, so none is reused as is)."""
    for seed in range(4):
        req = prefill_request(3 * BLOCK, block_size=BLOCK, prompt=prompt_of(50 + seed))
        p.scheduler.add_request(req)
        p.engine_step(write_blocks=True)
        p.scheduler.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
        p.engine_step()


@pytest.mark.parametrize("second", ["kvcompose", "vllm"])
def test_a_second_decode_does_not_take_blocks_the_prefill_freed_and_reused(fake_nixl: FakeNixl, second: str) -> None:
    """Issue 60's second hole: decode 1 reads G (the prefill frees G's blocks on its
    notification), the prefill reuses them for other prompts, then G's params go to decode 2.
    kvcompose's decode 2 reads, is answered "not held", and computes G here; vLLM's own takes the
    read, and its blocks hold another prompt's KV."""
    p, d1 = fake_nixl.pair(composition("producer", 5901), composition("consumer", 5902), num_blocks=PREFILL_BLOCKS + 1)
    d2 = fake_nixl.consumer(composition("consumer", 5903) if second == "kvcompose" else VLLMS_DECODE, p)
    g = prompt_of(1)
    _, params = prefilled(p, g)
    first, failed = read(d1, p, g, dict(params))
    assert not failed and holds(d1, first, g)
    reuse_the_prefills_blocks(p)
    again, failed = read(d2, p, g, dict(params))
    if second == "kvcompose":
        assert failed, "decode 2 took a read of blocks the prefill had freed"
        assert d2.child("pd").leases.unheld_reads == 1
        d2.step_until(lambda _o: again.num_computed_tokens >= len(g), "G was not computed on decode 2", eos=True)
    else:
        assert not failed and not holds(d2, again, g)  # vLLM's own: another prompt's KV, taken


def test_two_decodes_reading_the_same_params_at_once_only_one_takes_them(fake_nixl: FakeNixl) -> None:
    """A replay to a second decode while the first still reads: both reads find the blocks held,
    the first notification frees them, and only its decode takes the read."""
    p, d1 = fake_nixl.pair(composition("producer", 5911), composition("consumer", 5912), num_blocks=PREFILL_BLOCKS + 1)
    d2 = fake_nixl.consumer(composition("consumer", 5913), p)
    g = prompt_of(2)
    preq, params = prefilled(p, g)
    reqs = []
    for d in (d1, d2):
        req = make_request(len(g), block_size=BLOCK, prompt=g, max_tokens=2, kv_transfer_params=dict(params))
        d.scheduler.add_request(req)
        d.engine_step()  # both reads done before the prefill polls its notifications
        reqs.append(req)
    outcomes: dict[int, str] = {}
    for _ in range(10):
        p.engine_step()
        for i, (d, req) in enumerate(zip((d1, d2), reqs, strict=True)):
            d.engine_step()
            out = d.last_output
            if out is None:
                continue
            if req.request_id in (out.failed_recving or ()):
                outcomes[i] = "failed"
            elif req.request_id in (out.finished_recving or ()):
                outcomes.setdefault(i, "taken")
        if len(outcomes) == 2:
            break
    assert outcomes == {0: "taken", 1: "failed"}
    assert holds(d1, reqs[0], g)
    assert p.scheduler.kv_cache_manager.usage == 0 or preq.request_id not in p.scheduler.requests
