"""What the nixl plugin's tests share with tests of compositions that hold a nixl child.

:class:`LateListener` is a real ZMQ side channel (vLLM's handshake protocol: a ROUTER socket
answering each request with the peer's metadata) that answers late or never, in front of a real
prefill instance's side channel or alone.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import zmq


def pulled(prompt: list[int], request_id: str, params: dict[str, Any], block_size: int) -> Any:
    """What a proxy hands a decode instance: a request for ``prompt`` with a prefill's
    ``kv_transfer_params``, two tokens out (a vLLM ``Request``, from the kit's ``make_request``)."""
    from kvcompose.testing.harness import make_request

    return make_request(
        len(prompt),
        block_size=block_size,
        prompt=prompt,
        max_tokens=2,
        request_id=request_id,
        kv_transfer_params=params,
    )


class LateListener:
    """A side channel on 127.0.0.1 that answers its ``n``-th request after ``delays[n]`` seconds
    (``None``: never), by asking ``upstream`` (a real side channel) or, without one, with a
    fixed reply. Runs in a thread until :meth:`close`."""

    def __init__(self, delays: list[float | None], upstream: tuple[str, int] | None = None) -> None:
        self.delays = delays
        self.upstream = upstream
        self.asked = 0
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self.port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        # One thread, one socket, as vLLM's listener; a late answer does not hold up the next request.
        due: list[tuple[float, bytes, bytes]] = []
        while not self._stop.is_set():
            if self._sock.poll(10):
                identity, _, msg = self._sock.recv_multipart()
                delay = self.delays[min(self.asked, len(self.delays) - 1)]
                self.asked += 1
                if delay is not None:
                    due.append((time.monotonic() + delay, identity, msg))
            for entry in [e for e in due if e[0] <= time.monotonic()]:
                due.remove(entry)
                self._sock.send_multipart((entry[1], b"", *self._answer(entry[2])))

    def _answer(self, msg: bytes) -> list[bytes]:
        if self.upstream is None:
            return [b"metadata:" + msg]
        req = self._ctx.socket(zmq.REQ)
        try:
            req.setsockopt(zmq.RCVTIMEO, 10_000)
            req.connect(f"tcp://{self.upstream[0]}:{self.upstream[1]}")
            req.send(msg)
            return list(req.recv_multipart())
        finally:
            req.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close(linger=0)
        self._ctx.term()
