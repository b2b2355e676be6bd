"""The fleet's pool: a :class:`PeerIndex` fed by vLLM's real ``ZmqEventPublisher`` over 127.0.0.1,
its answers, what it forgets and when, the frames it drops (each reason beside a control that
passes), the ``pool`` option of the p2p tier, and the source it sets in vLLM's real scheduler."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest
import zmq
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from kvcompose.api import P2P_DECODER, P2P_PREFILLER, P2P_SOURCE
from kvcompose.compose import loads
from kvcompose.errors import CompositionError
from kvcompose.testing.harness import make_request, scheduler_from_yaml, step
from kvcompose_cpu_offload import p2p, pool, tiers
from kvcompose_cpu_offload.pool import Peer, PeerIndex, block_key
from kvcompose_nixl.trust import Keyring, Refused, Replays

H = [1000 + i for i in range(8)]  # block hashes as vLLM publishes them (64-bit ints)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(what: Callable[[], Any], timeout: float = 5.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = what()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError("timed out")


def stored(hashes: list[Any], medium: str | None = "CPU", group_idx: int | None = None) -> BlockStored:
    return BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=None,
        token_ids=[],
        block_size=16,
        lora_id=None,
        medium=medium,
        lora_name=None,
        group_idx=group_idx,
    )


def removed(hashes: list[Any], medium: str | None = "CPU") -> BlockRemoved:
    return BlockRemoved(block_hashes=list(hashes), medium=medium)


def batch(*events: Any) -> KVEventBatch:
    return KVEventBatch(ts=time.time(), events=list(events))


class Publisher:
    """vLLM's ``ZmqEventPublisher`` on free 127.0.0.1 ports, and the :class:`Peer` naming it."""

    def __init__(self, p2p_port: int | None = None, replay: bool = True, port: int | None = None) -> None:
        self.port = port or free_port()
        self.replay_port = free_port() if replay else None
        self.pub = ZmqEventPublisher(
            0,
            endpoint=f"tcp://*:{self.port}",
            replay_endpoint=f"tcp://*:{self.replay_port}" if replay else None,
        )
        self.peer = Peer(
            "127.0.0.1",
            p2p_port or free_port(),
            f"tcp://127.0.0.1:{self.port}",
            f"tcp://127.0.0.1:{self.replay_port}" if replay else None,
        )

    def publish(self, *events: Any) -> None:
        self.pub.publish(batch(*events))

    def close(self) -> None:
        self.pub.shutdown()


@pytest.fixture
def make_publisher() -> Iterator[Callable[..., Publisher]]:
    made: list[Publisher] = []

    def make(**kw: Any) -> Publisher:
        made.append(Publisher(**kw))
        return made[-1]

    yield make
    for publisher in made:
        publisher.close()


@pytest.fixture
def make_index() -> Iterator[Callable[..., PeerIndex]]:
    made: list[PeerIndex] = []

    def make(peers: list[Peer], **kw: Any) -> PeerIndex:
        made.append(PeerIndex(peers, **kw))
        return made[-1]

    yield make
    for index in made:
        index.close()


def joined(index: PeerIndex, *publishers: Publisher) -> None:
    """Wait until the index hears each publisher (a SUB misses what is sent before it joins)."""
    for publisher in publishers:
        wait_until(lambda p=publisher: (p.publish(), time.sleep(0.02), index.applied[p.peer.name])[-1])


def send(index: PeerIndex, publisher: Publisher, *events: Any) -> None:
    """Publish one batch of ``events`` and wait until the index applied it."""
    before = index.applied[publisher.peer.name]
    publisher.publish(*events)
    wait_until(lambda: index.applied[publisher.peer.name] > before)


# -- what the index holds


def test_longest_names_the_peer_holding_the_longest_prefix_in_served_media(make_publisher, make_index) -> None:
    a, b, gpu = make_publisher(), make_publisher(), make_publisher()
    index = make_index([a.peer, b.peer, gpu.peer])
    joined(index, a, b, gpu)
    send(index, a, stored(H[:3]))
    send(index, b, stored(H[:2]), stored(H[2:5], medium="STORAGE"))
    send(index, gpu, stored(H, medium="GPU"), stored(H, medium=None))  # the device cache: the p2p tier cannot serve it
    assert index.longest(H) == (b.peer, 5)
    assert index.longest(H[:3]) == (a.peer, 3)  # a tie: the first peer configured
    assert index.longest(H[5:]) is None and index.held(gpu.peer) == 0
    assert index.longest([99, *H]) is None  # a prefix starts at the first block


