"""A P/D proxy for vLLM's p2p tier that sets the role keys as llm-d's routing sidecar does.

vLLM's p2p tier (``vllm/v1/kv_offload/tiering/p2p/manager.py``) takes each request's role from
its ``kv_transfer_params``, and vllm-router 0.1.17 sets none of those keys (it speaks
NixlConnector's ``do_remote_decode``). llm-d's routing sidecar, in its ``offloading`` mode, sends

1. the prefill leg: the request with ``max_tokens: 1`` (``max_completion_tokens`` and
   ``min_tokens`` capped at 1 too), ``stream: false`` and ``kv_transfer_params:
   {"remote_decoder": {"kv_request_id": ID}}`` (:func:`prefill_body`);
2. the decode leg: the request as the client sent it with ``kv_transfer_params:
   {"remote_prefiller": {"kv_request_id": ID, "remote_host": H, "remote_port": P}}``, H:P the
   prefill's p2p control socket (:func:`decode_body`), whose answer goes back to the client
   unchanged, streamed or not.

:class:`P2pProxy` does that for ``POST /v1/completions`` and ``/v1/chat/completions`` (any other
``POST`` too), a fresh ID per request; ``GET`` (``/health``, ``/v1/models``) goes to the decode.
A leg that fails is answered as an HTTP error whose JSON ``error.message`` names the leg and what
went wrong (the upstream's status and body, or the connection error), never a traceback. One
prefill and one decode: session stickiness is moot.

It runs as a process of its own, like the router (:class:`P2pProxyNode`)::

    python -m kvcompose_tools.e2e.p2p_proxy --prefill http://10.0.0.2:8000 \\
        --decode http://10.0.0.3:8000 --prefill-p2p 10.0.0.2:5711 --port 9000
"""

from __future__ import annotations

import argparse
import http.client
import json
import secrets
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from kvcompose.api import P2P_DECODER, P2P_PREFILLER
from kvcompose_tools.e2e.processes import NodeError, ProcessNode
from kvcompose_tools.e2e.server import HOST, HttpClient
from kvcompose_tools.e2e.stream import address

#: Prefix of the ids this proxy gives (the tier needs nothing of them but uniqueness).
REQUEST_ID_PREFIX = "p2p-proxy-"
#: How long a leg may take before it is answered as a gateway timeout.
LEG_TIMEOUT_S = 300.0
#: Bytes relayed per read of a streamed answer (an SSE event is far smaller: each goes on at once).
CHUNK = 65536
READY_TIMEOUT_S = 30.0


def fresh_id() -> str:
    """A new ``kv_request_id``: unguessable, so that no other client can fetch this prompt's blocks."""
    return REQUEST_ID_PREFIX + secrets.token_hex(16)


def prefill_body(body: dict[str, Any], kv_request_id: str) -> dict[str, Any]:
    """The prefill leg: one token, not streamed, the producer role."""
    out = {k: v for k, v in body.items() if k != "stream_options"}  # vLLM refuses it unstreamed
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    if "min_tokens" in out:
        out["min_tokens"] = min(int(out["min_tokens"] or 0), 1)
    out["stream"] = False
    out["kv_transfer_params"] = {P2P_DECODER: {"kv_request_id": kv_request_id}}
    return out


def decode_body(body: dict[str, Any], kv_request_id: str, p2p_host: str, p2p_port: int) -> dict[str, Any]:
    """The decode leg: the client's request, the consumer role naming the prefill's p2p socket."""
    role = {"kv_request_id": kv_request_id, "remote_host": p2p_host, "remote_port": p2p_port}
    return {**body, "kv_transfer_params": {P2P_PREFILLER: role}}


