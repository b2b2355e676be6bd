"""The KV-events relay (kvcompose/relay.py): 32-token blocks told as 16-token ones, over real
ZMQ sockets, and what it does with frames that are not vLLM's batches."""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

from kvcompose.relay import DeviceBlocks, Relay, part_hash, split_events


def store(hashes: list[int], parent: int | None, tokens: list[int], size: int = 32, medium: str = "GPU") -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=size,
                       lora_id=None, medium=medium, lora_name=None)  # fmt: skip


TOKENS = list(range(100, 164))  # two 32-token blocks


def test_a_store_of_two_32_token_blocks_becomes_four_16_token_blocks_chained_to_the_same_parent() -> None:
    (out,) = split_events([store([11, 12], 10, TOKENS, medium="CPU")], 16, 32)
    assert out.block_size == 16 and out.token_ids == TOKENS and out.medium == "CPU"
    assert out.parent_block_hash == 10  # the parent block's last part keeps its own hash
    assert out.block_hashes == [part_hash(11, 0, 2), 11, part_hash(12, 0, 2), 12]
    assert len(set(out.block_hashes)) == 4 and all(0 <= h < 2**63 for h in out.block_hashes)


def test_a_removal_names_every_part_and_other_events_pass_as_they_are() -> None:
    removed, cleared = split_events([BlockRemoved(block_hashes=[11], medium="GPU"), AllBlocksCleared()], 16, 32)
    assert removed.block_hashes == [part_hash(11, 0, 2), 11] and removed.medium == "GPU"
    assert isinstance(cleared, AllBlocksCleared)


def test_bytes_hashes_stay_bytes_and_blocks_of_the_routers_size_are_untouched() -> None:
    (out,) = split_events([store([b"\x01" * 32], None, TOKENS[:32])], 16, 32)
    assert all(isinstance(h, bytes) for h in out.block_hashes) and out.block_hashes[1] == b"\x01" * 32
    same = store([5], None, TOKENS[:16], size=16)
    assert split_events([same], 16, 32) == [same]


def test_a_block_size_that_is_not_a_multiple_is_refused() -> None:
    with pytest.raises(ValueError, match="48-token blocks cannot be told in 32-token blocks"):
        split_events([store([1], None, list(range(48)), size=48)], 32, 32)
    with pytest.raises(ValueError, match="24-token blocks"):
        Relay("ipc:///nonexistent", "tcp://127.0.0.1:1", engine_block_size=24)


def test_the_relay_republishes_batches_split_and_drops_an_attackers_frames(tmp_path) -> None:
    ctx = zmq.Context.instance()
    engine = ctx.socket(zmq.PUB)
    source = f"ipc://{tmp_path}/engine.events"
    engine.bind(source)
    port = _free_port()
    relay = Relay(source, f"tcp://127.0.0.1:{port}", engine_block_size=32)
    router = ctx.socket(zmq.SUB)
    router.setsockopt(zmq.SUBSCRIBE, b"")
    router.setsockopt(zmq.RCVTIMEO, 200)
    router.connect(relay.target)
    good = msgspec.msgpack.encode(KVEventBatch(ts=1.0, events=[store([11, 12], None, TOKENS)]))
    received: list[list[bytes]] = []
    try:
        deadline = time.monotonic() + 20
        while not received and time.monotonic() < deadline:  # until both subscriptions are up
            engine.send_multipart([b"", (7).to_bytes(8, "big"), b"\xc1 not msgpack"])
            engine.send_multipart([b"only one frame"])
            engine.send_multipart([b"", (8).to_bytes(8, "big"), good])
            try:
                received.append(router.recv_multipart())
            except zmq.Again:
                pass
    finally:
        router.close(linger=0)
        relay.close()
        engine.close(linger=0)
    assert received, "nothing came through the relay"
    topic, seq, payload = received[0]
    assert (topic, seq) == (b"", (8).to_bytes(8, "big"))  # the frames' topic and sequence kept
    (event,) = msgspec.msgpack.Decoder(type=KVEventBatch).decode(payload).events
    assert event.block_size == 16 and len(event.block_hashes) == 4
    assert relay.dropped >= 2 and relay.relayed >= 1  # the bad frames dropped, the relay alive


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_device_reset_is_told_as_the_removal_of_the_device_blocks_held() -> None:
    device = DeviceBlocks()
    events = [
        store([1, 2], None, TOKENS),
        store([3], 2, TOKENS[:32], medium="CPU"),
        BlockRemoved(block_hashes=[1], medium="GPU"),
        AllBlocksCleared(),
        AllBlocksCleared(),  # nothing held any more: nothing to say
    ]
    out = device.follow(events)
    assert out[:3] == events[:3]
    (removal,) = out[3:]
    assert isinstance(removal, BlockRemoved) and removal.medium == "GPU" and removal.block_hashes == [2]
    assert len(device) == 0
