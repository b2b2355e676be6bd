"""The children's KV events completed for a router's indexer (kvcompose/vllm/events.py), on
vLLM's own event types and requests (no scheduler, no engine)."""

from __future__ import annotations

import pytest
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from kvcompose.testing.harness import make_request
from kvcompose.vllm.events import EventAnchors

BS = 16


def anonymous(h: object, medium: str = "CPU", block_size: int = BS) -> BlockStored:
    """A host tier's store as vLLM's lazy SimpleCPUOffload publishes it: no token ids, no parent."""
    return BlockStored(
        block_hashes=[h], parent_block_hash=None, token_ids=[], block_size=block_size,
        lora_id=None, medium=medium, lora_name=None, locality="LOCAL",
    )  # fmt: skip


def recorded(blocks: int = 4) -> tuple[EventAnchors, list[object], list[int]]:
    req = make_request(prompt=[3 + (i * 37) % 900 for i in range(blocks * BS + 5)], block_size=BS)
    anchors = EventAnchors(BS, 100)
    anchors.record(req)
    return anchors, [maybe_convert_block_hash(h) for h in req.block_hashes], list(req.all_token_ids)


def test_a_store_without_token_ids_gets_its_blocks_tokens_and_parent() -> None:
    anchors, hashes, tokens = recorded()
    assert len(hashes) == 4 and len(anchors) == 4
    out = anchors.complete([anonymous(h) for h in hashes])
    assert [e.block_hashes for e in out] == [[h] for h in hashes]
    assert [e.token_ids for e in out] == [tokens[i * BS : (i + 1) * BS] for i in range(4)]
    assert [e.parent_block_hash for e in out] == [None, *hashes[:3]]
    assert all(e.block_size == BS and e.medium == "CPU" and e.locality == "LOCAL" for e in out)


def test_children_published_before_their_parents_come_after_them() -> None:
    """vLLM's lazy store walks the device's free queue, tail blocks first."""
    anchors, hashes, _ = recorded()
    removed = BlockRemoved(block_hashes=[hashes[3]], medium="GPU")
    out = anchors.complete([removed, *(anonymous(h) for h in reversed(hashes)), AllBlocksCleared()])
    assert out[0] is removed and isinstance(out[-1], AllBlocksCleared)
    assert [e.block_hashes[0] for e in out[1:-1]] == hashes


def test_a_long_chain_in_reverse_is_ordered_without_recursion() -> None:
    n = 3000
    chain = [
        BlockStored(block_hashes=[i], parent_block_hash=i - 1 if i else None, token_ids=[i] * BS, block_size=BS,
                    lora_id=None, medium="CPU", lora_name=None)
        for i in range(n)
    ]  # fmt: skip
    out = EventAnchors(BS, 10).complete(list(reversed(chain)))
    assert [e.block_hashes[0] for e in out] == list(range(n))


def test_what_is_complete_or_unknown_is_left_as_it_is() -> None:
    anchors, hashes, tokens = recorded(2)
    device = BlockStored(
        block_hashes=hashes, parent_block_hash=None, token_ids=tokens[: 2 * BS], block_size=BS,
        lora_id=None, medium="GPU", lora_name=None,
    )  # fmt: skip
    unknown = anonymous(12345)
    other_size = anonymous(hashes[0], block_size=2 * BS)  # a group of another block size
    events = [device, unknown, other_size]
    out = anchors.complete(events)
    assert out == events and out[0] is device
    assert unknown.token_ids == [] and other_size.token_ids == []


def test_a_placeholder_store_of_block_size_0_is_completed() -> None:
    """vLLM's native offloading connector publishes one for a block it saw no metadata of."""
    anchors, hashes, tokens = recorded(2)
    (out,) = anchors.complete([anonymous(hashes[1], block_size=0)])
    assert out.token_ids == tokens[BS : 2 * BS] and out.block_size == BS and out.parent_block_hash == hashes[0]


def test_the_least_recently_recorded_blocks_are_forgotten_first() -> None:
    anchors = EventAnchors(BS, 3)
    first = make_request(prompt=list(range(3, 3 + 2 * BS)), block_size=BS)
    second = make_request(prompt=list(range(500, 500 + 2 * BS)), block_size=BS)
    anchors.record(first)
    anchors.record(second)
    assert len(anchors) == 3
    assert anchors.anchor(maybe_convert_block_hash(first.block_hashes[0])) is None
    assert anchors.anchor(maybe_convert_block_hash(second.block_hashes[1])) is not None


def test_sizes_must_be_positive() -> None:
    with pytest.raises(ValueError, match="must be > 0"):
        EventAnchors(0, 1)
