"""What the serving-stack engine tests share: nodes started for one module, stopped in reverse.

The single-engine baseline is not one of them: the session shares one (``conftest.py``).
"""

from __future__ import annotations

import socket
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

from kvcompose.examples import EXAMPLES
from kvcompose_tools.e2e.server import ServerNode
from kvcompose_tools.e2e.spec import EngineSpec


class Nodes:
    """Engines, servers and routers a test module started; :meth:`close` stops them, last first.

    A subclass's constructor records each node in :attr:`nodes` as soon as it exists, before
    waiting for it, so that a constructor failing half-way still has them stopped
    (:func:`module_stack`)."""

    def __init__(self) -> None:
        self.nodes: list[Any] = []

    def prefill_server(self, model: Path, logs: Path, port: int) -> ServerNode:
        """A prefill server of the shipped ``pd-prefill.yaml`` (NIXL side channel on ``port``),
        not started yet: record it, start the module's other servers, then wait for them all."""
        return ServerNode(EngineSpec("prefill", str(model), str(EXAMPLES / "pd-prefill.yaml"), port), logs)

    def close(self) -> None:
        for n in reversed(getattr(self, "nodes", [])):  # none when the constructor failed early
            n.close()


S = TypeVar("S", bound=Nodes)


def module_stack(cls: type[S], prefix: str, *args: Any) -> Iterator[S]:
    """A module fixture's body: ``cls(logs, *args)`` in a temporary log folder, yielded, then
    closed, also when its constructor failed half-way: the instance exists before its
    constructor runs, so the nodes it had recorded are stopped."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        stack = cls.__new__(cls)
        try:
            stack.__init__(Path(tmp), *args)  # type: ignore[misc]
            yield stack
        finally:
            stack.close()


class Listener:
    """A port on 127.0.0.1 that a client names as a prefill's side channel: counts connections."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


def side_channel_answer(port: int, frame: bytes, wait_s: float) -> bytes | None:
    """The first part of what the NIXL side channel on 127.0.0.1:``port`` answers to ``frame``
    (vLLM's protocol: a ROUTER answering ``[payload, perf_counter]``), or None in ``wait_s``."""
    import zmq

    sock = zmq.Context.instance().socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{port}")
        sock.send_multipart([b"", frame])
        if not sock.poll(int(wait_s * 1000)):
            return None
        return bytes(sock.recv_multipart()[1])
    finally:
        sock.close()
