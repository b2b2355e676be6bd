"""Registering servers with vllm-router's own service discovery: how a server joins a running router.

vllm-router 0.1.17 in P/D mode takes no worker over HTTP (``POST /workers`` answers ``PD router
requires specific add_prefill_server or add_decode_server methods``). Started with
``--vllm-discovery-address HOST:PORT`` it binds a ZMQ socket there and routes to the servers
that register on it, and to no others: its ``--prefill``/``--decode`` lists are then ignored
(``src/routers/http/vllm_service_discovery.rs``). A registration is one msgpack map: ``type``
(``P`` or ``D``), ``http_address`` (``host:port``) and ``zmq_address`` (read by the P2P-NCCL and
MoRI-IO connectors; NIXL's P/D does not use it, so it repeats the HTTP address). The router
drops a server it has not heard from for about five seconds (``expired`` in its log), so
:class:`Registrar` sends each registration again every :data:`HEARTBEAT_S`.

vLLM's NixlConnector registers nowhere; ``kvcompose register`` (a sidecar beside each server)
does it with a :class:`Registrar` whose heartbeat asks the server's ``/health`` first
(:func:`healthy`): a server still loading its model, or one whose engine died, is not
registered, and the router drops it within its expiry, sooner than its own health checks
(60 s and three failures by default).
"""

from __future__ import annotations

import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable

#: How often each registration is sent again (the router expires one after about 5 s).
HEARTBEAT_S = 1.0
#: How long one ``/health`` question may take before the server counts as unhealthy.
HEALTH_TIMEOUT_S = 0.8
#: The registration kinds and the router's ``type`` for each.
KINDS = {"prefill": "P", "decode": "D"}


def host_port(text: str, what: str) -> str:
    """``text`` as ``host:port`` (an ``http://`` URL's, or the pair itself); ValueError naming
    ``what`` and why otherwise."""
    parsed = urllib.parse.urlsplit(text if "//" in text else f"//{text}")
    if parsed.scheme not in ("", "http") or parsed.path not in ("", "/") or parsed.query or parsed.fragment:
        raise ValueError(f"{what} {text!r}: give HOST:PORT or http://HOST:PORT")
    if "@" in parsed.netloc or any(c.isspace() for c in parsed.netloc):  # the router would be given another host
        raise ValueError(f"{what} {text!r}: give HOST:PORT or http://HOST:PORT, with no user or spaces")
    try:
        port = parsed.port
    except ValueError:
        port = None
    if not parsed.hostname or port is None or not 0 < port < 65536:
        raise ValueError(f"{what} {text!r}: give HOST:PORT or http://HOST:PORT with a port from 1 to 65535")
    host = f"[{parsed.hostname}]" if ":" in parsed.hostname else parsed.hostname
    return f"{host}:{port}"


def registration(kind: str, address: str) -> dict[str, str]:
    """The map the router reads for the ``kind`` server at ``address`` (``host:port``)."""
    if kind not in KINDS:
        raise ValueError(f"registration kind {kind!r}: one of {', '.join(KINDS)}")
    return {"type": KINDS[kind], "http_address": address, "zmq_address": address}


def healthy(address: str, timeout: float = HEALTH_TIMEOUT_S) -> bool:
    """Whether the server at ``address`` answers ``GET /health`` with 200 within ``timeout``."""
    try:
        with urllib.request.urlopen(f"http://{address}/health", timeout=timeout) as answer:
            return answer.status == 200
    except (OSError, urllib.error.HTTPError):
        return False


class Registrar:
    """Registers servers with a router's discovery socket (``address``: ``host:port``) from a
    thread, every :data:`HEARTBEAT_S`, until :meth:`close`. With ``health`` (:func:`healthy`, or
    any ``address -> bool``), each heartbeat registers only the servers it answers True for;
    :attr:`registered` then says which the last heartbeat sent, and ``on_change`` is told each
    server that changes (``kind``, ``address``, now registered or not)."""

    def __init__(
        self,
        address: str,
        *,
        health: Callable[[str], bool] | None = None,
        on_change: Callable[[str, str, bool], None] | None = None,
        heartbeat_s: float = HEARTBEAT_S,
    ) -> None:
        import msgspec
        import zmq

        self._encode = msgspec.msgpack.encode
        self._health, self._on_change, self._heartbeat_s = health, on_change, heartbeat_s
        self._ctx = zmq.Context()
        self._socket = self._ctx.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(f"tcp://{host_port(address, 'router discovery address')}")
        self._servers: list[tuple[str, str]] = []
        #: (kind, address) -> whether the last heartbeat registered it
        self.registered: dict[tuple[str, str], bool] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="router-registrar", daemon=True)
        self._thread.start()

    def add(self, kind: str, url: str) -> None:
        """Register the server at ``url`` (``http://host:port`` or ``host:port``) as a ``kind``
        (``prefill`` or ``decode``) from now on; the router routes to it within a heartbeat."""
        server = (kind, host_port(url, f"{kind} server"))
        registration(*server)  # the kind checked before it is kept
        with self._lock:
            self._servers.append(server)
        self._send([server])

    def _send(self, servers: list[tuple[str, str]]) -> None:
        for kind, address in servers:
            ok = self._health is None or self._health(address)
            if ok:
                with self._lock:  # one sender at a time: a ZMQ socket is not thread-safe
                    self._socket.send(self._encode(registration(kind, address)))
            if self.registered.get((kind, address)) is not ok:
                self.registered[(kind, address)] = ok
                if self._on_change is not None:
                    self._on_change(kind, address, ok)

    def _beat(self) -> None:
        while not self._stop.wait(self._heartbeat_s):
            with self._lock:
                servers = list(self._servers)
            self._send(servers)

    def close(self) -> None:
        """Stop the heartbeats; the router drops the servers within its expiry."""
        self._stop.set()
        self._thread.join()
        self._socket.close()
        self._ctx.term()
