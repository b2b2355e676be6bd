"""One ``/v1/completions`` request over HTTP and its answer, streamed or not: what the soak's
clients, the benchmarks' clients and the multi-turn probes send (:func:`send`).

A streamed answer is read as vLLM's OpenAI server writes it (server-sent events: ``data: {json}``
lines, then ``data: [DONE]``) by :func:`read_stream`, which tells a served answer from each way a
server can fail one (:data:`OUTCOMES`). The chat client (:func:`kvcompose_tools.e2e.load.stream_chat`)
reads chat chunks, another shape, with the same :func:`stream_failure`.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple
from urllib.parse import urlsplit

#: answered: 200 with tokens (streamed: through ``data: [DONE]``). http-error: an error status,
#: or an error event or no token in the stream (a clean failure). dropped: the connection failed
#: without an HTTP answer. cut-off: the stream began (HTTP 200) and ended before ``[DONE]``: the
#: router has nothing else to tell a client whose server died mid-answer. hung: no answer within
#: the timeout. hung-up: the client closed the connection on purpose (the request is aborted).
OUTCOMES = ("answered", "http-error", "dropped", "cut-off", "hung", "hung-up")
#: A hang guard: every request here is answered in seconds when the stack is healthy.
REQUEST_TIMEOUT_S = 120.0
#: A streamed answer's fields that are joined over its chunks; the others are kept from the last.
JOINED = ("text", "token_ids", "logprobs")


class Reply(NamedTuple):
    """What one request got back: its outcome (one of :data:`OUTCOMES`), what went wrong, the
    answer (a ``/v1/completions`` body; a stream's chunks joined into one) and, streamed, the
    seconds until its first token."""

    kind: str
    detail: str
    answer: dict[str, Any] | None
    ttft_s: float | None = None

    @property
    def token_ids(self) -> list[int]:
        """The answer's token ids (none when it was not answered)."""
        if self.answer is None:
            return []
        return [int(t) for choice in self.answer.get("choices") or [] for t in choice.get("token_ids") or []]


def address(url: str) -> tuple[str, int]:
    """``(host, port)`` of a server's base URL (``http://127.0.0.1:8000``), what :func:`send` takes."""
    parts = urlsplit(url)
    if parts.hostname is None or parts.port is None:
        raise ValueError(f"{url!r}: expected http://host:port")
    return parts.hostname, parts.port


def stream_failure(chunk: dict[str, Any]) -> str | None:
    """How a streamed chunk of vLLM's server says the request failed, or ``None``: an error event
    (both of its shapes: an ``error`` key, or ``object: error``) or a choice finished for ``error``."""
    if "error" in chunk or chunk.get("object") == "error":
        return "an error event"
    if any(c.get("finish_reason") == "error" for c in chunk.get("choices") or []):
        return "finished for error"
    return None


def send(
    address: tuple[str, int],
    body: dict[str, Any],
    *,
    headers: Mapping[str, str] | None = None,
    t0: float | None = None,
    timeout_s: float = REQUEST_TIMEOUT_S,
    hang_up_after: float | None = None,
) -> Reply:
    """POST ``body`` to ``/v1/completions`` at ``address`` (host, port); streamed when
    ``body["stream"]`` is true (:func:`read_stream`). ``t0`` (``time.monotonic()``) is when the
    first-token time starts, by default now. With ``hang_up_after``, the client closes the
    connection that many seconds after sending. Never raises for what a server or the network
    does: that is the reply's kind."""
    conn = http.client.HTTPConnection(*address, timeout=timeout_s)
    try:
        t0 = time.monotonic() if t0 is None else t0
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json", **(headers or {})}
        )
        if hang_up_after is not None:
            time.sleep(hang_up_after)
            conn.sock.shutdown(socket.SHUT_RDWR)  # type: ignore[union-attr]
            return Reply("hung-up", f"after {hang_up_after * 1e3:.0f} ms", None)
        resp = conn.getresponse()
        if resp.status != 200:
            raw = resp.read()
            return Reply("http-error", f"HTTP {resp.status}: {raw[:200].decode(errors='replace')}", None)
        if body.get("stream"):
            return read_stream(resp, t0, timeout_s)
        return Reply("answered", "", json.loads(resp.read()))
    except TimeoutError:
        return Reply("hung", f"no answer in {timeout_s:.0f} s", None)
    except (OSError, http.client.HTTPException, ValueError) as exc:
        return Reply("dropped", f"{type(exc).__name__}: {exc}"[:200], None)
    finally:
        conn.close()


def read_stream(lines: Iterable[bytes], t0: float, timeout_s: float = REQUEST_TIMEOUT_S) -> Reply:
    """A streamed ``/v1/completions`` answer read from ``lines``, ``t0`` the ``time.monotonic()``
    it was sent at.

    The chunks' token ids and logprobs are joined into one answer shaped like a non-streamed one
    (what :func:`~kvcompose_tools.e2e.server.parse_completion` reads); ``ttft_s`` is the time of the
    first chunk that carries a token. An error event, a choice finished for ``error``, or a
    ``[DONE]`` with no token before it is an ``http-error`` (the server failed the request cleanly,
    as a non-streamed request gets an error status), never an answer; a stream that ends or breaks
    before ``[DONE]`` is ``cut-off``; one still going ``timeout_s`` after ``t0``, or silent for the
    socket's timeout, is ``hung``.
    """
    token_ids: list[int] = []
    logprobs: list[float] = []
    text: list[str] = []
    choice: dict[str, Any] = {}
    first: float | None = None
    try:
        for raw in lines:
            line = raw.strip()
            if time.monotonic() - t0 > timeout_s:
                return Reply("hung", f"the stream still going after {timeout_s:.0f} s ({len(token_ids)} tokens)", None)
            if not line.startswith(b"data:"):
                continue  # the blank line after each event, SSE comments
            data = line[5:].strip()
            if data == b"[DONE]":
                if not token_ids and not "".join(text):
                    return Reply("http-error", "HTTP 200, then [DONE] without a token: nothing was answered", None)
                joined = {"text": "".join(text), "token_ids": token_ids, "logprobs": {"token_logprobs": logprobs}}
                return Reply("answered", "", {"choices": [{**choice, **joined}]}, first)
            chunk = json.loads(data)
            if stream_failure(chunk) is not None:
                error = data[:200].decode(errors="replace")
                return Reply("http-error", f"HTTP 200, then an error in the stream: {error}", None)
            for part in chunk.get("choices") or []:
                new = list(part.get("token_ids") or [])
                if first is None and (new or part.get("text")):
                    first = time.monotonic() - t0
                token_ids += new
                logprobs += list((part.get("logprobs") or {}).get("token_logprobs") or [])
                text.append(part.get("text") or "")
                # The other fields (finish_reason, prompt_token_ids): the last chunk that has them.
                choice.update({k: v for k, v in part.items() if v is not None and k not in JOINED})
    except TimeoutError:
        return Reply("hung", f"the stream silent for {timeout_s:.0f} s after {len(token_ids)} tokens", None)
    except (OSError, http.client.HTTPException) as exc:
        broke = f"the stream broke off after {len(token_ids)} tokens: {type(exc).__name__}: {exc}"
        return Reply("cut-off", broke[:200], None)
    return Reply("cut-off", f"the stream ended before data: [DONE] after {len(token_ids)} tokens", None)
