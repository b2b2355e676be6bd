"""What the fleet's pool index costs (docs/native-offload.md, "The fleet's pool"): run once, by hand.

1. memory: the bytes one peer's entries take, per million hashes (``tracemalloc`` around the
   index's own ``_apply`` of vLLM ``BlockStored`` batches, and the process's RSS);
2. decode: batches, events and hashes a second that the index's frame path (``_on_frames``:
   checks, vLLM's msgspec decoder, the sequence, the entries) takes in one thread, frames
   pre-encoded as vLLM's publisher encodes them;
3. wire: the same batches published by vLLM's ``ZmqEventPublisher`` over 127.0.0.1 to a
   :class:`PeerIndex` on its thread, publish of the first to the last applied;
4. fleet (``--fleet PEERS``, a simulation): one :class:`PeerIndex` subscribed to PEERS simulated
   instances, each publishing ``--rates`` batches a second for ``--seconds`` from a second process
   (one PUB socket an instance, frames as vLLM's publisher sends them: topic, 8-byte sequence,
   msgpack ``KVEventBatch``); per rate: batches applied of those sent, the index process's CPU
   (its index thread; the main thread sleeps), how long after the last publish the last was
   applied, entries dropped, and one :meth:`PeerIndex.longest` over the peers it then holds. PEERS
   at 40 batches/s each is both one instance's view of 99 peers and one shared index for 100.

Each batch is one ``BlockStored`` of ``--hashes`` blocks (medium CPU, 16 token ids a block, as
vLLM's self-describing offload events carry). Usage: ``python scripts/pool_cost.py [--entries
1000000] [--batches 20000] [--hashes 16] [--fleet 99 --rates 40,80 --seconds 20]`` (needs the
cpu-offload plugin and vLLM).
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import resource
import socket
import time
import tracemalloc

import msgspec
import zmq
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


def _instances(peers: int, rate: float, seconds: float, hashes: int, go, sent) -> None:
    """The simulated fleet (a process of its own): one PUB an instance (``sent`` gets their ports
    first); empty batches until ``go``, then ``rate`` batches a second each for ``seconds``;
    ``sent`` gets the paced counts and the end."""
    ctx = zmq.Context()
    socks = []
    for _ in range(peers):
        sock = ctx.socket(zmq.PUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind_to_random_port("tcp://127.0.0.1")
        socks.append(sock)
    sent.put([int(s.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1]) for s in socks])
    encoder = msgspec.msgpack.Encoder()
    rng = random.Random(5)
    tokens = [rng.randrange(32000) for _ in range(16 * hashes)]
    seqs = [0] * len(socks)

    def send(i: int, hashes_: list[int]) -> None:
        store = BlockStored(hashes_, None, tokens[: 16 * len(hashes_)], 16, None, "CPU", None)
        batch = KVEventBatch(ts=time.time(), events=[store])
        socks[i].send_multipart([b"", seqs[i].to_bytes(8, "big"), encoder.encode(batch)])
        seqs[i] += 1

    while not go.is_set():  # the SUBs join (a PUB drops what it sends before)
        for i in range(len(socks)):
            send(i, [])
        time.sleep(0.05)
    time.sleep(0.5)
    paced = [0] * len(socks)
    start = time.monotonic()
    while (elapsed := time.monotonic() - start) < seconds:
        due = int(elapsed * rate)
        for i in range(len(socks)):
            while paced[i] < due:
                send(i, [rng.getrandbits(64) for _ in range(hashes)])
                paced[i] += 1
        time.sleep(0.002)
    sent.put((paced, time.time()))
    time.sleep(1)


def fleet(peers: int, rates: list[float], seconds: float, hashes: int) -> None:
    spawn = multiprocessing.get_context("spawn")
    for rate in rates:
        go, sent = spawn.Event(), spawn.Queue()
        proc = spawn.Process(target=_instances, args=(peers, rate, seconds, hashes, go, sent))
        proc.start()
        ports = sent.get(timeout=60)
        index = PeerIndex([Peer("127.0.0.1", p, f"tcp://127.0.0.1:{p}") for p in ports])
        names = [p.name for p in index.peers]
        while not all(index.applied[n] for n in names):
            time.sleep(0.05)
        go.set()
        time.sleep(0.3)  # the last empty batches land
        before = {n: index.applied[n] for n in names}
        cpu0, wall0 = time.process_time(), time.monotonic()
        paced, ended = sent.get(timeout=seconds + 60)
        want = sum(paced)
        while (got := sum(index.applied[n] - before[n] for n in names)) < want and time.time() - ended < 30:
            time.sleep(0.005)
        lag = time.time() - ended
        cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
        held = sum(index.held(p) for p in index.peers)
        # One prompt of 64 blocks whose first 32 the last peer holds: every peer is looked at.
        last = index.peers[-1]
        with index._lock:
            prefix = list(index._peers[-1].blocks)[:32]
        prompt = prefix + [random.getrandbits(64) for _ in range(32)]
        n = 2000
        t = time.perf_counter()
        for _ in range(n):
            found = index.longest(prompt)
        took_us = (time.perf_counter() - t) / n * 1e6
        assert found == (last, len(prefix)), found
        print(
            f"fleet: {peers} peers x {rate:g} batches/s "
            f"({peers * rate:,.0f}/s, {peers * rate * hashes:,.0f} hashes/s): "
            f"applied {got:,} of {want:,} sent, the last {lag * 1000:,.0f} ms after the last publish; "
            f"index process CPU {cpu / wall:.2f} core over {wall:.1f} s; {held:,} entries; drops {dict(index.drops)}; "
            f"longest() over {peers} peers (64 blocks, 32 held) {took_us:,.0f} us"
        )
        proc.join(10)
        index.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=1_000_000)
    parser.add_argument("--batches", type=int, default=20_000)
    parser.add_argument("--hashes", type=int, default=16)
    parser.add_argument("--fleet", type=int, default=0, help="simulated peers: only the fleet part runs")
    parser.add_argument("--rates", default="40", help="batches a second per peer, comma-separated")
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args()
    if args.fleet:
        fleet(args.fleet, [float(r) for r in args.rates.split(",")], args.seconds, args.hashes)
        return
    memory(args.entries)
    decode(args.batches, args.hashes)
    wire(args.batches, args.hashes)


if __name__ == "__main__":
    main()
