"""``kvcompose warmup`` without engines: every prefill/decode pair gets one small P/D request of
its own, and a server that cannot be reached is a one-line error. Against real servers:
``tools/tests/engine/test_router.py``; its effect on a fresh pair's first request: ``kvcompose bench
--only cold-start``."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from kvcompose.cli import main
from kvcompose_tools.e2e.flow import NIXL_BYTES
from kvcompose_tools.e2e.ports import free_ports
from kvcompose_tools.e2e.processes import NodeError
from kvcompose_tools.e2e.warmup import WARMUP_TOKENS, warm

Params = list[dict[str, Any] | None] | None


class Prefill:
    def __init__(self, name: str) -> None:
        self.name = name
        self.sent: list[tuple[list[int], dict[str, Any] | None]] = []

    def generate(
        self, prompts: list[list[int]], max_tokens: int, kv: Params = None, timeout: float = 0
    ) -> list[dict[str, Any]]:
        assert max_tokens == 1
        self.sent.append((prompts[0], kv[0] if kv else None))
        return [{"kv_transfer_params": {"remote_engine_id": self.name}, "token_ids": [1], "logprobs": [-1.0]}]


class Decode:
    """Pulls 16 bytes per prompt token but the last, as its NIXL counter says."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.pulled = 0.0
        self.params: list[dict[str, Any] | None] = []

    def generate(
        self, prompts: list[list[int]], max_tokens: int, kv: Params = None, timeout: float = 0
    ) -> list[dict[str, Any]]:
        self.params.append(kv[0] if kv else None)
        self.pulled += 16 * (len(prompts[0]) - 1)
        return [{"token_ids": [2], "logprobs": [-0.5], "finish_reason": "length", "ttft_s": 0.01, "wall_s": 0.02}]

    def metrics(self) -> dict[str, float]:
        return {NIXL_BYTES: self.pulled}

    def reset_prefix_cache(self) -> bool:
        return True


def test_every_pair_gets_one_request_of_its_own() -> None:
    prefills, decodes = [Prefill("p1"), Prefill("p2")], [Decode("d1"), Decode("d2")]
    lines: list[str] = []
    warmed = warm(prefills, decodes, echo=lines.append)
    assert [(w.prefill, w.decode) for w in warmed] == [("p1", "d1"), ("p1", "d2"), ("p2", "d1"), ("p2", "d2")]
    prompts = [prompt for p in prefills for prompt, _ in p.sent]
    assert len({tuple(x) for x in prompts}) == 4 and {len(x) for x in prompts} == {WARMUP_TOKENS}
    assert all(kv == {"do_remote_decode": True} for p in prefills for _, kv in p.sent)
    # Each decode pulls from the prefill it was paired with, with that prefill's params.
    assert [kv["remote_engine_id"] for kv in decodes[0].params if kv] == ["p1", "p2"]
    assert all(w.nixl_bytes == 16 * (WARMUP_TOKENS - 1) for w in warmed)
    assert lines[0].startswith("p1 -> d1: warm (decode TTFT")


def test_a_server_that_cannot_be_reached_is_named_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    (dead,) = free_ports(1)
    url = f"http://127.0.0.1:{dead}"
    assert main(["warmup", "--prefill", url, "--decode", url]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"kvcompose warmup: {url}: GET /v1/models failed") and "Traceback" not in err


class Answers(BaseHTTPRequestHandler):
    """A server that is not vLLM's: GET answers what ``answers`` holds for the path, else 404."""

    answers: dict[str, bytes] = {}

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        body = self.answers.get(self.path)
        self.send_response(404 if body is None else 200)
        self.send_header("Content-Length", str(len(body or b"")))
        self.end_headers()
        self.wfile.write(body or b"")

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def server() -> Iterator[tuple[str, dict[str, bytes]]]:
    """A real local HTTP server, its URL and the answers it gives (a test fills them in)."""
    answers: dict[str, bytes] = {}
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), type("Handler", (Answers,), {"answers": answers}))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", answers
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("127.0.0.1:8100", "no http://"),
        ("localhost:8100", "no http://"),
        ("ftp://127.0.0.1:8100", "scheme 'ftp'"),
        ("http://", "no host"),
        ("http://127.0.0.1:port", "Port could not be cast to integer value as 'port'"),
        ("http://[::1", "Invalid IPv6 URL"),
    ],
)
def test_a_url_that_is_no_servers_is_named_with_what_is_wrong(
    url: str, why: str, server: tuple[str, dict[str, bytes]], capsys: pytest.CaptureFixture[str]
) -> None:
    good, _ = server
    assert main(["warmup", "--prefill", good, "--decode", url]) == 2
    assert capsys.readouterr().err == (
        f"kvcompose warmup: {url}: not a server URL ({why}; give it as http://HOST:PORT)\n"
    )


@pytest.mark.parametrize(
    ("answers", "said"),
    [
        ({"/v1/models": b"<html>Welcome to nginx!</html>"}, "GET /v1/models answered no JSON: b'<html>Welcome"),
        ({"/v1/models": b"\xff\xfe\x00"}, "GET /v1/models answered no JSON: b'\\xff\\xfe\\x00'"),
        ({"/v1/models": b'{"object": "list"}'}, "GET /v1/models answered no model list"),
        ({"/v1/models": b'{"data": ["m"]}'}, "GET /v1/models answered no model list"),
        ({"/v1/models": b'{"data": [{"id": "m"}]}', "/metrics": b"{not prometheus"}, "GET /metrics answered no"),
    ],
    ids=["html", "bytes", "no-data", "no-ids", "metrics"],
)
def test_an_answer_that_is_not_vllms_is_named_with_the_url(
    answers: dict[str, bytes],
    said: str,
    server: tuple[str, dict[str, bytes]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    url, served = server
    served.update(answers)
    assert main(["warmup", "--prefill", url, "--decode", url]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"kvcompose warmup: {url}: {said}"), err
    assert err.endswith("is it a vLLM server?\n") and err.count("\n") == 1, err


def test_a_pair_whose_answer_is_not_vllms_is_named() -> None:
    class Odd(Prefill):
        def generate(self, *args: Any, **kwargs: Any) -> list[dict[str, Any]]:
            return [{"token_ids": [1]}]  # no kv_transfer_params: not a P/D prefill's answer

    with pytest.raises(NodeError, match=r"^p1 -> d1: the warm-up request got an answer a vLLM server does not give"):
        warm([Odd("p1")], [Decode("d1")])
