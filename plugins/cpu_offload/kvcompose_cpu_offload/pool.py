"""Which peer of the fleet holds which blocks, from the peers' own KV events (the fleet's pool).

Each configured peer is a vLLM instance whose composition has a p2p tier and whose engine
publishes its KV events (``--kv-events-config``, vLLM's ``ZmqEventPublisher``). :class:`PeerIndex`
holds one ZMQ SUB per peer on that publisher, decodes each frame ``[topic, seq, msgpack
KVEventBatch]`` with vLLM's own msgspec types, and keeps per peer the set of block hashes it holds
in the media vLLM's p2p tier can serve from. :meth:`PeerIndex.longest` answers which peer holds
the longest prefix of a request's blocks; :mod:`kvcompose_cpu_offload.p2p` turns that answer
into the tier's ``remote_kv_source`` role.

What is counted. A symmetric lookup (``LookupMsg``) is answered by the peer's tiering manager
for every tier but the p2p tier itself (``tiering/p2p/session/server.py`` ``_poll_lookup_keys``
calls ``parent.lookup``; ``tiering/manager.py`` ``_SecondaryTierFacingParent``): its CPU tier and,
promoted into it first, its storage tiers (``fs``, ``obj``). The p2p tier never reads device
memory, so the peer's ``GPU`` blocks are not counted; ``CPU`` and ``STORAGE`` are
(:data:`SERVED_MEDIA`). Only the first KV cache group is indexed (``group_idx`` 0 or unset): a
model with several groups is outside this slice.

Hashes. The engine's ``Request.block_hashes`` are bytes; vLLM publishes them as 64-bit ints by
default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, ``maybe_convert_block_hash`` in
``v1/core/kv_cache_utils.py``: the big-endian value masked to 64 bits). :func:`block_key` applies
that conversion to bytes wherever they come from, so an index and its peers agree in either mode.
A CPU tier's event names a chunk by its last block's hash (vLLM's ``OffloadKey``; with
``self_describing_kv_events`` every block of the chunk too), so the caller asks with the chunk
keys of the request (:mod:`kvcompose_cpu_offload.p2p`).

What is dropped, and why:

* a peer's sequence number going backwards (its publisher restarted, counting from 0), its
  connection closing (ZMQ heartbeats find a dead peer within :data:`HEARTBEAT_TIMEOUT_MS`), or
  an ``AllBlocksCleared``: all its entries. ``AllBlocksCleared`` names no medium; vLLM publishes
  it from the device block pool only (``v1/core/block_pool.py``), and a prefix-cache reset with
  ``reset_connector`` also empties the CPU tier without removal events
  (``v1/kv_offload/cpu/manager.py`` ``reset_cache``), so nothing the peer held before it is kept;
* a gap in the sequence is filled from the peer's replay endpoint (vLLM's ROUTER: the start
  sequence as 8 bytes, answered by every buffered batch from it, then ``-1``); a gap the replay
  cannot fill (no replay endpoint, its buffer moved on, no answer within :data:`REPLAY_WAIT_S`)
  also drops the peer's entries, since its removals in the gap are lost;
* a peer whose events stopped for ``silent_s`` is not offered (its entries are kept and offered
  again when it speaks); vLLM publishes nothing when idle, so an idle peer goes quiet too;
* past ``max_blocks`` entries for one peer, the oldest stored are dropped (an ordered map: a
  store moves its hash to the end); memory is then bounded by peers x ``max_blocks``.

Frames come from the network and are not trusted: a frame that is not three parts, a sequence
that is not 8 bytes, a payload over ``max_frame_bytes``, one that is not msgpack, one that is
not vLLM's batch type, a batch of more than ``max_batch_hashes`` hashes, or a hash that is not a
64-bit int or bytes is dropped whole, counted in :attr:`PeerIndex.drops` by (peer, reason), and
said in one log line per peer and reason every :data:`LOG_EVERY_S`; the index thread goes on.
A forged frame can at worst make this engine ask a configured peer for blocks it lacks: the
peer answers miss and the prompt is computed here.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
import zmq.utils.monitor
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from vllm.logger import init_logger

logger = init_logger(f"vllm.{__name__}")

#: The media a peer's p2p tier serves a symmetric lookup from (its CPU tier, and its storage
#: tiers through it); the bit offset of each medium's reference count in an entry.
SERVED_MEDIA: dict[str, int] = {"CPU": 0, "STORAGE": 16}
#: A reference count saturates here (16 bits a medium): a hash announced more often stays held.
MAX_REFS = 0xFFFF
MASK64 = (1 << 64) - 1
#: Defaults: entries a peer (oldest stored dropped past it), seconds of silence before a peer is
#: not offered, bytes of one payload, hashes of one batch.
MAX_BLOCKS = 1_000_000
SILENT_S = 60.0
MAX_FRAME_BYTES = 16 << 20
MAX_BATCH_HASHES = 1 << 18
#: How long one gap fill waits for the peer's replay endpoint.
REPLAY_WAIT_S = 0.5
#: One log line per peer and drop reason this often at most.
LOG_EVERY_S = 10.0
#: ZMQ heartbeats on each SUB: a peer that stops answering them is disconnected (and forgotten).
HEARTBEAT_IVL_MS, HEARTBEAT_TIMEOUT_MS = 1000, 3000
#: vLLM's end-of-replay sequence (``ZmqEventPublisher.END_SEQ``).
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class Dropped(Exception):
    """A frame refused, with the reason counted in :attr:`PeerIndex.drops`."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