class LegError(Exception):
    """A leg that failed: the HTTP status to answer and what to say."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class P2pProxy(ThreadingHTTPServer):
    """The proxy's HTTP server on ``bind`` in front of ``prefill`` and ``decode`` (base URLs),
    the prefill's p2p control socket at ``p2p`` (host, port)."""

    daemon_threads = True

    def __init__(self, bind: tuple[str, int], prefill: str, decode: str, p2p: tuple[str, int]) -> None:
        super().__init__(bind, _Handler)
        self.prefill, self.decode, self.p2p = prefill, decode, p2p

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host!s}:{port}"

    def serve_in_thread(self) -> threading.Thread:
        """Serve from a daemon thread (the tests' in-process proxy); :meth:`shutdown` stops it."""
        thread = threading.Thread(target=self.serve_forever, name="p2p-proxy", daemon=True)
        thread.start()
        return thread


def _connect(url: str) -> http.client.HTTPConnection:
    return http.client.HTTPConnection(*address(url), timeout=LEG_TIMEOUT_S)


def _open(leg: str, url: str, method: str, path: str, body: dict[str, Any] | None, headers: dict[str, str]) -> Any:
    """The leg's connection and its response (status not checked); a :class:`LegError` when no
    HTTP answer came."""
    conn = _connect(url)
    try:
        data = json.dumps(body).encode() if body is not None else None
        conn.request(method, path, data, {**headers, **({"Content-Type": "application/json"} if data else {})})
        return conn, conn.getresponse()
    except TimeoutError:
        conn.close()
        raise LegError(504, f"{leg} leg ({url}{path}): no answer in {LEG_TIMEOUT_S:.0f} s") from None
    except (OSError, http.client.HTTPException) as exc:
        conn.close()
        raise LegError(502, f"{leg} leg ({url}{path}): {type(exc).__name__}: {exc}") from None


class _Handler(BaseHTTPRequestHandler):
    server: P2pProxy
    # Close-delimited answers: a stream is relayed as it comes, its length unknown.
    protocol_version = "HTTP/1.0"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        # One line a request, flushed: the log is a file the kit tails.
        sys.stderr.write(f"{time.strftime('%H:%M:%S')} {self.address_string()} {format % args}\n")
        sys.stderr.flush()

    def _forwarded(self) -> dict[str, str]:
        keep = ("x-request-id", "x-session-id", "authorization")
        return {k: v for k, v in self.headers.items() if k.lower() in keep}

    def do_GET(self) -> None:  # noqa: N802 - BaseHTTPRequestHandler's name
        try:
            conn, resp = _open("decode", self.server.decode, "GET", self.path, None, self._forwarded())
            try:
                self._relay(resp)
            finally:
                conn.close()
        except LegError as err:
            self._error(err.status, err.message)

    def do_POST(self) -> None:  # noqa: N802 - BaseHTTPRequestHandler's name
        try:
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            try:
                body = json.loads(raw)
            except ValueError:
                raise LegError(400, "the request's body is not JSON") from None
            if not isinstance(body, dict):
                raise LegError(400, "the request's body is not a JSON object")
            kv_request_id = fresh_id()
            self._prefill(body, kv_request_id)
            host, port = self.server.p2p
            conn, resp = _open(
                "decode", self.server.decode, "POST", self.path, decode_body(body, kv_request_id, host, port),
                self._forwarded(),
            )  # fmt: skip
            try:
                if resp.status != 200:
                    raise LegError(resp.status, _said("decode", self.server.decode + self.path, resp))
                self._relay(resp)
            finally:
                conn.close()
        except LegError as err:
            self._error(err.status, err.message)
        except Exception as exc:  # a proxy answers every request; what broke goes to the client and the log
            self._error(500, f"p2p proxy: {type(exc).__name__}: {exc}")

    def _prefill(self, body: dict[str, Any], kv_request_id: str) -> None:
        url = self.server.prefill
        conn, resp = _open("prefill", url, "POST", self.path, prefill_body(body, kv_request_id), self._forwarded())
        try:
            if resp.status != 200:
                raise LegError(resp.status, _said("prefill", url + self.path, resp))
            resp.read()  # its answer (one token) is not the client's
        except (OSError, http.client.HTTPException) as exc:
            raise LegError(502, f"prefill leg ({url}{self.path}): {type(exc).__name__}: {exc}") from None
        finally:
            conn.close()

    def _relay(self, resp: http.client.HTTPResponse) -> None:
        """The upstream's answer to the client as it comes: status, type, body chunk by chunk."""
        self.send_response(resp.status)
        self.send_header("Content-Type", resp.getheader("Content-Type") or "application/json")
        length = resp.getheader("Content-Length")
        if length is not None:
            self.send_header("Content-Length", length)
        self.end_headers()
        try:
            while chunk := resp.read1(CHUNK):
                self.wfile.write(chunk)
                self.wfile.flush()
        except (OSError, http.client.HTTPException) as exc:
            # Headers are out: the client sees the stream end before [DONE] (cut off); the log says why.
            self.log_message("decode stream broke off: %s: %s", type(exc).__name__, exc)

    def _error(self, status: int, message: str) -> None:
        data = json.dumps({"error": {"message": message, "type": "p2p_proxy_error", "code": status}}).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:
            pass  # the client is gone: nobody to tell
        self.log_message("%s", message)