def test_the_engines_bytes_hashes_match_the_published_ints() -> None:
    """``longest`` takes a request's ``block_hashes`` as the engine computes them (bytes): they
    key as vLLM publishes them (``maybe_convert_block_hash``, int mode, vLLM's default)."""
    request = make_request(num_tokens=64)
    for h in request.block_hashes:
        assert block_key(h) == maybe_convert_block_hash(h) == block_key(maybe_convert_block_hash(h))


def test_removal_and_reference_counts_per_medium(make_publisher, make_index) -> None:
    a = make_publisher()
    index = make_index([a.peer])
    joined(index, a)
    send(index, a, stored(H[:4]), stored(H[:2]), stored(H[:4], medium="STORAGE"))
    send(index, a, removed(H[2:4]))
    assert index.longest(H) == (a.peer, 4)  # the storage tier still holds 2 and 3
    send(index, a, removed(H[2:3], medium="STORAGE"), removed(H[:1]))
    assert index.longest(H) == (a.peer, 2)  # 0 was stored twice on CPU; 2 is gone from both
    send(index, a, removed(H[:1]), removed(H[:1], medium="STORAGE"))
    assert index.longest(H) is None and index.held(a.peer) == 2  # 1 and 3 are left


def test_all_blocks_cleared_drops_every_entry_of_that_peer_only(make_publisher, make_index) -> None:
    a, b = make_publisher(), make_publisher()
    index = make_index([a.peer, b.peer])
    joined(index, a, b)
    send(index, a, stored(H[:3]))
    send(index, b, stored(H[:2]))
    send(index, a, AllBlocksCleared())
    assert index.held(a.peer) == 0 and index.longest(H) == (b.peer, 2)


def test_a_restarted_publisher_counting_from_0_leaves_no_stale_entry(make_publisher, make_index) -> None:
    a = make_publisher()
    index = make_index([a.peer])
    joined(index, a)
    send(index, a, stored(H[:4]))
    send(index, a, stored(H[4:5]))
    assert index.longest(H) == (a.peer, 5)
    a.close()
    restarted = None
    deadline = time.monotonic() + 10
    while restarted is None:  # the old publisher's port is released after its shutdown returns (vLLM 0.33)
        try:
            restarted = make_publisher(port=a.port, p2p_port=a.peer.p2p_port, replay=False)
        except zmq.ZMQError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    # The new publisher counts from 0; the SUB reconnects on its own.
    wait_until(lambda: (restarted.publish(stored([H[7]])), time.sleep(0.1), index.longest([H[7]]))[-1])
    assert index.longest(H) is None and index.held(a.peer) == 1


def test_a_gap_is_filled_from_vllms_replay_endpoint(make_index) -> None:
    """The live frames come from a socket of the test (seq 0, then seq 2); the replay endpoint is
    vLLM's publisher, which buffered 0, 1 and 2: batch 1 is fetched from it."""
    vllm_pub = Publisher()
    live = zmq.Context.instance().socket(zmq.PUB)
    port = live.bind_to_random_port("tcp://127.0.0.1")
    encoder = msgspec.msgpack.Encoder()
    batches = [batch(stored(H[:1])), batch(stored(H[1:2])), batch(stored(H[2:3]))]
    try:
        for b in batches:
            vllm_pub.pub.publish(b)
        with_replay = Peer("127.0.0.1", 1, f"tcp://127.0.0.1:{port}", vllm_pub.peer.kv_events_replay)
        without = Peer("127.0.0.1", 2, f"tcp://127.0.0.1:{port}")
        index = make_index([with_replay, without])
        first = [b"", (0).to_bytes(8, "big"), encoder.encode(batches[0])]
        # Until both SUBs joined (a repeated 0 reads as a restart: the same entries again).
        wait_until(
            lambda: (live.send_multipart(first), time.sleep(0.05), index.held(without) and index.held(with_replay))[-1]
        )
        live.send_multipart([b"", (2).to_bytes(8, "big"), encoder.encode(batches[2])])
        wait_until(lambda: index.longest([H[2]]))
        wait_until(lambda: index.held(with_replay) == 3)
        assert index.longest(H) == (with_replay, 3)
        # Control: without a replay endpoint the gap loses batch 0's entries too (its removals are unknown).
        assert index.held(without) == 1
    finally:
        live.close(linger=0)
        vllm_pub.close()


def test_a_silent_peer_is_not_offered_and_is_again_when_it_speaks(make_publisher, make_index) -> None:
    a = make_publisher()
    index = make_index([a.peer], silent_s=0.4)
    joined(index, a)
    send(index, a, stored(H[:3]))
    assert index.longest(H) == (a.peer, 3) and index.offered(a.peer)
    wait_until(lambda: index.longest(H) is None)
    assert index.held(a.peer) == 3 and not index.offered(a.peer)  # kept, not offered
    send(index, a)
    assert index.longest(H) == (a.peer, 3)