def block_key(block_hash: Any) -> int:
    """A block hash as the index keys it: vLLM's int form (``maybe_convert_block_hash`` with
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``) for the engine's bytes, an int in [0, 2**64) as it is."""
    if type(block_hash) is int:
        if not 0 <= block_hash <= MASK64:
            raise Dropped("hash", f"an int hash outside 64 bits: {block_hash}")
        return block_hash
    if isinstance(block_hash, bytes) and 0 < len(block_hash) <= 64:
        return int.from_bytes(block_hash, "big") & MASK64
    raise Dropped("hash", f"a hash of type {type(block_hash).__name__}")


@dataclass(frozen=True)
class Peer:
    """One configured peer: where its p2p tier listens and where it publishes its KV events."""

    host: str
    p2p_port: int
    kv_events: str
    kv_events_replay: str | None = None

    @property
    def name(self) -> str:
        """The peer as logs and :attr:`PeerIndex.drops` name it: its p2p address."""
        return f"{self.host}:{self.p2p_port}"


@dataclass
class _PeerState:
    """What the index knows of one peer; touched under the index's lock."""

    peer: Peer
    sub: zmq.Socket
    monitor: zmq.Socket
    #: hash -> reference counts, 16 bits a served medium; in store order (oldest first)
    blocks: OrderedDict[int, int] = field(default_factory=OrderedDict)
    #: the next sequence number expected; None before the first frame and after a loss
    expected: int | None = None
    #: monotonic time of the last batch applied
    last_event: float | None = None
    replay: zmq.Socket | None = None


