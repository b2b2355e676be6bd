"""What the fleet's pool index costs (docs/native-offload.md, "The fleet's pool"): run once, by hand.

1. memory: the bytes one peer's entries take, per million hashes (``tracemalloc`` around the
   index's own ``_apply`` of vLLM ``BlockStored`` batches, and the process's RSS);
2. decode: batches, events and hashes a second that the index's frame path (``_on_frames``:
   checks, vLLM's msgspec decoder, the sequence, the entries) takes in one thread, frames
   pre-encoded as vLLM's publisher encodes them;
3. wire: the same batches published by vLLM's ``ZmqEventPublisher`` over 127.0.0.1 to a
   :class:`PeerIndex` on its thread, publish of the first to the last applied.

Each batch is one ``BlockStored`` of ``--hashes`` blocks (medium CPU, 16 token ids a block, as
vLLM's self-describing offload events carry). Usage: ``python scripts/pool_cost.py [--entries
1000000] [--batches 20000] [--hashes 16]`` (needs the cpu-offload plugin and vLLM).
"""

from __future__ import annotations

import argparse
import random
import resource
import socket
import time
import tracemalloc

import msgspec
from vllm.distributed.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher

from kvcompose_cpu_offload.pool import Peer, PeerIndex


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _batch(rng: random.Random, hashes: int) -> KVEventBatch:
    store = BlockStored(
        block_hashes=[rng.getrandbits(64) for _ in range(hashes)],
        parent_block_hash=rng.getrandbits(64),
        token_ids=[rng.randrange(32000) for _ in range(16 * hashes)],
        block_size=16,
        lora_id=None,
        medium="CPU",
        lora_name=None,
    )
    return KVEventBatch(ts=time.time(), events=[store])


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def memory(entries: int) -> None:
    rng = random.Random(1)
    index = PeerIndex([Peer("127.0.0.1", 1, f"tcp://127.0.0.1:{_port()}")], max_blocks=entries)
    state = index._peers[0]
    per = 1000
    batches = [
        KVEventBatch(
            ts=0.0, events=[BlockStored([rng.getrandbits(64) for _ in range(per)], None, [], 16, None, "CPU", None)]
        )
        for _ in range(entries // per)
    ]
    rss = _rss_mib()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for b in batches:
        index._apply(state, b)
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    held = index.held(state.peer)
    print(
        f"memory: {held} entries, {(after - before) / held:.0f} B an entry (tracemalloc), "
        f"{(after - before) / 2**20 * 1e6 / held:.0f} MiB per 1M; max RSS grew {_rss_mib() - rss:.0f} MiB"
    )
    index.close()


def decode(batches: int, hashes: int) -> None:
    rng = random.Random(2)
    encoder = msgspec.msgpack.Encoder()
    payloads = [encoder.encode(_batch(rng, hashes)) for _ in range(batches)]
    index = PeerIndex([Peer("127.0.0.1", 1, f"tcp://127.0.0.1:{_port()}")])
    state = index._peers[0]
    start = time.perf_counter()
    for seq, payload in enumerate(payloads):
        index._on_frames(state, [b"", seq.to_bytes(8, "big"), payload])
    took = time.perf_counter() - start
    size = sum(map(len, payloads)) / batches
    print(
        f"decode (one thread, no socket): {batches / took:,.0f} batches/s = {batches / took:,.0f} events/s, "
        f"{batches * hashes / took:,.0f} hashes/s ({size:,.0f} B a batch)"
    )
    index.close()


def wire(batches: int, hashes: int) -> None:
    rng = random.Random(3)
    events = [_batch(rng, hashes) for _ in range(batches)]
    port = _port()
    pub = ZmqEventPublisher(0, endpoint=f"tcp://*:{port}", buffer_steps=batches + 10, max_queue_size=batches + 10)
    peer = Peer("127.0.0.1", 1, f"tcp://127.0.0.1:{port}")
    index = PeerIndex([peer])
    while not index.applied[peer.name]:  # the SUB joins
        pub.publish(KVEventBatch(ts=0.0, events=[]))
        time.sleep(0.05)
    first = index.applied[peer.name]
    start = time.perf_counter()
    for b in events:
        pub.publish(b)
    while index.applied[peer.name] < first + batches and time.perf_counter() - start < 120:
        time.sleep(0.005)
    took = time.perf_counter() - start
    got = index.applied[peer.name] - first
    print(
        f"wire (vLLM's publisher -> the index thread, 127.0.0.1): {got} of {batches} batches in {took:.2f} s = "
        f"{got / took:,.0f} events/s, {got * hashes / took:,.0f} hashes/s; drops {dict(index.drops)}"
    )
    index.close()
    pub.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=1_000_000)
    parser.add_argument("--batches", type=int, default=20_000)
    parser.add_argument("--hashes", type=int, default=16)
    args = parser.parse_args()
    memory(args.entries)
    decode(args.batches, args.hashes)
    wire(args.batches, args.hashes)


if __name__ == "__main__":
    main()
