"""KV events in the block size a router indexes: a relay between vLLM's publisher and vllm-router.

vllm-router 0.1.17's P/D ``kv_aware`` policy (``--pd-kv-events``) indexes 16-token blocks only:
a batch with a store of any other ``block_size`` is rejected whole (its log: ``kv_index dense
batch rejected ... reason=BlockSizeMismatch``), whatever ``--kv-event-block-size`` says. vLLM's
CPU attention takes only multiples of 32 tokens a block, so a CPU prefill's events never reach
the router's index. The router hashes each store's ``token_ids`` itself (sha256 a block) and
uses the engine's hashes only to chain parents and to remove, so a block of ``n`` x 16 tokens can
be told as ``n`` stores of 16: :func:`split_events` does that, and :class:`Relay` does it to
every batch between an engine's publisher and the router (``kvcompose relay-events``).

The last part of each block keeps the engine's hash, so that a child's ``parent_block_hash`` and
a removal still name it; the parts before it get hashes derived from it (:func:`part_hash`).
Frames keep vLLM's shape (``[topic, seq, msgpack KVEventBatch]``) and their sequence numbers.

A device prefix-cache reset is published as ``AllBlocksCleared``, which names no medium, and
vllm-router 0.1.17 drops every entry of the worker on it, the host tier's too, though the host
tier still holds them. The relay tells it instead as the removal of every device block it has
seen stored and not removed (:class:`DeviceBlocks`): the host tier's entries stay credited.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Iterable
from typing import Any

log = logging.getLogger("kvcompose.relay")

#: The block size vllm-router 0.1.17's P/D ``kv_aware`` indexes (its ``--pd-kv-events`` help:
#: "Block size is 16").
ROUTER_BLOCK_SIZE = 16


def part_hash(block_hash: Any, part: int, parts: int) -> Any:
    """The hash of part ``part`` of ``parts`` of a block: the block's own for the last part, else
    one derived from it, of the same type (vLLM publishes 64-bit ints, or bytes)."""
    if part == parts - 1:
        return block_hash
    digest = hashlib.blake2b(repr((block_hash, part)).encode(), digest_size=8).digest()
    if isinstance(block_hash, bytes):
        return digest
    return int.from_bytes(digest, "big") >> 1  # 63 bits: msgpack's int and the router's u64 both take it


def parts_of(block_hashes: Iterable[Any], parts: int) -> list[Any]:
    """The hashes of every part of each block, in order (:func:`part_hash`)."""
    return [part_hash(h, p, parts) for h in block_hashes for p in range(parts)]


def split_events(events: Iterable[Any], block_size: int, engine_block_size: int) -> list[Any]:
    """``events`` (vLLM's ``KVCacheEvent`` structs) with every store and removal of the engine's
    ``engine_block_size``-token blocks told in blocks of ``block_size`` tokens (a removal names no
    size: it is taken to be of the engine's blocks); other events as they are. A store of a
    block size that is not a multiple of ``block_size`` is a :class:`ValueError`."""
    import msgspec
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    out: list[Any] = []
    for e in events:
        if isinstance(e, BlockStored) and e.block_size != block_size:
            if e.block_size % block_size:
                raise ValueError(f"a store of {e.block_size}-token blocks cannot be told in {block_size}-token blocks")
            parts = e.block_size // block_size
            hashes = parts_of(e.block_hashes, parts)
            extra = None if e.extra_keys is None else [k for k in e.extra_keys for _ in range(parts)]
            out.append(msgspec.structs.replace(e, block_hashes=hashes, block_size=block_size, extra_keys=extra))
        elif isinstance(e, BlockRemoved) and engine_block_size != block_size:
            hashes = parts_of(e.block_hashes, engine_block_size // block_size)
            out.append(msgspec.structs.replace(e, block_hashes=hashes))
        else:
            out.append(e)
    return out


#: The media of vLLM's device cache (a store without one is the device's, as the router reads it).
DEVICE_MEDIA = ("GPU", None)


class DeviceBlocks:
    """The device blocks an engine's events say it holds (stored, not removed), so that a reset
    (``AllBlocksCleared``) can be told as their removal; other tiers' blocks are not touched."""

    def __init__(self) -> None:
        self._held: dict[Any, None] = {}  # insertion-ordered: removals come out in store order

    def __len__(self) -> int:
        return len(self._held)

    def follow(self, events: list[Any]) -> list[Any]:
        """``events`` with each ``AllBlocksCleared`` replaced by a device ``BlockRemoved`` of
        every block held (nothing when none is), following the stores and removals before it."""
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

        out: list[Any] = []
        for e in events:
            if isinstance(e, BlockStored) and e.medium in DEVICE_MEDIA:
                self._held.update(dict.fromkeys(e.block_hashes))
            elif isinstance(e, BlockRemoved) and e.medium in DEVICE_MEDIA:
                for h in e.block_hashes:
                    self._held.pop(h, None)
            elif isinstance(e, AllBlocksCleared):
                if self._held:
                    out.append(BlockRemoved(block_hashes=list(self._held), medium="GPU"))
                self._held.clear()
                continue
            out.append(e)
        return out


def _check_endpoint(what: str, endpoint: str) -> None:
    """A ZMQ endpoint the relay takes: ``ipc://PATH`` or ``tcp://HOST:PORT`` (zmq itself takes a
    port out of range and listens nowhere)."""
    if endpoint.startswith("ipc://") and len(endpoint) > len("ipc://"):
        return
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    if endpoint.startswith("tcp://") and host and port.isdigit() and 0 < int(port) < 65536:
        return
    raise ValueError(f"{what} {endpoint!r}: ipc://PATH or tcp://HOST:PORT (a port 1-65535)")


class Relay:
    """Subscribes to an engine's KV events (``source``, its ``--kv-events-config`` endpoint; its
    KV blocks of ``engine_block_size`` tokens) and publishes them on ``target`` (bound) told in
    ``block_size``-token blocks and a device reset told as its blocks' removal, on a thread of its
    own; :meth:`close` stops it. A batch that cannot be decoded or split is dropped and logged
    (the events come over a socket: untrusted)."""

    def __init__(self, source: str, target: str, engine_block_size: int, block_size: int = ROUTER_BLOCK_SIZE) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        if engine_block_size % block_size:
            raise ValueError(f"{engine_block_size}-token blocks cannot be told in {block_size}-token blocks")
        for what, endpoint in (("--from", source), ("--to", target)):
            _check_endpoint(what, endpoint)
        self.source, self.target = source, target
        self.engine_block_size, self.block_size = engine_block_size, block_size
        self.relayed = 0
        self.dropped = 0
        self._device = DeviceBlocks()
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._encoder = msgspec.msgpack.Encoder()
        ctx = zmq.Context.instance()
        self._sub = ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.setsockopt(zmq.RCVTIMEO, 100)
        self._sub.connect(source)
        self._pub = ctx.socket(zmq.PUB)
        self._pub.bind(target)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kvcompose relay {source}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import zmq

        while not self._stop.is_set():
            try:
                frames = self._sub.recv_multipart()
            except zmq.Again:
                continue
            out = self.convert(frames)
            if out is None:
                self.dropped += 1
                continue
            self._pub.send_multipart(out)
            self.relayed += 1

    def convert(self, frames: list[bytes]) -> list[bytes] | None:
        """One published message (``[topic, seq, payload]``) as the relay publishes it, or None
        when it is not one of vLLM's event batches."""
        import msgspec

        if len(frames) != 3:
            log.warning("kvcompose relay: %s: a message of %d frames, not vLLM's 3; dropped", self.source, len(frames))
            return None
        topic, seq, payload = frames
        try:
            batch = self._decoder.decode(payload)
            events = self._device.follow(split_events(batch.events, self.block_size, self.engine_block_size))
            batch = msgspec.structs.replace(batch, events=events)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError) as exc:
            log.warning("kvcompose relay: %s: batch %r dropped: %s", self.source, seq[:8], exc)
            return None
        return [topic, seq, self._encoder.encode(batch)]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sub.close(linger=0)
        self._pub.close(linger=0)