class PeerIndex:
    """The blocks each configured peer holds in the media its p2p tier serves, kept from the
    peers' KV events on a thread of its own; :meth:`longest` is safe from any thread;
    :meth:`close` stops the thread and closes the sockets."""

    def __init__(
        self,
        peers: Sequence[Peer],
        *,
        max_blocks: int = MAX_BLOCKS,
        silent_s: float = SILENT_S,
        max_frame_bytes: int = MAX_FRAME_BYTES,
        max_batch_hashes: int = MAX_BATCH_HASHES,
    ) -> None:
        if max_blocks < 1 or silent_s <= 0:
            raise ValueError("max_blocks and silent_s must be positive")
        self.max_blocks, self.silent_s = max_blocks, silent_s
        self.max_frame_bytes, self.max_batch_hashes = max_frame_bytes, max_batch_hashes
        #: frames dropped, by (peer name, reason)
        self.drops: Counter[tuple[str, str]] = Counter()
        #: batches applied, by peer name
        self.applied: Counter[str] = Counter()
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._lock = threading.Lock()
        self._logged: dict[tuple[str, str], float] = {}
        self._ctx = zmq.Context.instance()
        self._peers: list[_PeerState] = []
        for peer in peers:
            sub = self._ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
            sub.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
            monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            sub.connect(peer.kv_events)
            self._peers.append(_PeerState(peer, sub, monitor))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvcompose pool index", daemon=True)
        self._thread.start()

    # -- queries (any thread)

    @property
    def peers(self) -> list[Peer]:
        """The configured peers, in configuration order."""
        return [state.peer for state in self._peers]

    def held(self, peer: Peer) -> int:
        """How many hashes the index holds for ``peer`` (offered or not)."""
        with self._lock:
            return len(self._state(peer).blocks)

    def offered(self, peer: Peer, now: float | None = None) -> bool:
        """Whether ``peer`` may be a source now: it spoke within ``silent_s``."""
        now = time.monotonic() if now is None else now
        with self._lock:
            last = self._state(peer).last_event
        return last is not None and now - last <= self.silent_s

    def longest(self, block_hashes: Iterable[Any]) -> tuple[Peer, int] | None:
        """The offered peer holding the longest prefix of ``block_hashes`` (the engine's bytes or
        their published ints) and that prefix's length in hashes; None when no peer holds the first."""
        keys = [block_key(h) for h in block_hashes]
        now = time.monotonic()
        best: tuple[Peer, int] | None = None
        with self._lock:
            for state in self._peers:
                if state.last_event is None or now - state.last_event > self.silent_s:
                    continue
                n = 0
                for key in keys:
                    if key not in state.blocks:
                        break
                    n += 1
                if n and (best is None or n > best[1]):
                    best = (state.peer, n)
        return best

    def close(self) -> None:
        """Stop the index thread and close its sockets (the shared ZMQ context stays)."""
        self._stop.set()
        self._thread.join(5)
        for state in self._peers:
            state.sub.disable_monitor()
            for sock in (state.monitor, state.sub, state.replay):
                if sock is not None:
                    sock.close(linger=0)

    def _state(self, peer: Peer) -> _PeerState:
        for state in self._peers:
            if state.peer == peer:
                return state
        raise KeyError(peer.name)

    # -- the index thread

    def _run(self) -> None:
        poller = zmq.Poller()
        by_socket: dict[Any, tuple[_PeerState, bool]] = {}
        for state in self._peers:
            poller.register(state.sub, zmq.POLLIN)
            poller.register(state.monitor, zmq.POLLIN)
            by_socket[state.sub] = (state, False)
            by_socket[state.monitor] = (state, True)
        while not self._stop.is_set():
            try:
                ready = poller.poll(100)
                for sock, _ in ready:
                    state, is_monitor = by_socket[sock]
                    if is_monitor:
                        self._on_monitor(state)
                    else:
                        self._on_frames(state, sock.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                continue
            except Exception as exc:  # the index must outlive anything one message does to it
                if self._stop.is_set():
                    return
                logger.warning("kvcompose pool: index error %s: %s; going on", type(exc).__name__, exc)
                time.sleep(0.1)  # a failing socket must not spin the thread

    def _on_monitor(self, state: _PeerState) -> None:
        event = zmq.utils.monitor.recv_monitor_message(state.monitor, zmq.NOBLOCK)
        if event["event"] == zmq.EVENT_DISCONNECTED:
            self._forget(state, "its connection closed")

    def _forget(self, state: _PeerState, why: str) -> None:
        with self._lock:
            held = len(state.blocks)
            state.blocks.clear()
            state.expected = None
        if held:
            logger.info("kvcompose pool: peer %s: %d entries dropped: %s", state.peer.name, held, why)

    def _on_frames(self, state: _PeerState, frames: list[bytes]) -> None:
        """One live message: parsed, its sequence checked (a gap filled, a restart forgotten), applied."""
        try:
            seq, batch = self._parse(frames)
        except Dropped as dropped:
            self._drop(state, dropped)
            return
        expected = state.expected
        if expected is not None and seq < expected:
            self._forget(state, f"its sequence went back from {expected - 1} to {seq} (a restarted publisher)")
            expected = None
        if expected is None:
            # Fresh (a first frame, or after a loss): what the replay buffer holds before it warms the entries.
            for _, earlier in self._replay(state, 0, seq)[0]:
                self._apply(state, earlier)
        elif seq > expected:
            batches, whole = self._replay(state, expected, seq)
            if not whole:
                self._forget(state, f"batches {expected}..{seq - 1} were lost and the replay did not return them")
            for _, missed in batches:
                self._apply(state, missed)
        self._apply(state, batch)
        state.expected = seq + 1

    def _parse(self, frames: list[bytes]) -> tuple[int, KVEventBatch]:
        """``[topic, seq, payload]`` as vLLM's publisher sends it, checked; :class:`Dropped` else."""
        if len(frames) != 3:
            raise Dropped("frames", f"a message of {len(frames)} frames, not vLLM's 3")
        _, seq_bytes, payload = frames
        if len(seq_bytes) != 8:
            raise Dropped("seq", f"a sequence number of {len(seq_bytes)} bytes, not 8")
        if len(payload) > self.max_frame_bytes:
            raise Dropped("size", f"a payload of {len(payload)} bytes, over {self.max_frame_bytes}")
        try:
            batch = self._decoder.decode(payload)
        except msgspec.ValidationError as exc:
            raise Dropped("type", f"not vLLM's KVEventBatch: {exc}") from None
        except msgspec.DecodeError as exc:
            raise Dropped("decode", f"not msgpack: {exc}") from None
        n = 0
        for event in batch.events:
            if isinstance(event, (BlockStored, BlockRemoved)):
                n += len(event.block_hashes)
                if n > self.max_batch_hashes:
                    raise Dropped("huge", f"a batch of more than {self.max_batch_hashes} hashes")
                for h in event.block_hashes:
                    block_key(h)
        return int.from_bytes(seq_bytes, "big"), batch

    def _replay(self, state: _PeerState, start: int, end: int) -> tuple[list[tuple[int, KVEventBatch]], bool]:
        """Batches ``start`` to ``end - 1`` from the peer's replay endpoint, in order, and whether
        they are all there; waits :data:`REPLAY_WAIT_S` at most."""
        if start >= end:
            return [], True
        if state.peer.kv_events_replay is None:
            return [], False
        if state.replay is None:
            state.replay = self._ctx.socket(zmq.DEALER)
            state.replay.setsockopt(zmq.LINGER, 0)
            state.replay.connect(state.peer.kv_events_replay)
        sock = state.replay
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        got: dict[int, KVEventBatch] = {}
        deadline = time.monotonic() + REPLAY_WAIT_S
        done = False
        while not done:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not sock.poll(left_ms):
                break
            message = sock.recv_multipart()
            if len(message) == 4 and message[0] == b"" and message[2] == END_SEQ:
                done = True
                continue
            if len(message) < 1 or message[0] != b"":
                self._drop(state, Dropped("replay", "a replay answer without vLLM's empty delimiter"))
                continue
            seq_bytes = message[2] if len(message) == 4 else b""
            if len(seq_bytes) == 8 and not start <= int.from_bytes(seq_bytes, "big") < end:
                continue  # past the gap: it comes, or came, on the live socket
            try:
                seq, batch = self._parse(message[1:])
            except Dropped as dropped:
                self._drop(state, Dropped("replay " + dropped.reason, dropped.detail))
                continue
            got[seq] = batch
        if not done:
            # Late answers must not mix into the next fill: a fresh socket next time.
            sock.close(linger=0)
            state.replay = None
        batches = sorted(got.items())
        return batches, [s for s, _ in batches] == list(range(start, end))

    def _apply(self, state: _PeerState, batch: KVEventBatch) -> None:
        cleared = False
        with self._lock:
            blocks = state.blocks
            for event in batch.events:
                if isinstance(event, AllBlocksCleared):
                    blocks.clear()
                    cleared = True
                    continue
                shift = SERVED_MEDIA.get(event.medium or "GPU")
                if shift is None or event.group_idx not in (None, 0):
                    continue
                if isinstance(event, BlockStored):
                    for h in event.block_hashes:
                        key = block_key(h)
                        value = blocks.pop(key, 0)
                        if (value >> shift) & MAX_REFS < MAX_REFS:
                            value += 1 << shift
                        blocks[key] = value
                    while len(blocks) > self.max_blocks:
                        blocks.popitem(last=False)
                else:
                    for h in event.block_hashes:
                        key = block_key(h)
                        value = blocks.get(key)
                        if value is None or not (value >> shift) & MAX_REFS:
                            continue
                        value -= 1 << shift
                        if value:
                            blocks[key] = value
                        else:
                            del blocks[key]
            state.last_event = time.monotonic()
        self.applied[state.peer.name] += 1
        if cleared:
            logger.info("kvcompose pool: peer %s cleared its blocks (AllBlocksCleared)", state.peer.name)

    def _drop(self, state: _PeerState, dropped: Dropped) -> None:
        key = (state.peer.name, dropped.reason)
        self.drops[key] += 1
        now = time.monotonic()
        if now - self._logged.get(key, -LOG_EVERY_S) >= LOG_EVERY_S:
            self._logged[key] = now
            logger.warning(
                "kvcompose pool: peer %s: frame dropped (%s): %s [%d so far]",
                state.peer.name,
                dropped.reason,
                dropped.detail,
                self.drops[key],
            )
