"""``kvcompose register``: servers kept registered with vllm-router's discovery socket while their
``/health`` answers 200 (:mod:`kvcompose.discovery`). The router's side is a ZMQ ROUTER socket
here, reading what vllm-router 0.1.17 reads (the real router: ``tools/tests/e2e/test_router_discovery.py``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import msgspec
import pytest
import zmq

from kvcompose.cli import main
from kvcompose.discovery import host_port, registration


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--router", "127.0.0.1", "--decode", "http://127.0.0.1:8000"], "--router '127.0.0.1': give HOST:PORT"),
        (["--router", "127.0.0.1:0", "--decode", "http://127.0.0.1:8000"], "with a port from 1 to 65535"),
        (["--router", "127.0.0.1:5000", "--decode", "https://127.0.0.1:8000"], "--decode 'https://127.0.0.1:8000'"),
        (["--router", "127.0.0.1:5000", "--prefill", "127.0.0.1:8000/v1"], "--prefill '127.0.0.1:8000/v1'"),
        (["--router", "127.0.0.1:5000", "--prefill", "127.0.0.1:99999"], "--prefill '127.0.0.1:99999'"),
        (["--router", "127.0.0.1:5000", "--decode", "http://u@10.0.0.7:8000"], "with no user or spaces"),
        (["--router", "10.0.0 .2:5000", "--decode", "http://10.0.0.7:8000"], "--router '10.0.0 .2:5000'"),
        (["--router", "127.0.0.1:5000"], "name the servers to register: --prefill URL or --decode URL"),
    ],
)
def test_register_refuses_with_a_line(argv: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["register", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvcompose register: ") and says in err and "Traceback" not in err


def test_a_registration_is_what_the_router_reads() -> None:
    assert host_port("http://10.0.0.7:8000/", "x") == host_port("10.0.0.7:8000", "x") == "10.0.0.7:8000"
    assert host_port("http://[::1]:8000", "x") == "[::1]:8000"
    assert registration("decode", "10.0.0.7:8000") == {
        "type": "D",
        "http_address": "10.0.0.7:8000",
        "zmq_address": "10.0.0.7:8000",
    }
    with pytest.raises(ValueError, match="registration kind 'encoder': one of prefill, decode"):
        registration("encoder", "10.0.0.7:8000")


class _Health(BaseHTTPRequestHandler):
    server: Any

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
        pass

    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" and self.server.healthy else 503)
        self.send_header("Content-Length", "0")
        self.end_headers()


@pytest.fixture
def server() -> Iterator[Any]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    httpd.healthy = True  # type: ignore[attr-defined]
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def _heard(sock: zmq.Socket, seconds: float) -> list[dict[str, str]]:
    """Every registration the router's socket gets within ``seconds``."""
    got, deadline = [], time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        if sock.poll(int(left * 1000)):
            _, body = sock.recv_multipart()
            got.append(msgspec.msgpack.decode(body))
    return got


def test_a_server_is_registered_while_its_health_answers_and_not_after(server: Any) -> None:
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    address = f"127.0.0.1:{server.server_address[1]}"
    argv = [
        sys.executable,
        "-m",
        "kvcompose.cli",
        "register",
        "--router",
        f"127.0.0.1:{port}",
        "--decode",
        f"http://{address}",
    ]
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        heard = _heard(router, 2.5)  # the control: healthy, registered every heartbeat
        assert len(heard) >= 2 and all(h == registration("decode", address) for h in heard), heard
        server.healthy = False
        time.sleep(1.5)  # a heartbeat in flight when it turned
        assert _heard(router, 2.5) == []
        server.healthy = True
        assert _heard(router, 2.5)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=10)
        router.close()
    assert proc.returncode == 0, err
    assert f"decode {address}: registered" in err and f"decode {address}: not registered (GET /health" in err, err
    assert "Traceback" not in err
