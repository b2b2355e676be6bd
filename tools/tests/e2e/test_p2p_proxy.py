"""The p2p proxy (:mod:`kvcompose_tools.e2e.p2p_proxy`) in process, in front of fake prefill and
decode servers on 127.0.0.1 (real sockets, no engine): the role keys each leg gets, pinned to
vLLM's own parser of them; the decode's stream relayed as it comes; a failed leg an HTTP error
that says which leg and why."""

from __future__ import annotations

import http.client
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from kvcompose.api import P2P_DECODER, P2P_PREFILLER
from kvcompose_tools.e2e.p2p_proxy import P2pProxy, _host_port, decode_body, prefill_body
from kvcompose_tools.e2e.ports import free_ports

P2P = ("10.0.0.2", 5711)
EVENTS = [b'data: {"choices": [{"text": "a"}]}\n\n', b'data: {"choices": [{"text": "b"}]}\n\n', b"data: [DONE]\n\n"]


class Upstream(ThreadingHTTPServer):
    """A fake vLLM server: records each request's path and JSON body; answers ``status`` with
    ``reply`` (the decode: the SSE :data:`EVENTS` when the request streams, the second only once
    :attr:`release` is set)."""

    daemon_threads = True

    def __init__(self, status: int = 200, reply: bytes = b'{"choices": [{"text": "x"}]}') -> None:
        super().__init__(("127.0.0.1", 0), _Fake)
        self.status, self.reply = status, reply
        self.seen: list[tuple[str, dict[str, Any]]] = []
        self.release = threading.Event()
        #: whether the test released the rest of a stream in time (it reads the first event first)
        self.released = False
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Fake(BaseHTTPRequestHandler):
    server: Upstream
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass

    def do_GET(self) -> None:  # noqa: N802 - BaseHTTPRequestHandler's name
        self._send(b"ok")

    def do_POST(self) -> None:  # noqa: N802 - BaseHTTPRequestHandler's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.seen.append((self.path, body))
        if not body.get("stream") or self.server.status != 200:
            self._send(self.server.reply)
            return
        # Chunked, as vLLM's server streams; the rest waits for the test to have read the first event.
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for i, event in enumerate(EVENTS):
            if i == 1:
                self.server.released = self.server.release.wait(10)
            self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")

    def _send(self, data: bytes) -> None:
        self.send_response(self.server.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def stack() -> Iterator[tuple[P2pProxy, Upstream, Upstream]]:
    prefill, decode = Upstream(), Upstream()
    proxy = P2pProxy(("127.0.0.1", free_ports(1)[0]), prefill.url, decode.url, P2P)
    proxy.serve_in_thread()
    yield proxy, prefill, decode
    for server in (proxy, prefill, decode):
        server.shutdown()
        server.server_close()


def post(proxy: P2pProxy, path: str, body: Any) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection("127.0.0.1", proxy.server_address[1], timeout=30)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json", "X-Session-ID": "s1"})
    return conn.getresponse()


CHAT = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 20,
    "max_completion_tokens": 20,
    "min_tokens": 4,
    "stream": True,
    "stream_options": {"include_usage": True},
    "logprobs": True,
}


def test_the_legs_carry_the_roles_with_one_id_and_the_stream_passes_through_as_it_comes(
    stack: tuple[P2pProxy, Upstream, Upstream],
) -> None:
    proxy, prefill, decode = stack
    resp = post(proxy, "/v1/chat/completions", CHAT)
    assert resp.status == 200 and resp.getheader("Content-Type") == "text/event-stream"
    # The first event reaches the client while the decode still holds back the rest: relayed, not buffered.
    first = resp.readline() + resp.readline()
    assert first == EVENTS[0]
    decode.release.set()
    assert first + resp.read() == b"".join(EVENTS)
    assert decode.released  # a buffering proxy would have held the first event until the wait ran out
    ((p_path, p_body),) = prefill.seen
    ((d_path, d_body),) = decode.seen
    assert p_path == d_path == "/v1/chat/completions"
    # The prefill leg: one token, not streamed (vLLM refuses stream_options then), the producer role.
    assert p_body["max_tokens"] == p_body["max_completion_tokens"] == p_body["min_tokens"] == 1
    assert p_body["stream"] is False and "stream_options" not in p_body
    assert set(p_body["kv_transfer_params"]) == {P2P_DECODER}
    kv_request_id = p_body["kv_transfer_params"][P2P_DECODER]["kv_request_id"]
    # The decode leg: the client's request as sent, the consumer role naming the prefill's p2p socket.
    assert {k: v for k, v in d_body.items() if k != "kv_transfer_params"} == CHAT
    role = {"kv_request_id": kv_request_id, "remote_host": P2P[0], "remote_port": P2P[1]}
    assert d_body["kv_transfer_params"] == {P2P_PREFILLER: role}
    # A fresh id per request.
    post(proxy, "/v1/completions", {"model": "m", "prompt": [1, 2], "max_tokens": 2}).read()
    assert prefill.seen[1][1]["kv_transfer_params"][P2P_DECODER]["kv_request_id"] != kv_request_id
    assert decode.seen[1][1]["kv_transfer_params"][P2P_PREFILLER]["kv_request_id"] != kv_request_id


