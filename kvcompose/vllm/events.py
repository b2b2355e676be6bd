"""The children's KV cache events, completed so that a router's indexer can anchor each store.

A router that indexes vLLM's KV events (vllm-router's ``kv_aware``, llm-d's kv-cache, Dynamo's
KV router) re-hashes each ``BlockStored``'s ``token_ids`` itself and chains a block to the prefix
it extends through ``parent_block_hash``: a store without token ids is never matched, and one
whose parent it has not seen is dropped as unanchored. vLLM's own host tiers publish such stores:
``SimpleCPUOffloadScheduler`` in lazy mode captures no per-block metadata, so its stores carry no
token ids and no parent (``vllm/v1/simple_kv_offload/manager.py``, ``_prepare_lazy_store_specs``
returns no ``block_meta``; ``_process_store_completion`` then emits ``token_ids=[]``,
``parent_block_hash=None``), in the order of the device's free queue, children before parents;
the native offloading connector emits a placeholder (``block_size=0``, no token ids) for a block
whose metadata it did not see (``offloading/events.py``, ``_placeholder_stored``).

:class:`EventAnchors` keeps, for the blocks of the requests the engine scheduled, each block's
parent and where its token ids are, keyed by the block hash the events carry; the composite
(:mod:`kvcompose.vllm.connector`) records each request it is told of and completes every
child's events with :meth:`EventAnchors.complete` before vLLM's scheduler publishes them:

- a one-block store without token ids gets the block's token ids, its parent and the block size;
- within a step's events a store comes after the store of its parent (a parent stored in the
  same step is moved before its first child).

Nothing else changes: a store that carries its token ids already is left as it is, removals and
``AllBlocksCleared`` keep their places. The anchors are kept only where the engine publishes KV
events, for the most recent blocks (a bounded LRU, sized from the device's blocks: a host tier
stores what the device held).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

if TYPE_CHECKING:
    from vllm.v1.request import Request

#: Blocks remembered per device block (a block recorded at allocation and again at finish, a
#: prefix shared by many requests, a host tier storing what was freed a few steps earlier).
PER_DEVICE_BLOCK = 4


class EventAnchors:
    """Parents and token ids of recently scheduled blocks, by the hash their events carry.

    ``block_size``: tokens per hashed block (vLLM's ``hash_block_size``, the cache's block size);
    ``capacity``: blocks remembered, the least recently recorded forgotten first. A block's token
    ids are not copied: the entry points into the request's token list, which vLLM does not
    change before the request ends, and after that no longer grows.
    """

    def __init__(self, block_size: int, capacity: int) -> None:
        if block_size <= 0 or capacity <= 0:
            raise ValueError(f"block_size and capacity must be > 0, got {block_size} and {capacity}")
        self.block_size = block_size
        self.capacity = capacity
        #: hash -> (parent hash or None, the request's token list, first token's index)
        self._blocks: OrderedDict[Any, tuple[Any, Sequence[int], int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def record(self, request: Request) -> None:
        """Remember the request's full blocks (its ``block_hashes`` so far)."""
        hashes = request.block_hashes
        if not hashes:
            return
        blocks = self._blocks
        tokens = request.all_token_ids
        size = self.block_size
        parent = None
        for i, block_hash in enumerate(hashes):
            key = maybe_convert_block_hash(block_hash)
            if key in blocks:
                blocks.move_to_end(key)
            else:
                blocks[key] = (parent, tokens, i * size)
            parent = key
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)

    def anchor(self, block_hash: Any) -> tuple[Any, list[int]] | None:
        """The block's parent hash and token ids, if it was recorded."""
        found = self._blocks.get(block_hash)
        if found is None:
            return None
        parent, tokens, start = found
        ids = list(tokens[start : start + self.block_size])
        return (parent, ids) if len(ids) == self.block_size else None

    def complete(self, events: Iterable[KVCacheEvent]) -> list[KVCacheEvent]:
        """``events`` with every one-block store that lacks token ids completed from the recorded
        blocks, and each store after the store of its parent (see the module's docstring)."""
        out = [self._completed(e) if isinstance(e, BlockStored) and not e.token_ids else e for e in events]
        return _parents_first(out)

    def _completed(self, event: BlockStored) -> BlockStored:
        if len(event.block_hashes) != 1 or event.block_size not in (0, self.block_size):
            return event
        found = self.anchor(event.block_hashes[0])
        if found is None:
            return event
        parent, ids = found
        event.token_ids = ids
        event.block_size = self.block_size
        if event.parent_block_hash is None:
            event.parent_block_hash = parent
        return event


def _parents_first(events: list[KVCacheEvent]) -> list[KVCacheEvent]:
    """The events, each store moved after the store (in these events) of its parent; others keep
    their order. Most steps' stores are in order already: then the list is returned as it is."""
    first: dict[Any, int] = {}  # hash -> the first store of it
    for i, e in enumerate(events):
        if isinstance(e, BlockStored):
            for h in e.block_hashes:
                first.setdefault(h, i)

    def parent_of(i: int) -> int | None:
        e = events[i]
        if not isinstance(e, BlockStored) or e.parent_block_hash is None:
            return None
        j = first.get(e.parent_block_hash)
        return None if j is None or j == i else j

    if all((j := parent_of(i)) is None or j < i for i in range(len(events))):
        return events
    done: set[int] = set()
    out: list[KVCacheEvent] = []
    for i in range(len(events)):
        chain = []  # i, then its parents not emitted yet, nearest first
        j: int | None = i
        while j is not None and j not in done and j not in chain:
            chain.append(j)
            j = parent_of(j)
        for k in reversed(chain):
            done.add(k)
            out.append(events[k])
    return out
