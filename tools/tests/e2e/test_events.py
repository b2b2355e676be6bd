"""KV events as a router receives them: vLLM's own ZMQ publisher, kvcompose's listener (no engine)."""

from __future__ import annotations

import time
from pathlib import Path

from kvcompose_tools.e2e.events import TOPIC, EventListener, kv_events_config


def test_the_config_is_vllms_and_binds_a_local_socket(tmp_path: Path) -> None:
    from vllm.config import KVEventsConfig
    from vllm.distributed.kv_events import ZmqEventPublisher

    config = KVEventsConfig(**kv_events_config(tmp_path / "decode.events"))
    assert config.enable_kv_cache_events and config.publisher == "zmq" and config.topic == TOPIC
    # vLLM's publisher binds this endpoint (it connects to a tcp:// one that is not a wildcard).
    assert ZmqEventPublisher._is_bind_endpoint(config.endpoint)


def test_the_listener_decodes_what_vllms_publisher_sends(tmp_path: Path) -> None:
    from vllm.distributed.kv_events import (
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        KVEventBatch,
        ZmqEventPublisher,
    )

    config = kv_events_config(tmp_path / "decode.events")
    publisher = ZmqEventPublisher(0, endpoint=config["endpoint"], topic=config["topic"])
    listener = EventListener(config["endpoint"])
    try:
        stored = BlockStored(
            block_hashes=[11, 12], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=2,
            lora_id=None, medium="CPU", lora_name=None,
        )  # fmt: skip
        batch = [stored, BlockRemoved(block_hashes=[12], medium="GPU"), AllBlocksCleared()]
        deadline = time.monotonic() + 10
        # A subscriber that joins misses what was sent before it connected: send until it hears.
        while not listener.events() and time.monotonic() < deadline:
            publisher.publish(KVEventBatch(ts=time.time(), events=batch))
            time.sleep(0.05)
        assert [(b.block_hash, b.medium, b.token_ids) for b in listener.stored()][:2] == [
            (11, "CPU", [1, 2]),
            (12, "CPU", [3, 4]),
        ]
        assert listener.removed("GPU") >= 1 and listener.removed("CPU") == 0 and listener.cleared() >= 1
    finally:
        listener.close()
        publisher.shutdown()