def test_the_cap_drops_the_oldest_stored(make_publisher, make_index) -> None:
    a = make_publisher()
    index = make_index([a.peer], max_blocks=4)
    joined(index, a)
    send(index, a, stored(H[:4]))
    send(index, a, stored(H[:1]))  # stored again: now the newest
    send(index, a, stored(H[4:6]))
    assert index.held(a.peer) == 4
    assert index.longest(H) == (a.peer, 1)  # 1 and 2 were the oldest
    assert index.longest(H[3:]) == (a.peer, 3)


# -- frames from the network: each drop reason beside a control


class Forger:
    """A socket the index subscribes to, sending whatever frames a test writes."""

    def __init__(self) -> None:
        self.sock = zmq.Context.instance().socket(zmq.PUB)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.peer = Peer("127.0.0.1", port + 1, f"tcp://127.0.0.1:{port}")
        self.seq = 0

    def frames(self, payload: bytes, seq: bytes | None = None) -> list[bytes]:
        if seq is None:
            seq = self.seq.to_bytes(8, "big")
            self.seq += 1
        return [b"", seq, payload]

    def good(self, *hashes: int) -> list[bytes]:
        return self.frames(msgspec.msgpack.encode(batch(stored(list(hashes)))))


def _bad_hash_batch(value: Any) -> bytes:
    """A batch vLLM's type would take but for its one hash (written as the wire carries it)."""
    good = msgspec.to_builtins(batch(stored([1])))
    good[1][0]["block_hashes"] = [value]
    return msgspec.msgpack.encode(good)


