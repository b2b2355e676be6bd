"""The load-failure benchmark's engine-free parts: the decode log's refusals matched to the
client's requests, the groups around the pause, the figures and the table."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from kvcompose_tools.bench.load_failure import POLICIES, summarize
from kvcompose_tools.bench.load_failure.client import Sent, pd_once
from kvcompose_tools.bench.load_failure.findings import Phase, counts_table, policy_counts, refused_rids

LOG = """\
INFO 11:00:01 [core.py] something else
WARNING 11:00:30 [lease.py:333] NIXL read refused: cmpl-lf0f-3-0-1a2b3c4d (prefill request cmpl-lf0f-3-0-9f8e7d6c) \
ended 4.2 s after the prefill instance's lease on its blocks
WARNING 11:00:30 [lease.py:333] NIXL read refused: cmpl-lf0f-5-retry-0-00aa11bb (prefill request cmpl-x) ended
ERROR 11:00:30 [scheduler.py] Failing 2 request(s) due to KV load failure (failure_policy=fail, 512 tokens affected).
WARNING 11:00:31 [scheduler.py] Recovered from KV load failure: 1 request(s) rescheduled (256 tokens affected).
"""


def sent(rid: str, at: float, ttft: float | None, done: float | None, tokens: int = 4, **kw: object) -> Sent:
    return Sent(rid, 0, at, ttft, done, tokens, list(range(tokens)), **kw)  # type: ignore[arg-type]


def phase(policy: str = "fail") -> Phase:
    requests = [
        sent("lf0f-1", 1.0, 0.1, 1.5),  # before
        sent("lf0f-2", 2.0, 0.2, 2.6),  # before
        sent("lf0f-3", 9.5, None, 31.0, 0, error="HTTP 500", retry_ttft_s=22.0),  # refused, failed, retried
        sent("lf0f-4", 9.8, 20.5, 30.6),  # caught by the pause, answered
        sent("lf0f-5", 9.9, 21.5, 31.5),  # refused (its retry's id), answered
        sent("lf0f-6", 31.0, 0.4, 31.8),  # after
        sent("lf0f-7", 45.0, 0.2, 45.5),  # after
        sent("lf0f-8", 95.0, 0.1, 95.5),  # past the after window
    ]
    return Phase(policy, 0, requests, LOG, paused_at=10.0, resumed_at=30.0, window_s=20.0)


def test_refused_reads_name_the_clients_request_ids() -> None:
    assert refused_rids(LOG) == ["lf0f-3", "lf0f-5-retry"]
    assert policy_counts(LOG) == {"vllm_failed": 2, "vllm_rescheduled": 1}


def test_requests_fall_in_their_groups_around_the_pause() -> None:
    groups = {k: [s.rid for s in v] for k, v in phase().groups().items()}
    assert groups == {
        "refused": ["lf0f-3", "lf0f-5"],
        "before": ["lf0f-1", "lf0f-2"],
        "caught": ["lf0f-4"],
        "after": ["lf0f-6", "lf0f-7"],
    }
    assert phase().unmatched() == []
    assert Phase("fail", 0, [], LOG, 10.0, 30.0, 20.0).unmatched() == ["lf0f-3", "lf0f-5-retry"]


def test_figures_count_answers_and_time_the_refused_from_the_resume() -> None:
    f = phase().figures()
    assert (f["sent"], f["answered"], f["failed"], f["answered_by_retry"]) == (8, 7, 1, 1)
    assert (f["refused"], f["refused_answered"], f["refused_unmatched"]) == (2, 1, 0)
    assert f["refused_first_token_after_resume_s"] == [1.4]  # 9.9 + 21.5 - 30
    assert f["refused_retry_first_token_after_resume_s"] == [1.5]  # 9.5 + 22 - 30
    assert (f["caught"], f["caught_failed"]) == (1, 0)
    assert f["before"]["n"] == 2 and f["after"]["ttft_p50_s"] in (0.2, 0.4)
    assert f["after"]["tpot_p50_s"] is not None


def test_counts_table_has_a_row_per_phase_and_the_result_a_ratio_per_case() -> None:
    figures = [phase(p).figures() for p in POLICIES]
    table = counts_table(figures)
    assert table.count("\n") == 3 and "| recompute | 1 | 8 | 7 | 1 | 2 (1) |" in table
    result = summarize([phase(p) for p in POLICIES], {"checked": 1, "equal": 1}, 1, True, Path("."))
    assert [r.subject for r in result.ratios] == ["recompute"] * len(result.cases)
    assert "1 of 1 equal" in result.table()


class _Pair(BaseHTTPRequestHandler):
    """A prefill (not streamed: the params) and a decode (streamed, or ``decode_status``) on one port."""

    seen: list[tuple[str, dict[str, Any]]] = []
    decode_status = 200

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Pair.seen.append((self.headers["X-Request-Id"], body))
        if not body.get("stream"):
            self._send(200, {"choices": [{"token_ids": [9]}], "kv_transfer_params": {"remote_block_ids": [[1]]}})
            return
        if _Pair.decode_status != 200:
            self._send(_Pair.decode_status, {"error": "load failed"})
            return
        self.send_response(200)
        self.end_headers()
        for ids in ([7], [8]):
            self.wfile.write(b"data: " + json.dumps({"choices": [{"token_ids": ids, "text": "x"}]}).encode() + b"\n\n")
        self.wfile.write(b"data: [DONE]\n\n")

    def _send(self, status: int, answer: dict[str, Any]) -> None:
        raw = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def pair() -> Iterator[tuple[str, int]]:
    _Pair.seen, _Pair.decode_status = [], 200
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Pair)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield "127.0.0.1", server.server_address[1]
    server.shutdown()


def test_one_request_goes_through_the_proxy_flow_timed_from_its_first_send(pair: tuple[str, int]) -> None:
    t0 = time.monotonic() - 2.0  # the clients time a retry from the first send
    ttft, ids, error = pd_once(pair, pair, {"prompt": [1, 2]}, "lf0f-1", t0)
    assert error is None and ids == [7, 8] and ttft is not None and ttft >= 2.0
    (rid_p, prefill), (rid_d, decode) = _Pair.seen
    assert rid_p == rid_d == "lf0f-1"  # so the decode's log names the client's request
    assert prefill["max_tokens"] == 1 and prefill["kv_transfer_params"] == {"do_remote_decode": True}
    assert decode["stream"] is True and decode["kv_transfer_params"] == {"remote_block_ids": [[1]]}


def test_a_failed_decode_is_an_error_with_no_tokens(pair: tuple[str, int]) -> None:
    _Pair.decode_status = 500
    ttft, ids, error = pd_once(pair, pair, {"prompt": [1, 2]}, "lf0f-2", time.monotonic())
    assert (ttft, ids) == (None, []) and error is not None and "HTTP 500" in error
