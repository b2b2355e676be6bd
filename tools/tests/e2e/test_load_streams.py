"""The e2e loads' stream reading: a streamed chat turn or a vLLM benchmark request that ends with
an error event, with no token, or before its end is failed, never served. Against a real local
HTTP server (chat) and vLLM's own benchmark request record (prefix)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from kvcompose_tools.e2e.load import NO_USAGE, stream_chat, usage_checked


def _chunk(text: str, token: int, finish: str | None = None) -> str:
    """A chat stream's event as vLLM sends it with ``logprobs`` and token ids as tokens."""
    choice = {"delta": {"content": text}, "logprobs": {"content": [{"token": f"token_id:{token}"}]}}
    return "data: " + json.dumps({"choices": [{**choice, "finish_reason": finish}]})


@pytest.fixture
def chat(request: pytest.FixtureRequest) -> Iterator[str]:
    """A local server streaming ``request.param`` (events) to every chat request; its URL."""
    events: list[str] = request.param

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for event in events:
                data = f"{event}\n\n".encode()
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.write(b"0\r\n\r\n")
            self.close_connection = True

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.mark.parametrize("chat", [[_chunk("a", 7), _chunk("b", 8, "length"), "data: [DONE]"]], indirect=True)
def test_a_whole_chat_stream_is_served(chat: str) -> None:
    ttft, text, ids, error = stream_chat(chat + "/v1/chat/completions", {}, "s")
    assert (text, ids, error) == ("ab", [7, 8], None) and ttft is not None


@pytest.mark.parametrize(
    ("chat", "error"),
    [
        ([_chunk("a", 7), 'data: {"error": {"message": "boom", "code": 500}}', "data: [DONE]"], "boom"),
        ([_chunk("a", 7), 'data: {"object": "error", "message": "old shape"}', "data: [DONE]"], "old shape"),
        ([_chunk("a", 7), _chunk("", 8, "error"), "data: [DONE]"], "finished for error"),
        (["data: [DONE]"], "no token"),
        ([_chunk("", 7), "data: [DONE]"], "no token"),
        ([_chunk("a", 7)], "before data: [DONE]"),  # the server died mid-answer
    ],
    indirect=["chat"],
)
def test_a_chat_stream_with_an_error_event_no_token_or_no_end_is_failed(chat: str, error: str) -> None:
    _, _, _, got = stream_chat(chat + "/v1/chat/completions", {}, "s")
    assert got is not None and error in got


def test_a_benchmark_stream_without_its_usage_chunk_is_failed() -> None:
    """vLLM's benchmark client counts a stream with one choice chunk as a success, an error event
    after it included; its usage chunk, sent after the last token only, tells the two apart."""
    from vllm.benchmarks import serve
    from vllm.benchmarks.lib.endpoint_request_func import RequestFuncOutput

    async def request(*args: Any, **kwargs: Any) -> RequestFuncOutput:
        return RequestFuncOutput(**kwargs["out"])

    funcs = {"vllm": request}
    with usage_checked(funcs, "vllm"):
        whole = asyncio.run(funcs["vllm"](out={"success": True, "output_tokens": 16, "ttft": 0.1}))
        no_usage = asyncio.run(funcs["vllm"](out={"success": True, "output_tokens": 0, "ttft": 0.1}))
        failed = asyncio.run(funcs["vllm"](out={"success": False, "error": "HTTP 500"}))
    assert whole.success and whole.error == ""
    assert (no_usage.success, no_usage.error) == (False, NO_USAGE)
    assert (failed.success, failed.error) == (False, "HTTP 500")
    assert funcs["vllm"] is request  # restored
    assert "vllm" in serve.ASYNC_REQUEST_FUNCS  # the one prefix_load wraps


def test_the_prefix_load_leaves_the_heap_unfrozen(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's benchmark freezes the garbage collector's heap (``freeze_gc_heap``); frozen cycles
    holding triton's nanobind objects outlive the interpreter's last collection, and nanobind lists
    them as "leaked" at exit, the last lines of ``make test`` and ``kvcompose bench``. The load
    unfreezes it, also when the benchmark fails."""
    import gc

    from vllm.benchmarks import serve

    from kvcompose_tools.e2e.load import prefix_load

    def frozen_then_failed(args: Any) -> dict[str, Any]:
        gc.freeze()
        raise ConnectionError("the router went away")

    monkeypatch.setattr(serve, "main", frozen_then_failed)
    try:
        with pytest.raises(ConnectionError):
            prefix_load("http://127.0.0.1:9", "model")
        assert gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()
