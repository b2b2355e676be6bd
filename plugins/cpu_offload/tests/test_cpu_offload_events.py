"""A composed host tier's KV events as a router's indexer needs them: vLLM's real Scheduler with
the composite over a ``cpu-offload`` child, both halves (the kit's WorkerHarness), the engine's
KV events taken where vLLM's scheduler publishes them.

Every store of the host tier (medium ``CPU``) carries its block's token ids and its parent, each
after its parent's store, in eager and in lazy mode (vLLM's lazy mode publishes its stores
without either, children first: kvcompose/vllm/events.py); the tier's evictions are published
as removals (medium ``CPU``).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

from kvcompose.testing.harness import make_request
from kvcompose.testing.worker import WorkerHarness
from kvcompose.vllm.connector import KVComposeConnector

BLOCK = 16
PROMPT = 4 * BLOCK + 8
EVENTS = {"enable_kv_cache_events": True, "publisher": "null"}


def composed(lazy: bool, num_cpu_blocks: int | None = None, events: bool = True) -> WorkerHarness:
    size = f"num_cpu_blocks: {num_cpu_blocks}" if num_cpu_blocks else "cpu_bytes: 1MiB"
    yaml = f"""
version: 1
connectors:
  - name: host
    type: cpu-offload
    options: {{{size}, lazy: {str(lazy).lower()}}}
rules: {{load: first-wins, store: all, metadata: merge}}
"""
    return WorkerHarness.from_yaml(
        yaml, num_layers=2, num_blocks=12, block_size=BLOCK, kv_events_config=EVENTS if events else None
    )


class Published:
    """What vLLM's scheduler hands its publisher, batch by batch."""

    def __init__(self) -> None:
        self.batches: list[KVEventBatch] = []

    def publish(self, batch: KVEventBatch) -> None:
        self.batches.append(batch)

    def shutdown(self) -> None:
        pass

    def events(self) -> list[object]:
        return [e for b in self.batches for e in b.events]


@pytest.fixture(params=[False, True], ids=["eager", "lazy"])
def lazy(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


def prompt(seed: int) -> list[int]:
    return [3 + (seed * 131 + i * 17) % 500 for i in range(PROMPT)]


def run(h: WorkerHarness, seeds: Iterator[int] | list[int]) -> list[list[int]]:
    prompts = []
    for seed in seeds:
        req = make_request(prompt=prompt(seed), max_tokens=2, block_size=BLOCK, request_id=f"r{seed}")
        h.scheduler.add_request(req)
        h.step_until(lambda _, r=req: r.is_finished(), f"r{seed} did not finish", max_steps=20, write_blocks=True)
        h.drain(write_blocks=True)
        prompts.append(prompt(seed))
    return prompts


def published(h: WorkerHarness) -> Published:
    out = Published()
    h.scheduler.kv_event_publisher = out  # type: ignore[assignment]
    return out


def test_every_host_store_carries_its_tokens_and_follows_its_parent(lazy: bool) -> None:
    h = composed(lazy)
    try:
        pub = published(h)
        prompts = run(h, [0, 1, 2, 3])  # the three later prompts push the first out of the device
    finally:
        h.shutdown()
    events = pub.events()
    host = [e for e in events if isinstance(e, BlockStored) and e.medium == "CPU"]
    first = {tuple(prompts[0][k : k + BLOCK]) for k in range(0, 4 * BLOCK, BLOCK)}
    assert first <= {tuple(e.token_ids) for e in host}
    stored: set[object] = set()
    for batch in pub.batches:  # parents first within each step's batch, and across batches
        for e in batch.events:
            if isinstance(e, BlockStored) and e.medium == "CPU":
                assert len(e.token_ids) == BLOCK and e.block_size == BLOCK, e
                assert e.parent_block_hash is None or e.parent_block_hash in stored, e
                stored.update(e.block_hashes)
    assert any(isinstance(e, BlockRemoved) and e.medium == "GPU" for e in events)


def test_the_host_tiers_evictions_are_published_as_its_removals(lazy: bool) -> None:
    h = composed(lazy, num_cpu_blocks=6)
    try:
        pub = published(h)
        run(h, [0, 1, 2, 3])
    finally:
        h.shutdown()
    events = pub.events()
    host_stored = {h for e in events if isinstance(e, BlockStored) and e.medium == "CPU" for h in e.block_hashes}
    host_removed = [e for e in events if isinstance(e, BlockRemoved) and e.medium == "CPU"]
    assert host_removed, "a 6-block host tier stored 16 blocks and evicted none"
    assert {h for e in host_removed for h in e.block_hashes} <= host_stored


def test_without_kv_events_the_composite_keeps_no_anchors() -> None:
    h = composed(lazy=True, events=False)
    try:
        connector = h.scheduler.connector
        assert isinstance(connector, KVComposeConnector) and connector._anchors is None
    finally:
        h.shutdown()
