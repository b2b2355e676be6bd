"""vllm-router's own service discovery in P/D mode: how a server joins a running router.

vllm-router 0.1.17 in P/D mode takes no worker over HTTP (``/add_worker`` and ``POST /workers``
answer ``PD router requires specific add_prefill_server or add_decode_server methods``). Started
with ``--vllm-discovery-address HOST:PORT`` it binds a ZMQ socket there and routes to the servers
that register on it, and to no others: the ``--prefill``/``--decode`` lists are then ignored
(``src/routers/http/vllm_service_discovery.rs``). A registration is one msgpack map, ``type``
(``P`` or ``D``), ``http_address`` (``host:port``) and ``zmq_address`` (read by the P2P-NCCL and
MoRI-IO connectors; NIXL's P/D does not use it). The router drops a server it has not heard from
for about five seconds (``expired`` in its log), so :class:`Registrar` sends every registration
again each :data:`HEARTBEAT_S`.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from kvcompose_tools.e2e.processes import NodeError

#: How often each registration is sent again (the router expires one after about 5 s).
HEARTBEAT_S = 1.0
#: How long :meth:`Registrar.wait_added` waits for the router's log to show a registration.
ADDED_TIMEOUT_S = 30.0
KINDS = {"prefill": ("P", "Prefill"), "decode": ("D", "Decode")}


def router_flags(address: str) -> list[str]:
    """The router flag that turns its discovery on, on ``address`` (``host:port``)."""
    return ["--vllm-discovery-address", address]


class Registrar:
    """Registers servers with a router's discovery socket (``tcp://address``) from a thread, each
    :data:`HEARTBEAT_S`, until :meth:`close`. :meth:`add` registers one more at any time."""

    def __init__(self, address: str) -> None:
        import zmq

        self._ctx = zmq.Context()
        self._socket = self._ctx.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(f"tcp://{address}")
        self._servers: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="router-registrar", daemon=True)
        self._thread.start()

    def add(self, kind: str, url: str) -> None:
        """Register the server at ``url`` (``http://host:port``) as a ``kind`` (``prefill`` or
        ``decode``) from now on; the router routes to it within a heartbeat."""
        if kind not in KINDS:
            raise ValueError(f"registration kind {kind!r}: one of {', '.join(KINDS)}")
        with self._lock:
            self._servers.append((kind, url.removeprefix("http://")))
        self._send()

    def _send(self) -> None:
        import msgspec

        with self._lock:
            for kind, address in self._servers:
                body = {"type": KINDS[kind][0], "http_address": address, "zmq_address": address}
                self._socket.send(msgspec.msgpack.encode(body))

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            self._send()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._socket.close()
        self._ctx.term()


def wait_added(log: Path, kind: str, url: str, timeout: float = ADDED_TIMEOUT_S) -> None:
    """Until the router's ``log`` says it added the ``kind`` server at ``url``; a
    :class:`~kvcompose_tools.e2e.processes.NodeError` naming the log after ``timeout`` seconds."""
    line = f"Add {KINDS[kind][1]} [HTTP:{url.removeprefix('http://')},"
    deadline = time.monotonic() + timeout
    while line not in log.read_text(errors="replace"):
        if time.monotonic() >= deadline:
            raise NodeError(f"the router did not add {kind} {url} within {timeout:.0f} s (see {log})")
        time.sleep(0.1)
