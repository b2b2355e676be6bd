"""Asking a prefill instance's side channel again when it does not answer in time.

vLLM's NIXL worker fetches a peer's agent metadata with one ZMQ request to the peer's side
channel and waits 5 s for the answer (``_nixl_handshake``, ``zmq.RCVTIMEO`` 5000 in
``nixl/base_worker.py``). When none comes, every request waiting on that peer fails: under
``kv_load_failure_policy: fail`` the client gets an HTTP 500, and vLLM logs a bare
``zmq.error.Again: Resource temporarily unavailable``. A side channel can be slow without being
dead: on a loaded host its listener can get the requests late while it and its engine core sit
idle (docs/e2e.md, "Cold start: the first P/D request of a new pair").

:func:`patient` asks up to ``tries`` times, each one request and vLLM's wait, and, when no try
is answered, fails with an error that says which side channel was asked, how often, and what to
check. ``handshake_tries`` sets ``tries`` (default 1: vLLM's one request, with the clearer error).

The waiting happens off vLLM's handshake thread. vLLM runs every handshake on one executor
thread (NIXL's agent calls are not thread-safe), so one silent peer would hold the handshakes to
every healthy peer for ``tries`` x 5 s. :class:`WaitingExecutor` takes that executor's place: it
first waits for the peer's side channel to answer (:func:`ask_side_channel`, ZMQ only, on a
thread per peer), and only then hands vLLM's ``_nixl_handshake`` to vLLM's thread, where the
peer, just heard from, answers at once. The connector installs both on its worker
(:func:`kvcompose_nixl.patches.ask_patiently`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any, TypeVar

import msgspec
import zmq

from kvcompose_nixl import HANDSHAKE_TRY_S
from kvcompose_nixl.trust import Refused

log = logging.getLogger("kvcompose.nixl")

T = TypeVar("T")


class HandshakeTimeout(TimeoutError):
    """No try of a NIXL handshake was answered."""


def patient(once: Callable[..., T], tries: int, try_s: float = HANDSHAKE_TRY_S) -> Callable[..., T]:
    """``once`` (a handshake taking the peer's ``host`` and ``port`` first, raising ``zmq.Again``
    when its wait ends unanswered) asked up to ``tries`` times; :class:`HandshakeTimeout` after
    the last. Any other error is raised at once: a peer that answers wrongly is not slow."""
    if tries < 1:
        raise ValueError(f"tries must be at least 1, not {tries}")

    def handshake(host: str, port: int, *args: Any, **kwargs: Any) -> T:
        start = time.monotonic()
        for attempt in range(1, tries + 1):
            try:
                return once(host, port, *args, **kwargs)
            except zmq.Again:
                if attempt < tries:
                    log.warning(
                        "NIXL handshake: the side channel at %s:%s did not answer in %g s (try %d of %d); asking again",
                        host,
                        port,
                        try_s,
                        attempt,
                        tries,
                    )
        waited = time.monotonic() - start
        raise HandshakeTimeout(
            f"NIXL handshake: the side channel at {host}:{port} did not answer in {tries} "
            f"{'try' if tries == 1 else 'tries'} of {try_s:g} s ({waited:.1f} s); check that the "
            "prefill instance is up, that this host reaches its side_channel_host and "
            "side_channel_port, and that the instance is not short of CPU (a busy instance answers "
            "late: the nixl option handshake_tries asks again)"
        ) from None

    return handshake


#: vLLM's side-channel request (``GET_META_MSG`` in ``nixl/metadata.py``), for rank (0, 0),
#: which every prefill instance answers.
_META_REQUEST = msgspec.msgpack.encode((b"get_meta_msg", 0, 0))


def ask_side_channel(host: str, port: int, wait_s: float = HANDSHAKE_TRY_S) -> None:
    """One metadata request to the side channel at ``host:port``; ``zmq.Again`` when no answer
    comes in ``wait_s``. The answer is dropped: only that the peer answers matters here."""
    sock = zmq.Context.instance().socket(zmq.REQ)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, int(wait_s * 1000))
        sock.connect(f"tcp://{host}:{port}")
        sock.send(_META_REQUEST)
        sock.recv_multipart()
    finally:
        sock.close()


class WaitingExecutor(Executor):
    """vLLM's one-thread handshake executor behind a wait, on threads of its own, for each
    peer's side channel to answer: a silent peer holds only its own handshake.

    :param inner: vLLM's executor, which runs every handshake (NIXL's agent calls) on one thread.
    :param wait: asks ``(host, port)`` until the side channel answers; raises when it never does.
    :param threads: peers waited for at once.
    """

    def __init__(self, inner: Executor, wait: Callable[[str, int], None], threads: int = 8) -> None:
        self._inner = inner
        self._wait = wait
        self._waits = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvcompose-nixl-side-channel")

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        """``fn(host, port, ...)``, vLLM's handshake, on vLLM's thread once ``host:port`` answered."""
        host, port = args[0], args[1]
        outer: Future[T] = Future()

        def wait_then_handshake() -> None:
            try:
                self._wait(host, port)
                inner = self._inner.submit(fn, *args, **kwargs)
            except BaseException as exc:  # the peer never answered, or vLLM shut its executor
                outer.set_exception(exc)
                return
            inner.add_done_callback(lambda done: _settle(outer, done))

        self._waits.submit(wait_then_handshake)
        return outer

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._waits.shutdown(wait=False, cancel_futures=True)
        self._inner.shutdown(wait=wait, cancel_futures=cancel_futures)


def _settle(outer: Future[T], done: Future[T]) -> None:
    exc = done.exception()
    if exc is not None:
        outer.set_exception(exc)
    else:
        outer.set_result(done.result())


def only_peers(handshake: Callable[..., T], allowed: Callable[[str, int], bool]) -> Callable[..., T]:
    """``handshake`` (taking the peer's ``host`` and ``port`` first), refused before it connects
    to a side channel that ``allowed`` does not list."""

    def checked(host: str, port: int, *args: Any, **kwargs: Any) -> T:
        if not allowed(host, port):
            raise Refused("peer", f"NIXL handshake: the side channel {host}:{port} is not among this engine's peers")
        return handshake(host, port, *args, **kwargs)

    return checked
