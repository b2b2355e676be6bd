"""A composed decode's KV events, recorded from a real server and replayed into vllm-router's own
indexer (marker ``engine``).

One server of ``pd-decode.yaml`` with its host tier in lazy mode (``lazy: true``: blocks copied
out only as the device is about to evict them, the mode whose stores vLLM publishes without
token ids or parents) and a small device cache publishes its KV events through vLLM's publisher.
Prompt A is computed, then four others push A's blocks out of the device cache: the host tier
holds A alone. The recorded batches then go, as they were published, to a real vllm-router
(``kv_aware``, regular mode, :func:`kvcompose_tools.e2e.kv_replay.replay`): it must credit A's
prefix to this server, at the host tier's weight. Every host-tier store carries its block's
token ids and comes after its parent's store, and A's device blocks were removed.

``KVCOMPOSE_RECORD_KV_EVENTS=PATH`` writes the recording to PATH (the fast replay test's data,
``tools/tests/e2e/data/``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from kvcompose.examples import EXAMPLES
from kvcompose_tools.e2e.events import EventListener, kv_events_config
from kvcompose_tools.e2e.kv_replay import decode, replay, save_recording, without_stores
from kvcompose_tools.e2e.model import make_model
from kvcompose_tools.e2e.node import wait_all_ready
from kvcompose_tools.e2e.ports import free_ports
from kvcompose_tools.e2e.server import ServerNode
from kvcompose_tools.e2e.spec import BLOCK_SIZE, EngineSpec

pytestmark = pytest.mark.engine

#: Device blocks: 1,536 tokens, so that four more prompts of 10 blocks evict the first.
GPU_BLOCKS = 48
PROMPT_BLOCKS = 10


def prompt(seed: int) -> list[int]:
    """Token ids of ``PROMPT_BLOCKS`` full blocks and a partial one, different per seed."""
    return [5 + (seed * 7919 + i * 31) % 500 for i in range(PROMPT_BLOCKS * BLOCK_SIZE + 7)]  # vocab 512


def lazy_composition(tmp: Path) -> Path:
    text = (EXAMPLES / "pd-decode.yaml").read_text()
    assert "cpu_bytes: 256MiB\n" in text
    path = tmp / "pd-decode-lazy.yaml"
    path.write_text(text.replace("cpu_bytes: 256MiB\n", "cpu_bytes: 256MiB\n      lazy: true\n", 1))
    return path


def test_the_router_credits_a_prefix_that_only_the_lazy_host_tier_holds(tmp_path: Path) -> None:
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    config = kv_events_config(tmp_path / "decode.events")
    composition = str(lazy_composition(tmp_path))
    spec = EngineSpec(
        "decode", str(make_model(0)), composition, free_ports(1)[0], num_gpu_blocks=GPU_BLOCKS, kv_events=config
    )
    server = ServerNode(spec, tmp_path)
    listener = None
    try:
        wait_all_ready([server])
        listener = EventListener(config["endpoint"])
        time.sleep(1.0)  # the subscriber connects before the first batch
        prompts = [prompt(seed) for seed in range(5)]
        for p in prompts:
            server.generate([p], max_tokens=1)
        time.sleep(2.0)  # the last steps' stores are published
        payloads = listener.payloads()
    finally:
        if listener is not None:
            listener.close()
        server.close()

    events = [e for p in payloads for e in decode(p)]
    a_blocks = [tuple(prompts[0][k : k + BLOCK_SIZE]) for k in range(0, PROMPT_BLOCKS * BLOCK_SIZE, BLOCK_SIZE)]
    host = [e for e in events if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert host, "the host tier published no store"
    seen: set[object] = set()
    for e in events:  # each host store a block's token ids, its parent stored earlier (or a first block)
        if not isinstance(e, BlockStored):
            continue
        if e.medium == "CPU":
            assert len(e.token_ids) == BLOCK_SIZE * len(e.block_hashes), e
            assert e.parent_block_hash is None or e.parent_block_hash in seen, e
        seen.update(e.block_hashes)
    host_blocks = {tuple(e.token_ids[k : k + BLOCK_SIZE]) for e in host for k in range(0, len(e.token_ids), BLOCK_SIZE)}
    assert set(a_blocks) <= host_blocks
    removed = {h for e in events if isinstance(e, BlockRemoved) and e.medium == "GPU" for h in e.block_hashes}
    assert removed, "the device evicted nothing"

    path = os.environ.get("KVCOMPOSE_RECORD_KV_EVENTS")
    if path:
        about = {"composition": "pd-decode.yaml, host tier lazy", "gpu_blocks": GPU_BLOCKS, "block_size": BLOCK_SIZE}
        save_recording(Path(path), payloads, prompts[:1], **about)

    result = replay(payloads, [prompts[0]], tmp_path, block_size=BLOCK_SIZE, topic=config["topic"])
    (decision,) = result.decisions
    assert decision.worker == result.workers[0], result.log[-3000:]
    # The control: the same batches less the host tier's stores (a relay that lost them). The
    # router then credits what the device still holds and no more; with them, more.
    control = replay(
        without_stores(payloads, "CPU"), [prompts[0]], tmp_path, block_size=BLOCK_SIZE, topic=config["topic"]
    )
    device_held = device_prefix(events, a_blocks) * BLOCK_SIZE
    print(f"credited {decision.credited_prefix_tokens}, device alone {control.decisions[0].credited_prefix_tokens}, "
          f"A's prefix on the device {device_held} tokens")  # fmt: skip
    assert control.decisions[0].credited_prefix_tokens <= device_held, control.log[-3000:]
    assert decision.credited_prefix_tokens > control.decisions[0].credited_prefix_tokens, result.log[-3000:]


def device_prefix(events: list[object], blocks: list[tuple[int, ...]]) -> int:
    """How many of ``blocks`` (a prompt's, in order) the device holds from the start at the end of
    ``events``: stored on ``GPU`` and not removed since."""
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    held: dict[tuple[int, ...], object] = {}
    for e in events:
        if isinstance(e, BlockStored) and e.medium == "GPU":
            for i, h in enumerate(e.block_hashes):
                held[tuple(e.token_ids[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE])] = h
        elif isinstance(e, BlockRemoved) and e.medium == "GPU":
            gone = set(e.block_hashes)
            held = {tokens: h for tokens, h in held.items() if h not in gone}
        elif isinstance(e, AllBlocksCleared):
            held = {}
    n = 0
    while n < len(blocks) and blocks[n] in held:
        n += 1
    return n