def _said(leg: str, where: str, resp: http.client.HTTPResponse) -> str:
    text = resp.read()[:1000].decode(errors="replace")
    return f"{leg} leg ({where}): HTTP {resp.status}: {text}"


class P2pProxyNode(ProcessNode):
    """The proxy as a process of its own on 127.0.0.1 (as :class:`~kvcompose_tools.e2e.router.RouterNode`),
    its log ``<name>.log`` in ``log_dir``; :meth:`wait_ready`, then send requests to :attr:`url`."""

    close_grace_s = 5.0

    def __init__(
        self, prefill: str, decode: str, p2p: tuple[str, int], log_dir: Path, port: int, name: str = "p2p-proxy"
    ) -> None:
        self.port = port
        self.url = f"http://{HOST}:{port}"
        argv = [
            sys.executable, "-m", __name__, "--prefill", prefill, "--decode", decode,
            "--prefill-p2p", f"{p2p[0]}:{p2p[1]}", "--host", HOST, "--port", str(port),
        ]  # fmt: skip
        super().__init__(name, name, argv, log_dir, stdin=subprocess.DEVNULL)
        self._http = HttpClient(name, self.url, self._state)

    def _state(self) -> str:
        rc = self.proc.poll()
        return f"p2p proxy {'running' if rc is None else f'exited (rc={rc})'}, log {self.log_path}:\n{self.log_tail()}"

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Until ``GET /health`` (the decode's, through the proxy) answers 200; a :class:`NodeError`
        with the log when the proxy exits or is not up in ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not self._http.healthy(1.0):
            if self.proc.poll() is not None or time.monotonic() >= deadline:
                raise NodeError(f"p2p proxy not ready; {self._state()}")
            time.sleep(0.2)


def _host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: expected HOST:PORT")
    return host, int(port)


def main(argv: list[str] | None = None) -> None:
    """Serve until killed."""
    parser = argparse.ArgumentParser(prog="python -m kvcompose_tools.e2e.p2p_proxy", description=__doc__.split("\n")[0])
    parser.add_argument("--prefill", required=True, help="the prefill server's base URL")
    parser.add_argument("--decode", required=True, help="the decode server's base URL")
    parser.add_argument("--prefill-p2p", required=True, type=_host_port, help="the prefill's p2p socket, HOST:PORT")
    parser.add_argument("--host", default=HOST)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    server = P2pProxy((args.host, args.port), args.prefill, args.decode, args.prefill_p2p)
    print(f"p2p proxy on {server.url}: prefill {args.prefill} (p2p {args.prefill_p2p}), decode {args.decode}")
    sys.stdout.flush()
    server.serve_forever()


if __name__ == "__main__":
    main()