ATTACKS: list[tuple[str, Callable[[Forger], list[bytes]]]] = [
    ("frames", lambda f: f.good(7)[1:]),
    ("frames", lambda f: [*f.good(7), b"more"]),
    ("seq", lambda f: f.frames(msgspec.msgpack.encode(batch(stored([7]))), seq=b"\x00\x01")),
    ("size", lambda f: f.frames(msgspec.msgpack.encode(batch(stored(list(range(1 << 20, (1 << 20) + 1000))))))),
    ("decode", lambda f: f.frames(b"\xc1\xc1")),
    ("type", lambda f: f.frames(msgspec.msgpack.encode({"not": "a batch"}))),
    ("type", lambda f: f.frames(msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": "x"}]]))),
    ("type", lambda f: f.frames(_bad_hash_batch(1.5))),
    ("huge", lambda f: f.frames(msgspec.msgpack.encode(batch(stored(list(range(40))))))),
    ("hash", lambda f: f.frames(_bad_hash_batch(-5))),
    ("hash", lambda f: f.frames(_bad_hash_batch(b"x" * 65))),
]


@pytest.mark.parametrize(("reason", "attack"), ATTACKS, ids=[f"{r}-{i}" for i, (r, _) in enumerate(ATTACKS)])
def test_a_bad_frame_is_dropped_for_its_reason_and_the_thread_goes_on(
    make_index, reason: str, attack: Callable[[Forger], list[bytes]]
) -> None:
    forger = Forger()
    try:
        index = make_index([forger.peer], max_frame_bytes=2048, max_batch_hashes=32)
        wait_until(lambda: (forger.sock.send_multipart(forger.good(1)), index.applied[forger.peer.name])[-1])
        forger.sock.send_multipart(attack(forger))
        wait_until(lambda: index.drops[(forger.peer.name, reason)] == 1)
        assert sum(index.drops.values()) == 1
        # Control: a good frame after it is applied (the thread lives).
        before = index.applied[forger.peer.name]
        forger.sock.send_multipart(forger.good(42))
        wait_until(lambda: index.applied[forger.peer.name] > before)
        assert index.longest([42]) == (forger.peer, 1)
    finally:
        forger.sock.close(linger=0)


def test_drops_are_logged_once_a_period_per_peer_and_reason(make_index) -> None:
    forger = Forger()
    lines: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = lines.append  # type: ignore[method-assign]
    pool.logger.addHandler(handler)
    try:
        index = make_index([forger.peer])
        wait_until(lambda: (forger.sock.send_multipart(forger.good(1)), index.applied[forger.peer.name])[-1])
        for _ in range(5):
            forger.sock.send_multipart(forger.frames(b"\xc1"))
        wait_until(lambda: index.drops[(forger.peer.name, "decode")] == 5)
        said = [r.getMessage() for r in lines if "frame dropped" in r.getMessage()]
        assert len(said) == 1 and forger.peer.name in said[0] and "(decode)" in said[0]
        assert not any(r.exc_info for r in lines)
    finally:
        pool.logger.removeHandler(handler)
        forger.sock.close(linger=0)


def test_a_sequence_going_back_drops_the_peers_entries(make_index) -> None:
    forger = Forger()
    try:
        index = make_index([forger.peer])
        wait_until(lambda: (forger.sock.send_multipart(forger.good(1)), index.applied[forger.peer.name])[-1])
        forger.sock.send_multipart(forger.good(2))
        wait_until(lambda: index.held(forger.peer) == 2)
        forger.seq = 0  # a restarted publisher
        forger.sock.send_multipart(forger.good(3))
        wait_until(lambda: index.longest([3]) is not None)
        assert index.held(forger.peer) == 1 and index.longest([1]) is None
    finally:
        forger.sock.close(linger=0)


# -- the pool option


def _pool_yaml(peers: str, extra: str = "", pool_extra: str = "") -> str:
    return (
        "version: 1\nconnectors:\n  - name: host\n    type: native-offload\n    options:\n"
        "      cpu_bytes: 4MiB\n" + extra + "      tiers:\n"
        "        - type: p2p\n          host: 127.0.0.1\n          port: 5711\n          pool:\n"
        "            peers:\n" + peers + pool_extra
    )


LOCAL_PEER = '              - {host: 127.0.0.1, p2p_port: 5712, kv_events: "tcp://127.0.0.1:5557"}\n'
REMOTE_PEER = '              - {host: 10.0.0.8, p2p_port: 5712, kv_events: "tcp://10.0.0.8:5557"}\n'


def test_the_pool_renders_beside_the_tier_never_into_vllms_entry() -> None:
    extra = loads(_pool_yaml(LOCAL_PEER, pool_extra="            wait_ms: 300\n")).child("host").vllm_config()
    extra = extra["kv_connector_extra_config"]
    assert extra["secondary_tiers"] == [{"type": "p2p", "host": "127.0.0.1", "port": 5711}]
    assert extra[tiers.P2P_POOL_KEY] == {
        "peers": [{"host": "127.0.0.1", "p2p_port": 5712, "kv_events": "tcp://127.0.0.1:5557"}],
        "wait_ms": 300,
        "silent_s": tiers.POOL_SILENT_S,
        "max_blocks": tiers.POOL_MAX_BLOCKS,
    }


def test_a_peer_on_this_host_may_publish_on_a_unix_socket() -> None:
    """vLLM's publisher binds an ``ipc://`` endpoint as given (a TCP one only as ``tcp://*``)."""
    peer = LOCAL_PEER.replace("tcp://127.0.0.1:5557", "ipc:///run/kvc/peer-b.sock")
    extra = loads(_pool_yaml(peer)).child("host").vllm_config()["kv_connector_extra_config"]
    assert extra[tiers.P2P_POOL_KEY]["peers"][0]["kv_events"] == "ipc:///run/kvc/peer-b.sock"


def test_check_says_the_pool_one_fact_a_line() -> None:
    plan = loads(_pool_yaml(LOCAL_PEER))
    lines = plan.child("host").type.brief(plan.child("host")).splitlines()
    pool_lines = [line.strip() for line in lines if line.strip().startswith("pool")]
    assert len(pool_lines) == 4
    assert "127.0.0.1:5712" in pool_lines[1] and "tcp://127.0.0.1:5557" in pool_lines[1]
    assert f"waits {tiers.POOL_WAIT_MS} ms at most" in pool_lines[2]


@pytest.mark.parametrize(
    ("peers", "pool_extra", "at", "says"),
    [
        (LOCAL_PEER.replace("kv_events", "kv_event"), "", "c.yaml:13:", "unknown key 'kv_event'"),
        (LOCAL_PEER.replace("tcp://127.0.0.1:5557", "127.0.0.1:5557"), "", "c.yaml:13:", "kv_events"),
        (LOCAL_PEER.replace("5557", "99999"), "", "c.yaml:13:", "the port is not 1-65535"),
        (LOCAL_PEER.replace("5712", "0"), "", "c.yaml:13:", "p2p_port"),
        (LOCAL_PEER, "            wait_ms: -1\n", "c.yaml:", "wait_ms"),
        (LOCAL_PEER, "            peer: []\n", "c.yaml:", "unknown key 'peer'"),
        (LOCAL_PEER + LOCAL_PEER, "", "c.yaml:14:", "listed twice"),
        (REMOTE_PEER, "", "c.yaml:13:", "needs the deployment key"),
        (LOCAL_PEER.replace("tcp://127.0.0.1:5557", "ipc://relative"), "", "c.yaml:13:", "kv_events"),
        (REMOTE_PEER.replace("tcp://10.0.0.8:5557", "ipc:///tmp/p.sock"), "", "c.yaml:13:", "a socket of this host"),
    ],
)
def test_a_bad_pool_is_refused_at_its_line_saying_why(peers: str, pool_extra: str, at: str, says: str) -> None:
    with pytest.raises(CompositionError) as info:
        loads(_pool_yaml(peers, pool_extra=pool_extra), filename="c.yaml")
    message = str(info.value)
    assert at in message and says in message, message


def test_a_pool_beyond_loopback_is_taken_with_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVC_POOL_KEY", "k" * 64)
    plan = loads(_pool_yaml(REMOTE_PEER, extra="      key_env: KVC_POOL_KEY\n"))
    extra = plan.child("host").vllm_config()["kv_connector_extra_config"]
    assert extra[tiers.P2P_POOL_KEY]["peers"][0]["host"] == "10.0.0.8"
    assert "a source must be a deployment peer" in str(_refused(_pool_yaml(REMOTE_PEER)))


def _refused(text: str) -> CompositionError:
    with pytest.raises(CompositionError) as info:
        loads(text, filename="c.yaml")
    return info.value


# -- screen: a source naming a pool peer


def test_screen_takes_a_source_naming_a_pool_peer_and_refuses_one_naming_another() -> None:
    def source(host: str, port: int) -> dict[str, Any]:
        return {P2P_SOURCE: {"kv_request_id": "kvcompose-p2p-1", "remote_host": host, "remote_port": port}}

    peers = {("10.0.0.8", 5712)}
    keys = Keyring.parse("k" * 64, "test")
    for keyring in (None, keys):
        p2p.screen(source("10.0.0.8", 5712), "d", keyring, Replays(), 0.0, peers=peers)  # a configured peer
        for host, port in (("10.0.0.9", 5712), ("10.0.0.8", 5713)):
            with pytest.raises(Refused) as info:
                p2p.screen(source(host, port), "d", keyring, Replays(), 0.0, peers=peers)
            assert info.value.reason == "peer"


# -- vLLM's real scheduler


def test_the_scheduler_sets_a_source_when_a_peer_holds_more_and_gives_it_up_after_wait_ms(make_publisher) -> None:
    """vLLM's scheduler around a composition whose p2p tier has a pool of one peer (vLLM's
    publisher here; its p2p port a socket that takes messages and answers none: a peer alive and
    slow). A request whose first 4 blocks the peer's CPU tier holds gets ``remote_kv_source``
    naming the peer; vLLM's tier asks the peer and waits (it bounds no lookup); past ``wait_ms``
    the source is given up and the prompt computed here. A request whose prefix this instance's
    device cache holds as far gets none."""
    peer_pub = make_publisher()
    peer = peer_pub.peer
    mute = zmq.Context.instance().socket(zmq.ROUTER)
    mute.bind(f"tcp://127.0.0.1:{peer.p2p_port}")
    text = _pool_yaml(
        f'              - {{host: 127.0.0.1, p2p_port: {peer.p2p_port}, kv_events: "{peer.kv_events}", '
        f'kv_events_replay: "{peer.kv_events_replay}"}}\n',
        pool_extra="            wait_ms: 300\n",
    ).replace("port: 5711", f"port: {free_port()}")
    scheduler = scheduler_from_yaml(text, num_blocks=64, block_size=16)
    (child,) = scheduler.connector.sub_connectors
    assert isinstance(child, p2p.OffloadingConnector) and child.pool is not None
    try:
        local = make_request(prompt=[3 + i % 400 for i in range(8 * 16 + 5)], max_tokens=2)
        scheduler.add_request(local)
        assert P2P_SOURCE not in (local.kv_transfer_params or {})  # the peer holds nothing yet
        while not local.is_finished():
            step(scheduler)

        remote = make_request(prompt=[7 + i % 300 for i in range(8 * 16 + 5)], max_tokens=2)
        same = make_request(prompt=local.prompt_token_ids, max_tokens=2)
        published = [maybe_convert_block_hash(h) for h in remote.block_hashes[:4] + same.block_hashes[:4]]
        peer_pub.publish(stored(published))
        wait_until(lambda: child.pool.longest(remote.block_hashes) == (peer, 4))

        scheduler.add_request(same)  # the device cache holds 8 blocks of it: nothing to fetch
        assert P2P_SOURCE not in (same.kv_transfer_params or {})

        scheduler.add_request(remote)
        role = remote.kv_transfer_params[P2P_SOURCE]
        assert role["remote_host"] == "127.0.0.1" and role["remote_port"] == peer.p2p_port
        assert role["kv_request_id"].startswith(p2p.REQUEST_ID_PREFIX)
        assert child.pool_sources["index"] == 1

        started = time.monotonic()
        while remote.num_computed_tokens == 0 and time.monotonic() - started < 60:
            out, _ = step(scheduler)
            if remote.request_id in out.num_scheduled_tokens:
                break
            time.sleep(0.05)
        waited = time.monotonic() - started
        assert remote.request_id in out.num_scheduled_tokens, "the request never ran"
        assert waited >= 0.3, waited  # not before wait_ms (no upper bound: a loaded machine is slow)
        assert child.pool_sources["gave_up"] == 1
        assert out.num_scheduled_tokens[remote.request_id] == len(remote.prompt_token_ids)  # computed here
        assert mute.poll(0), "vLLM's tier did not contact the source"
    finally:
        scheduler.connector.shutdown()
        mute.close(linger=0)


def test_the_scheduler_uses_a_routers_source_naming_a_pool_peer(make_publisher) -> None:
    """A ``remote_kv_source`` that arrives naming a pool peer (a router's choice) is kept, counted,
    and bounded like the index's; one naming another host is refused as before."""
    peer = make_publisher().peer  # its p2p port: nobody
    text = _pool_yaml(
        f'              - {{host: 127.0.0.1, p2p_port: {peer.p2p_port}, kv_events: "{peer.kv_events}"}}\n'
    ).replace("port: 5711", f"port: {free_port()}")
    scheduler = scheduler_from_yaml(text, num_blocks=64, block_size=16)
    (child,) = scheduler.connector.sub_connectors
    try:
        given = {"kv_request_id": "from-router-1", "remote_host": "127.0.0.1", "remote_port": peer.p2p_port}
        request = make_request(num_tokens=80, kv_transfer_params={P2P_SOURCE: dict(given)})
        scheduler.add_request(request)
        assert request.kv_transfer_params[P2P_SOURCE] == given and child.pool_sources["router"] == 1
        beyond = {**given, "remote_host": "10.9.9.9"}
        refused = make_request(num_tokens=80, kv_transfer_params={P2P_SOURCE: beyond})
        scheduler.add_request(refused)
        assert P2P_SOURCE not in refused.kv_transfer_params and child.refused_params == {"peer": 1}
        # vllm:kvcompose_refused_params and vllm:kvcompose_pool_sources, child="host"; taken once
        reduced = scheduler.connector.get_kv_connector_stats().reduce()
        assert {k.split(".host.", 1)[1]: n for k, n in reduced.items() if ".host." in k} == {
            "refused_params.peer": 1,
            "pool_sources.router": 1,
        }, reduced
        again = scheduler.connector.get_kv_connector_stats()  # vLLM's own gauges, none of the counts again
        assert not [k for k in (again.reduce() if again else {}) if "pool_sources" in k or "refused_params" in k]
        assert child.pool_sources == {"router": 1} and child.refused_params == {"peer": 1}  # the child's stay whole
        step(scheduler)  # vLLM's tier queues its handshake and lookup for a peer that never connects
        (tier,) = child.connector_scheduler.manager.secondary_tiers
        assert tier._control._zmq_ctx.getsockopt(zmq.LINGER) == 0
    finally:
        # vLLM's tier alone waits forever here (the refused connection lingers); the class sets no linger.
        done = threading.Thread(target=scheduler.connector.shutdown, daemon=True)
        done.start()
        done.join(30)
        assert not done.is_alive(), "the connector's shutdown hung on a peer that never connected"


# -- beside NIXL: the p2p tier serves the pool, NIXL carries the P/D legs

#: What vLLM's proxy and router send a prefill (NixlConnector's protocol, vllm-router 0.1.17).
PREFILL_LEG = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
NIXL_SIBLING = (
    "  - {name: pd, type: nixl, role: producer, options: {side_channel_host: 127.0.0.1, side_channel_port: %d}}\n"
    "rules: {load: first-wins, store: all, metadata: merge}\n"
)


def test_beside_nixl_the_p2p_tier_renders_and_says_that_pd_is_nixls() -> None:
    alone = loads(_pool_yaml(LOCAL_PEER))
    beside = loads(_pool_yaml(LOCAL_PEER) + NIXL_SIBLING % 5600)
    assert tiers.P2P_PD_TRANSPORT_KEY not in alone.child("host").vllm_config()["kv_connector_extra_config"]
    assert beside.child("host").vllm_config()["kv_connector_extra_config"][tiers.P2P_PD_TRANSPORT_KEY] == "pd"
    said = beside.child("host").type.brief(beside.child("host"))
    assert "P/D is pd's; the p2p tier carries no P/D leg, it serves the pool" in said
    assert "carries the P/D legs" in alone.child("host").type.brief(alone.child("host"))


def test_the_tiers_progress_delay_renders_beside_it_and_check_says_it() -> None:
    calm = loads(_pool_yaml(LOCAL_PEER).replace("port: 5711\n", "port: 5711\n          progress_delay_us: 100\n"))
    extra = calm.child("host").vllm_config()["kv_connector_extra_config"]
    assert extra["secondary_tiers"] == [{"type": "p2p", "host": "127.0.0.1", "port": 5711}]
    assert extra[tiers.P2P_PROGRESS_DELAY_KEY] == 100
    assert "progress thread sleeps 100 µs between polls" in calm.child("host").type.brief(calm.child("host"))
    spinning = loads(_pool_yaml(LOCAL_PEER))
    assert tiers.P2P_PROGRESS_DELAY_KEY not in spinning.child("host").vllm_config()["kv_connector_extra_config"]
    assert "polls without sleeping (a core per engine)" in spinning.child("host").type.brief(spinning.child("host"))


@pytest.mark.parametrize("value", ["0", "-5", "fast", "2000000"])
def test_a_bad_progress_delay_is_refused_at_its_line(value: str) -> None:
    text = _pool_yaml(LOCAL_PEER).replace("port: 5711\n", f"port: 5711\n          progress_delay_us: {value}\n")
    message = str(_refused(text))
    assert "c.yaml:" in message and "progress_delay_us" in message and "Traceback" not in message, message


def test_the_progress_delay_is_set_before_vllms_tier_makes_its_nixl_agent() -> None:
    """The class patches NIXL's agent config (the nixl child's patch) before vLLM's tier builds its
    agent: the tier's agent is made while the patched config is NIXL's."""
    import nixl._api as api

    from kvcompose_nixl.patches import calm_progress_thread

    made: list[type] = []
    base = api.nixl_agent.__init__

    def record(self: Any, *args: Any, **kwargs: Any) -> None:
        made.append(api.nixlBind.nixlAgentConfig)
        base(self, *args, **kwargs)

    text = _pool_yaml(LOCAL_PEER).replace("port: 5711\n", f"port: {free_port()}\n          progress_delay_us: 100\n")
    api.nixl_agent.__init__ = record
    try:
        scheduler = scheduler_from_yaml(text, block_size=16)
        scheduler.connector.shutdown()
    finally:
        api.nixl_agent.__init__ = base
        calm_progress_thread(0)  # process-wide: restore NIXL's own for the tests after
    assert made and all(getattr(config, "_kvcompose_base", None) is not None for config in made), made


def test_screen_beside_nixl_refuses_a_pd_role_and_takes_a_source() -> None:
    peers = {("127.0.0.1", 5712)}
    source = {P2P_SOURCE: {"kv_request_id": "kvcompose-p2p-1", "remote_host": "127.0.0.1", "remote_port": 5712}}
    p2p.screen(source, "d", None, Replays(), 0.0, peers=peers, transport="pd")  # control: the pool's role
    prefiller = {P2P_PREFILLER: {**source[P2P_SOURCE]}}
    p2p.screen(prefiller, "d", None, Replays(), 0.0, peers=peers)  # control: a p2p P/D composition takes it
    for roles in (prefiller, {P2P_DECODER: {"kv_request_id": "x"}}):
        with pytest.raises(Refused) as info:
            p2p.screen(roles, "d", None, Replays(), 0.0, peers=peers, transport="pd")
        assert info.value.reason == "role" and "P/D is pd's" in info.value.detail


@pytest.mark.parametrize("beside_nixl", [True, False])
def test_a_prefill_leg_gets_a_source_from_the_pool_and_a_decode_leg_none(make_publisher, beside_nixl: bool) -> None:
    """vLLM's scheduler: a prefill leg (``do_remote_decode``) whose prefix a peer holds gets
    ``remote_kv_source``; beside NIXL it gets no p2p P/D role (NIXL serves its decode), in a
    p2p-only composition it also gets the tier's ``remote_decoder`` (vLLM's tier takes both). A
    decode leg (``do_remote_prefill``) gets no source: its KV comes from its prefill."""
    peer_pub = make_publisher()
    peer = peer_pub.peer
    text = _pool_yaml(
        f'              - {{host: 127.0.0.1, p2p_port: {peer.p2p_port}, kv_events: "{peer.kv_events}"}}\n'
    ).replace("port: 5711", f"port: {free_port()}")
    scheduler = scheduler_from_yaml(text + (NIXL_SIBLING % free_port() if beside_nixl else ""), block_size=16)
    host = scheduler.connector.sub_connectors[0]
    assert isinstance(host, p2p.OffloadingConnector) and host.pool is not None
    try:
        prompt = [11 + i % 300 for i in range(8 * 16 + 5)]
        probe = make_request(prompt=prompt, max_tokens=2)
        held = stored([maybe_convert_block_hash(h) for h in probe.block_hashes[:4]])
        # Published until heard: a SUB misses what is sent before it joins.
        wait_until(lambda: (peer_pub.publish(held), time.sleep(0.05), host.pool.longest(probe.block_hashes))[-1])
        found = host.pool.longest(probe.block_hashes)
        assert found is not None and found[0].p2p_port == peer.p2p_port and found[1] == 4

        prefill = make_request(prompt=prompt, max_tokens=2, kv_transfer_params=dict(PREFILL_LEG))
        scheduler.add_request(prefill)
        params = prefill.kv_transfer_params
        assert params[P2P_SOURCE]["remote_port"] == peer.p2p_port and host.pool_sources["index"] == 1
        assert (P2P_DECODER in params) is not beside_nixl

        decode = make_request(prompt=prompt, max_tokens=2, kv_transfer_params={"do_remote_prefill": True})
        host.on_new_request(decode)  # the host child alone: the decode leg's NIXL fields are not the point
        assert P2P_SOURCE not in decode.kv_transfer_params and host.pool_sources["index"] == 1
    finally:
        done = threading.Thread(target=scheduler.connector.shutdown, daemon=True)
        done.start()
        done.join(30)
        assert not done.is_alive(), "the connector's shutdown hung"


def test_a_peer_holding_fewer_blocks_than_its_events_claim_answers_and_the_rest_is_computed(make_publisher) -> None:
    """Events say the peer holds a prompt's first 4 blocks (forged here: the peer's events endpoint
    is ours); the peer is vLLM's real p2p tier and holds none of them. A's pool names it, vLLM's
    tier asks it, it answers the lookup (a miss, not the ``wait_ms`` bound: nothing given up), and
    the prompt is computed whole on A, which serves on."""
    forged = make_publisher()
    b_port = free_port()
    b_yaml = (
        _pool_yaml("", "").split("      tiers:")[0] + f"      tiers: [{{type: p2p, host: 127.0.0.1, port: {b_port}}}]\n"
    )
    b = scheduler_from_yaml(b_yaml, num_blocks=64, block_size=16)
    text = _pool_yaml(
        f'              - {{host: 127.0.0.1, p2p_port: {b_port}, kv_events: "{forged.peer.kv_events}"}}\n',
        pool_extra="            wait_ms: 30000\n",
    ).replace("port: 5711", f"port: {free_port()}")
    a = scheduler_from_yaml(text, num_blocks=64, block_size=16)
    (child,) = a.connector.sub_connectors
    try:
        prompt = [5 + i % 300 for i in range(8 * 16 + 5)]
        probe = make_request(prompt=prompt, max_tokens=2)
        claimed = stored([maybe_convert_block_hash(h) for h in probe.block_hashes[:4]])
        wait_until(lambda: (forged.publish(claimed), time.sleep(0.05), child.pool.longest(probe.block_hashes))[-1])
        request = make_request(prompt=prompt, max_tokens=2)
        a.add_request(request)
        assert request.kv_transfer_params[P2P_SOURCE]["remote_port"] == b_port
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            out, _ = step(a)
            step(b)
            if request.request_id in out.num_scheduled_tokens:
                break
            time.sleep(0.02)
        assert out.num_scheduled_tokens.get(request.request_id) == len(prompt)  # computed here, whole
        assert child.pool_sources == {"index": 1}  # answered: nothing given up
    finally:
        for scheduler in (a, b):
            scheduler.connector.shutdown()


def test_vllms_p2p_tier_keeps_an_idle_engine_stepping() -> None:
    """What docs/performance.md measures as the tier's own cost: vLLM's p2p tier answers
    ``has_pending_work`` true for its whole life, so a scheduler holding no request still has
    work and the engine steps (each step a message to the worker, which then spins a second).
    The control: the same composition without the tier has none."""
    base = _pool_yaml("", "").split("      tiers:")[0]
    stepping = scheduler_from_yaml(base + f"      tiers: [{{type: p2p, host: 127.0.0.1, port: {free_port()}}}]\n")
    resting = scheduler_from_yaml(base)
    try:
        for _ in range(3):
            step(stepping)
            step(resting)
        assert not stepping.requests and not resting.requests
        assert stepping.has_requests()
        assert not resting.has_requests()
    finally:
        for scheduler in (stepping, resting):
            scheduler.connector.shutdown()
