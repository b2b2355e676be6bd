"""The prefill's side channel keeps answering, and what it answers is useless without the key.

vLLM's handshake listener (``_nixl_handshake_listener`` in ``nixl/base_scheduler.py``) is a ZMQ
ROUTER on a thread of the scheduler's process that decodes every frame with
``msgspec.msgpack.decode`` unguarded: one malformed, short or unknown frame raises, the thread
ends, and no decode started after it can handshake again (vLLM #54757). :func:`listener` is the
same protocol (``(b"get_meta_msg", pp_rank, tp_rank)`` in, ``[payload, perf_counter]`` out) with
every frame checked: a frame that does not parse, an unknown message, a rank it does not serve
or a frame over :data:`MAX_FRAME` bytes (ZMQ drops the connection before reading it) is
dropped, counted and logged once per kind; the listener goes on answering.

The payload it answers with holds the NIXL agent metadata, which is what a peer needs to read
this engine's registered memory. With a deployment key the worker seals it (:func:`sealing_publish`:
AES-GCM, :meth:`kvcompose_nixl.trust.Keyring.seal`) before vLLM puts it in that payload, and a
decode's worker opens it before NIXL loads it (:func:`checked_load`): the listener may answer
anyone, only a key holder can use the answer. :mod:`kvcompose_nixl.patches` installs the
listener and both on vLLM's objects.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
from vllm.utils.network_utils import make_zmq_path

from kvcompose_nixl.trust import Keyring, Refused, drop, is_sealed

log = logging.getLogger("kvcompose.nixl")

#: vLLM's side-channel request (``GET_META_MSG`` in ``nixl/metadata.py``).
GET_META_MSG = b"get_meta_msg"
#: The largest frame the listener reads: a request is about 20 bytes.
MAX_FRAME = 1024
_request = msgspec.msgpack.Decoder(tuple[bytes, int, int])


def listener(
    encoded_data: dict[tuple[int, int], Any],
    ready_event: threading.Event,
    stop_event: threading.Event,
    host: str,
    port: int,
) -> None:
    """vLLM's handshake listener, with vLLM's arguments, that no frame can stop."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    try:
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME)
        sock.setsockopt(zmq.RCVTIMEO, 1000)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(make_zmq_path("tcp", host, port))
        ready_event.set()
        while not stop_event.is_set():
            try:
                frames = sock.recv_multipart()
            except zmq.Again:
                continue
            reply = _answer(frames, encoded_data)
            if reply is not None:
                try:
                    sock.send_multipart(reply, flags=zmq.NOBLOCK)
                except zmq.ZMQError as exc:  # the asker went away
                    drop("side-channel reply", str(exc))
    finally:
        ready_event.set()  # a bind that failed must not leave vLLM waiting forever
        sock.close(0)
        ctx.term()


def _answer(frames: list[bytes], encoded_data: dict[tuple[int, int], Any]) -> list[bytes] | None:
    """The reply to one request, or None (dropped) for anything but vLLM's request for a rank
    this engine serves."""
    if len(frames) != 3 or frames[1] != b"":
        drop("side-channel frame of the wrong shape", f"{len(frames)} parts")
        return None
    identity, _, msg = frames
    try:
        kind, pp_rank, tp_rank = _request.decode(msg)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        drop("side-channel frame that does not parse", str(exc)[:80])
        return None
    if kind != GET_META_MSG:
        drop("side-channel message of an unknown kind", repr(kind[:20]))
        return None
    payload = encoded_data.get((pp_rank, tp_rank))
    if payload is None:
        drop("side-channel request for a rank this engine does not serve", f"pp {pp_rank}, tp {tp_rank}")
        return None
    # vLLM's decode estimates the clock offset from this perf_counter (same process as the leases).
    return [identity, b"", payload, msgspec.msgpack.encode(time.perf_counter())]


def sealing_publish(publish: Callable[..., bytes], keys: Keyring | None) -> Callable[..., bytes]:
    """The agent's ``get_agent_metadata`` (``publish``) whose metadata is sealed with ``keys``
    (as is without keys); :func:`kvcompose_nixl.patches.seal_agent_metadata` installs it."""

    def get_agent_metadata(*args: Any, **kwargs: Any) -> bytes:
        data = publish(*args, **kwargs)
        return keys.seal(data) if keys is not None else data

    return get_agent_metadata


def checked_load(load: Callable[..., Any], keys: Keyring | None, accept_unsealed: bool) -> Callable[..., Any]:
    """The agent's ``add_remote_agent`` (``load``) for peer metadata that opens with ``keys``, or
    is unsealed and ``accept_unsealed``; without keys, sealed metadata is refused by name (NIXL
    would fail on it with a parse error). :func:`kvcompose_nixl.patches.seal_agent_metadata`
    installs it."""

    def add_remote_agent(metadata: bytes, *args: Any, **kwargs: Any) -> Any:
        if is_sealed(metadata):
            if keys is None:
                raise Refused("signature", "the peer's NIXL agent metadata is sealed with a key; this engine has none")
            metadata = keys.open(metadata)
        elif keys is not None and not accept_unsealed:
            raise Refused(
                "unsigned",
                "the peer's NIXL agent metadata is not sealed with the deployment key (a peer without the key, or "
                "vLLM's own NixlConnector: accept_unsigned: true takes it)",
            )
        return load(metadata, *args, **kwargs)

    return add_remote_agent
