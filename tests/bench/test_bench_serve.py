"""The serving benchmark's parts, without engines: its workload, its streaming client, its sides."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from kvcompose.bench import runner, serve
from kvcompose.examples import EXAMPLES


def test_every_prompt_is_a_shared_prefix_and_a_new_part() -> None:
    w = serve.Workload()
    prompts = w.batch(40) + w.batch(40)
    heads = {tuple(p[: serve.PREFIX_TOKENS]) for p in prompts}
    assert heads <= {tuple(p) for p in w.prefixes} and len(heads) > 1
    tails = [tuple(p[serve.PREFIX_TOKENS :]) for p in prompts]
    assert len(set(tails)) == len(tails)
    assert all(serve.NEW_TOKENS[0] <= len(t) <= serve.NEW_TOKENS[1] for t in tails)


def test_the_baseline_decode_is_the_decode_compositions_nixl_child_alone() -> None:
    alone = serve.nixl_alone(EXAMPLES / "pd-decode.yaml", 4321)
    assert alone["kv_connector"] == "NixlConnector" and alone["kv_role"] == "kv_consumer"
    assert alone["kv_connector_extra_config"]["kvcompose_side_channel_port"] == 4321


def test_serve_starts_engines_so_it_is_left_out_of_quick() -> None:
    assert runner.BENCHMARKS["serve"] == "serve" and "serve" in runner.FULL_ONLY


class _SSE(BaseHTTPRequestHandler):
    """Streams what ``/v1/completions`` with ``stream: true`` does: ``data: {json}`` lines, then
    ``data: [DONE]``; ``status`` and ``chunks`` are set per test."""

    status = 200
    chunks: list[dict[str, object]] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert body["stream"] is True and body["temperature"] == 0
        self.send_response(self.status)
        self.end_headers()
        if self.status != 200:
            self.wfile.write(b'{"error": "no"}')
            return
        for chunk in self.chunks:
            self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def sse() -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _SSE)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()


def test_time_to_first_token_is_read_from_the_stream(sse: ThreadingHTTPServer) -> None:
    _SSE.status, _SSE.chunks = 200, [{"choices": [{"text": "a"}]}, {"choices": [{"text": "b"}]}]
    assert 0 < serve.stream_completion("127.0.0.1", sse.server_port, "m", [1, 2, 3]) < 10


def test_a_refused_or_empty_stream_is_an_error(sse: ThreadingHTTPServer) -> None:
    _SSE.status, _SSE.chunks = 500, []
    with pytest.raises(RuntimeError, match="HTTP 500"):
        serve.stream_completion("127.0.0.1", sse.server_port, "m", [1])
    _SSE.status = 200
    with pytest.raises(RuntimeError, match="without a token"):
        serve.stream_completion("127.0.0.1", sse.server_port, "m", [1])


def test_a_batchs_failures_are_counted_not_raised(sse: ThreadingHTTPServer) -> None:
    _SSE.status, _SSE.chunks = 500, []
    tally = serve.Tally()
    assert serve.run_batch(sse.server_port, "m", [[1]] * 5, tally) > 0
    assert tally.errors == 5 and len(tally.first_errors) == 3 and not tally.ttft_s


def test_the_pd_only_side_is_the_decode_composition_without_its_host_tier(tmp_path: Path) -> None:
    from kvcompose.compose import build
    from kvcompose.config import load_file

    plan = build(load_file(serve.pd_only(EXAMPLES / "pd-decode.yaml", tmp_path)))
    assert [(c.name, c.type.name) for c in plan.children] == [("pd", "nixl")]
    full = build(load_file(EXAMPLES / "pd-decode.yaml"))
    (pd,) = [c for c in full.children if c.name == "pd"]
    assert plan.children[0].options == pd.options and plan.children[0].role == pd.role
    assert serve.ALL_SIDES[: len(serve.SIDES)] == serve.SIDES


def test_each_side_gets_its_decode_server_and_an_unknown_side_is_refused(tmp_path: Path) -> None:
    decode = EXAMPLES / "pd-decode.yaml"
    bare = serve.decode_spec("NixlConnector", "m", decode, 4321, tmp_path)
    assert bare.kv_config == serve.nixl_alone(decode, 4321) and bare.composition is None
    assert serve.decode_spec("kvcompose", "m", decode, 4322, tmp_path).composition == str(decode)
    only = serve.decode_spec("kvcompose-pd-only", "m", decode, 4323, tmp_path)
    assert only.composition == str(tmp_path / "pd-decode-pd-only.yaml")
    assert all(s.num_gpu_blocks == serve.DECODE_BLOCKS for s in (bare, only))
    with pytest.raises(ValueError, match="unknown side 'nope'"):
        serve.decode_spec("nope", "m", decode, 1, tmp_path)
