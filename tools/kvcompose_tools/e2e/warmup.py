"""Warm prefill/decode pairs before traffic: one small P/D request per pair.

A fresh pair's first P/D request pays what no later one does: the NIXL handshake (the decode
fetches the prefill's agent metadata over the side channel and registers its memory), the first
UCX transfer between the two agents, and each engine's first pass over a request of that kind
(``docs/performance.md``, cold start). :func:`warm` sends every ``(prefill, decode)`` pair one
P/D request of :data:`WARMUP_TOKENS` new tokens (the proxy flow: prefill with
``do_remote_decode`` and one token, then decode with prefill's ``kv_transfer_params``), so that a
user's first request does not. Run it after a deploy, a restart or a scale-out, before the
router sends traffic to the new instances (``kvcompose warmup``); in an xPyD deployment it
warms all N x M pairs.
"""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvcompose_tools.e2e.flow import Engine, pd_request, token_prompt
from kvcompose_tools.e2e.processes import CALL_TIMEOUT_S, NodeError
from kvcompose_tools.e2e.spec import BLOCK_SIZE

if TYPE_CHECKING:
    from kvcompose_tools.e2e.server import ServerClient

#: Two whole blocks and one more token: the decode pulls the KV of all of them (two blocks and a
#: partial one) and computes none.
WARMUP_TOKENS = 2 * BLOCK_SIZE + 1


@dataclass(frozen=True)
class Warmed:
    """One pair's warm-up request: its decode TTFT and the bytes NIXL moved."""

    prefill: str
    decode: str
    ttft_s: float
    nixl_bytes: int


def warm(
    prefills: Sequence[Engine],
    decodes: Sequence[Engine],
    echo: Callable[[str], None] | None = None,
    seed: int = 9_000,
) -> list[Warmed]:
    """One P/D request through every ``(prefill, decode)`` pair, each with a prompt of its own (no
    prefix cache serves it). Raises what the flow raises when a pair does not answer, and a
    :class:`NodeError` naming the pair for an answer that is not what a vLLM server gives."""
    out = []
    for i, p in enumerate(prefills):
        for j, d in enumerate(decodes):
            prompt = token_prompt(seed + 100 * i + j, WARMUP_TOKENS)
            try:
                served = pd_request(p, d, prompt, 1, label="warm-up", children=())
            except (LookupError, TypeError, ValueError) as exc:  # a field missing or of another kind
                raise NodeError(
                    f"{p.name} -> {d.name}: the warm-up request got an answer a vLLM server does not give "
                    f"({type(exc).__name__}: {exc})"
                ) from exc
            w = Warmed(p.name, d.name, served.ttft_s, served.nixl_bytes)
            out.append(w)
            if echo is not None:
                ttft = f"decode TTFT {w.ttft_s * 1e3:.0f} ms"
                echo(f"{w.prefill} -> {w.decode}: warm ({ttft}, {w.nixl_bytes:,} B over NIXL)")
    return out


#: How a server's URL is written, for the errors.
URL_FORM = "give it as http://HOST:PORT"


def check_url(url: str) -> str:
    """``url`` without a trailing slash, or a :class:`ValueError` saying what is wrong with it (no
    ``http://`` or ``https://``, no host, a port that is not one)."""
    shown = repr(url) if not url or url != url.strip() else url
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port  # reads it: a port that is no number or out of range raises
    except ValueError as exc:
        raise ValueError(f"{shown}: not a server URL ({exc}; {URL_FORM})") from None
    if parts.scheme not in ("http", "https"):
        said = f"scheme {parts.scheme!r}" if "://" in url else "no http://"
        raise ValueError(f"{shown}: not a server URL ({said}; {URL_FORM})")
    if not parts.hostname:
        raise ValueError(f"{shown}: not a server URL (no host; {URL_FORM})")
    if port == 0:
        raise ValueError(f"{shown}: not a server URL (port 0; {URL_FORM})")
    if any(c.isspace() or not c.isprintable() for c in url):
        raise ValueError(f"{shown}: not a server URL (spaces or control characters in it; {URL_FORM})")
    return url.rstrip("/")


def _excerpt(raw: bytes) -> str:
    return repr(raw[:200]) + (f" ... ({len(raw):,} bytes)" if len(raw) > 200 else "")


def connect(url: str, timeout: float = CALL_TIMEOUT_S) -> ServerClient:
    """A :class:`~kvcompose_tools.e2e.server.ServerClient` of the vLLM server at ``url``: a URL that is no
    server's, a server that does not answer, or an answer that is not vLLM's (``/v1/models`` not a
    JSON model list, ``/metrics`` not Prometheus text) is a :class:`NodeError` naming the URL and
    what was wrong."""
    from kvcompose_tools.e2e.server import HttpClient, ServerClient

    try:
        url = check_url(url)
    except ValueError as exc:
        raise NodeError(str(exc)) from None
    raw = HttpClient(url, url, lambda: f"server at {url}").request("GET", "/v1/models", timeout=timeout)
    try:
        answer = json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: JSON nested past Python's stack
        raise NodeError(f"{url}: GET /v1/models answered no JSON: {_excerpt(raw)}; is it a vLLM server?") from None
    models = answer.get("data") if isinstance(answer, dict) else None
    if not isinstance(models, list) or not all(isinstance(m, dict) and isinstance(m.get("id"), str) for m in models):
        raise NodeError(
            f"{url}: GET /v1/models answered no model list (a JSON object whose 'data' lists objects with an "
            f"'id'): {_excerpt(raw)}; is it a vLLM server?"
        )
    try:
        return ServerClient.at(url, timeout)
    except (ValueError, LookupError, TypeError) as exc:  # what /metrics answered (/v1/models was read above)
        raise NodeError(
            f"{url}: GET /metrics answered no Prometheus text ({type(exc).__name__}: {exc}); is it a vLLM server?"
        ) from None
