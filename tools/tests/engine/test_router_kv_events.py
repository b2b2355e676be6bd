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
from kvcompose_tools.e2e.kv_replay import decode, replay, save_recording
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
    a_blocks = {tuple(prompts[0][k : k + BLOCK_SIZE]) for k in range(0, PROMPT_BLOCKS * BLOCK_SIZE, BLOCK_SIZE)}
    host = [e for e in events if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert host, "the host tier published no store"
    seen: set[object] = set()
    for e in host:  # each a block's token ids, its parent stored before it (or a first block)
        assert len(e.token_ids) == BLOCK_SIZE * len(e.block_hashes), e
        assert e.parent_block_hash is None or e.parent_block_hash in seen or _device_stored(events, e), e
        seen.update(e.block_hashes)
    assert a_blocks <= {tuple(e.token_ids) for e in host}
    removed = {h for e in events if isinstance(e, BlockRemoved) and e.medium == "GPU" for h in e.block_hashes}
    assert removed, "the device evicted nothing"

    path = os.environ.get("KVCOMPOSE_RECORD_KV_EVENTS")
    if path:
        about = {"composition": "pd-decode.yaml, host tier lazy", "gpu_blocks": GPU_BLOCKS, "block_size": BLOCK_SIZE}
        save_recording(Path(path), payloads, prompts[:1], **about)

    result = replay(payloads, [prompts[0]], tmp_path, block_size=BLOCK_SIZE, topic=config["topic"])
    (decision,) = result.decisions
    assert decision.worker == result.workers[0], result.log[-3000:]
    assert decision.credited_prefix_tokens > 0, result.log[-3000:]


def _device_stored(events: list[object], store: object) -> bool:
    from vllm.distributed.kv_events import BlockStored

    parent = getattr(store, "parent_block_hash", None)
    return any(isinstance(e, BlockStored) and e.medium == "GPU" and parent in e.block_hashes for e in events)
