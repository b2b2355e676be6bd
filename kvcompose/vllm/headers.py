"""A router's choice of source, from its header into the request's ``kv_transfer_params``.

llm-d's scheduler names the instance that holds a prompt's prefix in a header,
``x-kv-cache-source-host-port: HOST:PORT``, and its routing sidecar turns it into vLLM's p2p tier's
``remote_kv_source`` role. vllm-router and vLLM's own server do neither. :class:`SourceHeader` is
an ASGI middleware for vLLM's OpenAI-compatible server that does the sidecar's mapping::

    python -m vllm.entrypoints.openai.api_server ... --middleware kvcompose.vllm.headers.SourceHeader

On a ``POST`` to a completion route carrying the header, the JSON body's ``kv_transfer_params``
gets ``remote_kv_source: {kv_request_id: <fresh>, remote_host: HOST, remote_port: PORT}`` (PORT:
the source's p2p socket, what the role names), unless the params hold a p2p role already or are
a decode leg (``do_remote_prefill``: its KV comes from its prefill). Every other request passes
untouched.

The header is client input like the body: the composition's p2p class takes the source only if it
names a peer of its pool, and refuses it as ``peer`` otherwise (:mod:`kvcompose_cpu_offload.p2p`).
A header that is not one ``HOST:PORT`` is answered 400 with the header's name and why; a body
that is not a JSON object passes untouched (vLLM answers it); a body over :data:`MAX_BODY_BYTES`
is answered 413, never read whole into memory.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from kvcompose.transfer_params import MAX_HOST_CHARS, P2P_ROLE_KEYS, P2P_SOURCE

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: llm-d's header (its routing sidecar's ``x-kv-cache-source-host-port``), lower case as ASGI has it.
HEADER = b"x-kv-cache-source-host-port"
#: The routes whose body carries ``kv_transfer_params`` (vLLM's completion routes).
ROUTES = ("/v1/completions", "/v1/chat/completions")
#: The largest body this middleware reads to rewrite (a prompt of a million tokens as JSON ids
#: is about 7 MiB).
MAX_BODY_BYTES = 64 * 1024 * 1024
#: Prefix of the ids it gives (the tier needs nothing of them but uniqueness).
REQUEST_ID_PREFIX = "kvcompose-header-"


class BadHeader(ValueError):
    """The header's value is not one ``HOST:PORT``."""


def parse_source(value: bytes) -> tuple[str, int]:
    """``(host, port)`` of the header's value; :class:`BadHeader` saying why for another."""
    try:
        text = value.decode("ascii").strip()
    except UnicodeDecodeError as exc:
        raise BadHeader("not ASCII") from exc
    host, sep, port = text.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")  # an IPv6 address in brackets
    if not sep or not host or len(host) > MAX_HOST_CHARS or any(c.isspace() or c in ",/@" for c in host):
        raise BadHeader(f"{text[:80]!r} is not HOST:PORT")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise BadHeader(f"{text[:80]!r}: the port is not a whole number from 1 to 65535")
    return host, int(port)


def with_source(body: Any, host: str, port: int) -> Any | None:
    """``body`` with the source role in its ``kv_transfer_params``; None where it stays as it is
    (not a JSON object, params that are not a mapping, a p2p role already, a decode leg)."""
    if not isinstance(body, dict):
        return None
    params = body.get("kv_transfer_params")
    if params is None:
        params = {}
    if not isinstance(params, dict) or params.get("do_remote_prefill") is True:
        return None
    if any(k in params for k in P2P_ROLE_KEYS):
        return None
    role = {"kv_request_id": REQUEST_ID_PREFIX + secrets.token_hex(16), "remote_host": host, "remote_port": port}
    return {**body, "kv_transfer_params": {**params, P2P_SOURCE: role}}


class SourceHeader:
    """vLLM's server's ASGI app, with :data:`HEADER` mapped onto ``remote_kv_source`` (module doc)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") not in ROUTES:
            await self.app(scope, receive, send)
            return
        values = [v for k, v in scope.get("headers", ()) if k.lower() == HEADER]
        if not values:
            await self.app(scope, receive, send)
            return
        try:
            if len(values) > 1:
                raise BadHeader("given more than once")
            host, port = parse_source(values[0])
        except BadHeader as exc:
            await _error(send, 400, f"header {HEADER.decode()}: {exc}")
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away: nothing to serve
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                await _error(send, 413, f"a body with header {HEADER.decode()} over {MAX_BODY_BYTES} bytes")
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        raw = b"".join(chunks)
        try:
            rewritten = with_source(json.loads(raw), host, port)
        except ValueError:  # not JSON: vLLM answers it
            rewritten = None
        if rewritten is not None:
            raw = json.dumps(rewritten).encode()
            headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
            scope = {**scope, "headers": [*headers, (b"content-length", str(len(raw)).encode())]}
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": raw, "more_body": False}
            return await receive()  # after the body: the disconnect, when it comes

        await self.app(scope, replay, send)


async def _error(send: Send, status: int, message: str) -> None:
    body = json.dumps({"error": {"message": message, "type": "BadRequestError", "code": status}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
