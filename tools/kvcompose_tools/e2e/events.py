"""KV cache events out of a server, through vLLM's own publisher, as a router would receive them.

A server started with ``--kv-events-config`` (:func:`kv_events_config`) publishes, every engine
step, a ``KVEventBatch`` on a ZMQ PUB socket: the device cache's ``BlockStored`` /
``BlockRemoved`` / ``AllBlocksCleared`` (medium ``GPU``) and whatever the connector's
``take_events()`` yields. The composed connector forwards every child's events there (and
gathers its workers' ``get_kv_connector_kv_cache_events``), so the host tier's stores and
evictions leave the engine with medium ``CPU``: a router subscribed to the socket learns which
prefixes an instance holds in host memory after its device cache dropped them.

:class:`EventListener` is such a subscriber, for the tests: it decodes the batches with
vLLM's own types (``vllm.distributed.kv_events``), as vllm-router's ``kv_aware`` policy does
with ``--kv-event-source``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcompose.serving import KV_EVENTS_TOPIC
from kvcompose.serving import kv_events_config as serving_kv_events_config

#: The topic the servers publish on: vLLM's default, none. vllm-router 0.1.17's static
#: ``--kv-event-source`` subscribers take in only batches published without a topic: with
#: ``topic: kv-events`` its ``kv_aware`` received nothing at all (docs/e2e.md, KV events), and
#: its command line has no option to name one.
TOPIC = KV_EVENTS_TOPIC


def kv_events_config(socket: Path) -> dict[str, Any]:
    """vLLM's ``KVEventsConfig`` for a server publishing on the Unix socket ``socket``
    (:func:`kvcompose.serving.kv_events_config`; ``deploy/kubernetes/``'s prefills: ``tcp://*:5557``).

    vLLM's publisher binds only wildcard TCP endpoints (``tcp://*:PORT``, every interface) and
    ``ipc://``/``inproc://`` ones, and *connects* to any other (``tcp://127.0.0.1:PORT`` would
    need the subscriber to bind, so one subscriber at most); an ``ipc://`` socket is bound, local
    to this host, and any number of subscribers (a router, :class:`EventListener`) connect to it.
    """
    return serving_kv_events_config(f"ipc://{socket}")


@dataclass
class Stored:
    """One stored block as published: its hash, medium (``GPU``, ``CPU``) and token ids."""

    block_hash: Any
    medium: str | None
    token_ids: list[int] = field(default_factory=list)


class EventListener:
    """Subscribes to one server's KV events (``endpoint``: the config's, ``ipc://PATH``) on a
    thread of its own, from now on; :meth:`close` stops it."""

    def __init__(self, endpoint: str) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self.endpoint = endpoint
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
        self._sock.setsockopt(zmq.RCVTIMEO, 100)
        self._sock.connect(endpoint)
        self._lock = threading.Lock()
        self._events: list[Any] = []
        self._payloads: list[bytes] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kv-events {endpoint}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import zmq

        while not self._stop.is_set():
            try:
                _topic, _seq, payload = self._sock.recv_multipart()
            except zmq.Again:
                continue
            batch = self._decoder.decode(payload)
            with self._lock:
                self._events.extend(batch.events)
                self._payloads.append(payload)

    def events(self) -> list[Any]:
        """Every event received so far, in order."""
        with self._lock:
            return list(self._events)

    def payloads(self) -> list[bytes]:
        """Every batch received so far, as published (msgpack), in order: what a recording keeps
        (:func:`kvcompose_tools.e2e.kv_replay.save_recording`)."""
        with self._lock:
            return list(self._payloads)

    def stored(self) -> Iterator[Stored]:
        """Each stored block, one per hash (a ``BlockStored`` carries several)."""
        from vllm.distributed.kv_events import BlockStored

        for e in self.events():
            if isinstance(e, BlockStored):
                size = e.block_size
                for i, h in enumerate(e.block_hashes):
                    yield Stored(h, e.medium, list(e.token_ids[i * size : (i + 1) * size]))

    def removed(self, medium: str) -> int:
        """Blocks removed from ``medium`` so far."""
        from vllm.distributed.kv_events import BlockRemoved

        return sum(len(e.block_hashes) for e in self.events() if isinstance(e, BlockRemoved) and e.medium == medium)

    def cleared(self) -> int:
        """``AllBlocksCleared`` events so far (one per device prefix-cache reset)."""
        from vllm.distributed.kv_events import AllBlocksCleared

        return sum(isinstance(e, AllBlocksCleared) for e in self.events())

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close(linger=0)
