"""The serving benchmark's parts, without engines: its workload, its streaming client, its sides,
its answered-requests rate and its TTFT tail."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from kvcompose.examples import EXAMPLES
from kvcompose.vllm.args import vllm_multiconnector
from kvcompose_tools.bench import runner, serve
from kvcompose_tools.bench.measure import Samples
from kvcompose_tools.e2e.flow import NIXL_BYTES
from kvcompose_tools.e2e.spec import composed_kv_transfer_config


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
    ``data: [DONE]``; ``status`` (or ``statuses``, request by request), ``chunks`` and ``delay_s``
    (before answering) are set per test."""

    status = 200
    statuses: list[int] = []
    seen = 0
    lock = threading.Lock()
    delay_s = 0.0
    chunks: list[dict[str, object]] = []
    done = True  # end with data: [DONE]

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert body["stream"] is True and body["temperature"] == 0
        with _SSE.lock:
            status = _SSE.statuses[_SSE.seen % len(_SSE.statuses)] if _SSE.statuses else self.status
            _SSE.seen += 1
        time.sleep(self.delay_s)
        self.send_response(status)
        self.end_headers()
        if status != 200:
            self.wfile.write(b'{"error": "no"}')
            return
        for chunk in self.chunks:
            self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        if self.done:
            self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def sse() -> Iterator[ThreadingHTTPServer]:
    _SSE.status, _SSE.statuses, _SSE.seen, _SSE.delay_s, _SSE.chunks, _SSE.done = 200, [], 0, 0.0, [], True
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


@pytest.mark.parametrize(
    ("chunks", "done", "error"),
    [
        ([{"choices": [{"text": "a"}]}, {"error": {"message": "boom", "code": 500}}], True, "boom"),
        ([{"choices": [{"text": "a"}]}, {"object": "error", "message": "old shape"}], True, "old shape"),
        ([{"choices": [{"text": "", "finish_reason": "error"}]}], True, "an error in the stream"),
        ([{"choices": [{"text": "a"}]}], False, "before data: \\[DONE\\]"),  # the server died mid-answer
    ],
)
def test_a_stream_with_an_error_event_or_no_end_is_an_error(
    sse: ThreadingHTTPServer, chunks: list[dict[str, object]], done: bool, error: str
) -> None:
    _SSE.chunks, _SSE.done = chunks, done
    with pytest.raises(RuntimeError, match=error):
        serve.stream_completion("127.0.0.1", sse.server_port, "m", [1])


def test_a_batchs_failures_are_counted_not_raised_nor_served(sse: ThreadingHTTPServer) -> None:
    _SSE.status, _SSE.chunks = 500, []
    tally = serve.Tally()
    assert serve.run_batch(sse.server_port, "m", [[1]] * 5, tally) == 0.0  # nothing answered: nothing served
    assert tally.errors == 5 and len(tally.first_errors) == 3 and not tally.ttft_s


def test_requests_per_second_count_the_answered_requests_only(sse: ThreadingHTTPServer) -> None:
    # Every other request fails; each takes 0.5 s, all in flight at once (the batch takes >= 0.5 s).
    _SSE.statuses, _SSE.delay_s, _SSE.chunks = [200, 503], 0.5, [{"choices": [{"text": "a"}]}]
    tally = serve.Tally()
    t0 = time.perf_counter()
    rps = serve.run_batch(sse.server_port, "m", [[1]] * 8, tally)
    wall = time.perf_counter() - t0
    assert (len(tally.ttft_s), tally.errors) == (4, 4)
    # 4 answered over the batch's time; counting the 8 sent would give twice that.
    assert 4 / wall <= rps <= 4 / 0.5


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


def _tally(ttft_s: list[float], errors: int = 0) -> serve.Tally:
    t = serve.Tally(ttft_s=list(ttft_s))
    for _ in range(errors):
        t.error("HTTP 500: down")
    return t


def test_each_side_reports_its_ttft_tail_and_answered_requests() -> None:
    # 100 answers: 98 at 0.1-0.198 s, a 2 s and a 5 s one (the tail a median hides).
    tally = _tally([0.1 + i / 1000 for i in range(98)] + [2.0, 5.0], errors=3)
    e = serve.side_report(tally, {NIXL_BYTES: 1000.0})
    assert (e["requests"], e["answered"], e["errors"]) == (103, 100, 3)
    assert e["ttft_p50_ms"] == pytest.approx(149.5, abs=1) and e["ttft_max_ms"] == 5000.0
    assert 1900 <= e["ttft_p99_ms"] <= 2100
    nothing = serve.side_report(_tally([], errors=2), {})
    assert (nothing["answered"], nothing["ttft_p99_ms"], nothing["ttft_max_ms"]) == (0, None, None)