def test_the_role_keys_are_what_vllms_p2p_tier_parses() -> None:
    """vLLM's own parsers of the keys (``tiering/p2p/manager.py``): the proxy cannot drift from them."""
    from vllm.v1.kv_offload.tiering.p2p import manager

    dest = manager._parse_dest(prefill_body(CHAT, "id-1")["kv_transfer_params"])
    assert dest is not None and dest.kv_request_id == "id-1"
    source = manager._parse_source(decode_body(CHAT, "id-1", *P2P)["kv_transfer_params"])
    assert source is not None and (source.kv_request_id, source.peer_id) == ("id-1", "10.0.0.2:5711")
    assert source.do_probe is False  # P/D: the decode takes every block from the prefill, no lookup


@pytest.mark.parametrize("leg", ["prefill", "decode"])
def test_an_upstream_error_is_an_http_error_naming_the_leg(leg: str) -> None:
    bad = Upstream(400, b'{"error": {"message": "max_tokens too large"}}')
    good = Upstream()
    prefill, decode = (bad, good) if leg == "prefill" else (good, bad)
    proxy = P2pProxy(("127.0.0.1", 0), prefill.url, decode.url, P2P)
    proxy.serve_in_thread()
    try:
        resp = post(proxy, "/v1/completions", {"model": "m", "prompt": "x", "max_tokens": 9, "stream": True})
        error = json.loads(resp.read())["error"]
        assert resp.status == 400
        assert error["message"].startswith(f"{leg} leg ({bad.url}/v1/completions): HTTP 400: ")
        assert "max_tokens too large" in error["message"] and "Traceback" not in error["message"]
        assert len(decode.seen) == (0 if leg == "prefill" else 1)  # no decode leg after a failed prefill
    finally:
        for server in (proxy, prefill, decode):
            server.shutdown()
            server.server_close()


def test_an_upstream_that_does_not_answer_is_a_bad_gateway_and_a_body_not_json_a_bad_request() -> None:
    gone = free_ports(1)[0]  # nothing listens there
    decode = Upstream()
    proxy = P2pProxy(("127.0.0.1", 0), f"http://127.0.0.1:{gone}", decode.url, P2P)
    proxy.serve_in_thread()
    try:
        resp = post(proxy, "/v1/completions", {"model": "m", "prompt": "x"})
        message = json.loads(resp.read())["error"]["message"]
        assert resp.status == 502 and message.startswith("prefill leg (") and "ConnectionRefusedError" in message
        conn = http.client.HTTPConnection("127.0.0.1", proxy.server_address[1], timeout=30)
        conn.request("POST", "/v1/completions", b"{not json", {"Content-Type": "application/json"})
        bad = conn.getresponse()
        assert bad.status == 400 and json.loads(bad.read())["error"]["message"] == "the request's body is not JSON"
        # GET goes to the decode (the router's /health).
        conn = http.client.HTTPConnection("127.0.0.1", proxy.server_address[1], timeout=30)
        conn.request("GET", "/health")
        assert conn.getresponse().read() == b"ok"
    finally:
        for server in (proxy, decode):
            server.shutdown()
            server.server_close()


def test_the_command_line_takes_the_p2p_socket_as_host_and_port() -> None:
    import argparse

    assert _host_port("10.0.0.2:5711") == ("10.0.0.2", 5711)
    for bad in ("10.0.0.2", ":5711", "h:port"):
        with pytest.raises(argparse.ArgumentTypeError):
            _host_port(bad)
