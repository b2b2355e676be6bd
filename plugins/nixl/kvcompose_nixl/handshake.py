"""Asking a prefill instance's side channel again when it does not answer in time.

vLLM's NIXL worker fetches a peer's agent metadata with one ZMQ request to the peer's side
channel and waits 5 s for the answer (``_nixl_handshake``, ``zmq.RCVTIMEO`` 5000 in
``nixl/base_worker.py``). When none comes, every request waiting on that peer fails: under
``kv_load_failure_policy: fail`` the client gets an HTTP 500, and vLLM logs a bare
``zmq.error.Again: Resource temporarily unavailable``. A side channel can be slow without being
dead: on a loaded 2-core host here the peer's listener got the requests 1-6 s late while it
and its engine core sat idle (``docs/e2e.md``, cold start).

:func:`patient` wraps the worker's ``_nixl_handshake`` so that it asks up to ``tries`` times,
each one vLLM's own request and wait, and, when no try is answered, fails with an error that
says which side channel was asked, how often, and what to check. The connector installs it on
its worker (:func:`ask_patiently`); ``handshake_tries`` sets ``tries`` (default 1: vLLM's one
request, with the clearer error).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

import zmq

from kvcompose_nixl import HANDSHAKE_TRY_S

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


def ask_patiently(worker: Any, tries: int) -> None:
    """Make vLLM's NIXL ``worker`` ask a peer's side channel up to ``tries`` times.

    vLLM submits ``self._nixl_handshake`` to its handshake executor by attribute at each new peer
    (``_ensure_handshake``), so the wrapper is set on the instance; the class stays vLLM's."""
    worker._nixl_handshake = patient(worker._nixl_handshake, tries)