def test_kvcomposes_ttft_p99_is_set_against_every_other_sides() -> None:
    sides = {
        "NixlConnector": {"ttft_p99_ms": 800.0},
        "kvcompose": {"ttft_p99_ms": 1000.0},
        "MultiConnector": {"ttft_p99_ms": 1250.0},
        "broken": {"ttft_p99_ms": None},
    }
    assert serve.ttft_p99_ratios(sides) == {
        "kvcompose/NixlConnector": 1.25,
        "kvcompose/MultiConnector": 0.8,
        "kvcompose/broken": None,
    }
    assert serve.ttft_p99_ratios({"NixlConnector": {"ttft_p99_ms": 1.0}}) == {}


def test_the_result_holds_answered_rates_and_the_ttft_tail_printed_and_in_json(tmp_path: Path) -> None:
    samples = {side: Samples([10.0, 12.0, 11.0]) for side in serve.SIDES}
    samples["kvcompose"] = Samples([9.0, 12.0, 11.5])
    tallies = {
        "NixlConnector": _tally([0.2] * 98 + [1.0, 1.5]),
        "kvcompose": _tally([0.2] * 98 + [2.0, 3.0], errors=1),
        "MultiConnector": _tally([0.3] * 98 + [4.0, 4.5]),
    }
    moved = {side: {NIXL_BYTES: 1e6} for side in serve.SIDES}
    echoed: list[str] = []
    result = serve.summarize(samples, tallies, moved, 32, 3, True, 40.0, tmp_path, echoed.append)
    case = result.to_json()["cases"][0]
    assert case["sides"]["kvcompose"]["answered"] == 100 and case["sides"]["kvcompose"]["errors"] == 1
    assert case["sides"]["MultiConnector"]["ttft_max_ms"] == 4500.0
    p99 = {side: case["sides"][side]["ttft_p99_ms"] for side in serve.SIDES}
    assert case["ttft_p99_ratios"] == {
        "kvcompose/NixlConnector": round(p99["kvcompose"] / p99["NixlConnector"], 3),
        "kvcompose/MultiConnector": round(p99["kvcompose"] / p99["MultiConnector"], 3),
    }
    assert [(r.subject, r.baseline) for r in result.ratios] == [
        ("kvcompose", "NixlConnector"),
        ("MultiConnector", "NixlConnector"),
        ("kvcompose", "MultiConnector"),
    ]
    table = result.table()
    assert f"kvcompose p50 200.0 / p99 {p99['kvcompose']} / max 3000.0 ms" in table
    assert "TTFT p99 kvcompose/NixlConnector" in table and "kvcompose/MultiConnector" in table
    assert any(line.startswith("   kvcompose: answered 100 of 101, TTFT p50 200.0") for line in echoed)
    # A side whose batches mostly failed served nothing: no ratio to it, but the reason.
    failing = {**samples, "NixlConnector": Samples([0.0, 0.0, 3.0])}
    with pytest.raises(RuntimeError, match=r"decode NixlConnector answered no request in most batches"):
        serve.summarize(failing, tallies, moved, 32, 3, True, 40.0, tmp_path, echoed.append)
    # A side that moved nothing over NIXL measured something else: no result.
    moved["MultiConnector"] = {}
    with pytest.raises(RuntimeError, match="decode MultiConnector pulled nothing over NIXL"):
        serve.summarize(samples, tallies, moved, 32, 3, True, 40.0, tmp_path, echoed.append)


def test_the_multiconnector_side_is_vllms_multiconnector_over_the_same_children(tmp_path: Path) -> None:
    decode = EXAMPLES / "pd-decode.yaml"
    assert serve.SIDES == ("NixlConnector", "kvcompose", "MultiConnector")  # by default: four engines
    multi = serve.decode_spec("MultiConnector", "m", decode, 4324, tmp_path)
    assert multi.kv_config == vllm_multiconnector(composed_kv_transfer_config(decode, 4324))
    assert multi.kv_config is not None and multi.kv_config["kv_connector"] == "MultiConnector"
    children = multi.kv_config["kv_connector_extra_config"]["connectors"]
    assert [c["kv_connector"] for c in children] == ["SimpleCPUOffloadConnector", "NixlConnector"]
    assert children[1]["kv_connector_extra_config"]["kvcompose_side_channel_port"] == 4324
    assert multi.composition is None and multi.num_gpu_blocks == serve.DECODE_BLOCKS
