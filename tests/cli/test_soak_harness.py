"""The soak harness without engines: its plan, its clients against a real local HTTP server, its
report's arithmetic, and ``kvcompose soak``'s refusals. The run itself, with real engines, is
``tests/engine/test_soak.py``."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from kvcompose.cli import main
from kvcompose.compose import load
from kvcompose.e2e.node import free_ports
from kvcompose.soak.drive import Injector, Load, Outcome, send
from kvcompose.soak.plan import FLAKY, QUICK, SoakOptions, decode_composition, plan
from kvcompose.soak.report import Comparison, SoakReport, by_request, during, hang_ups, quiet_problems


def test_a_plan_is_drawn_from_its_seed_alone() -> None:
    a, fa = plan(QUICK)
    b, fb = plan(QUICK)
    c, fc = plan(SoakOptions(requests=QUICK.requests, concurrency=8, seed=1))
    assert [r.prompt for r in a] == [r.prompt for r in b] and fa == fb
    assert [r.prompt for r in a] != [r.prompt for r in c]
    n = QUICK.requests
    assert 0.15 * n <= fa.kill_prefill_at <= 0.35 * n < 0.55 * n <= fa.kill_decode_at <= 0.75 * n
    hang = [r.hang_up for r in a if r.hang_up is not None]
    assert {h.path for h in hang} == {"router", "direct"}
    assert hang_ups(a) == {p: sum(h.path == p for h in hang) for p in ("router", "direct")}
    assert hang_ups(plan(SoakOptions(requests=20, hangups=0.0))[0]) == {"router": 0, "direct": 0}
    # Prompts share prefixes (the host tier's work): a prefix of 256 tokens recurs.
    assert len({tuple(r.prompt[:256]) for r in a}) <= QUICK.prefixes < len(a)


def test_the_decode_composition_is_the_shipped_example_with_a_flaky_child_under_a_breaker(tmp_path: Path) -> None:
    _, faults = plan(QUICK)
    composed = load(decode_composition(faults, tmp_path))
    assert [c.name for c in composed.children] == [FLAKY, "host", "pd"]
    assert "breaker" in "\n".join(composed.explain())
    assert len(faults.describe()) == 2 + len(faults.flaky_faults)


@pytest.mark.parametrize("argv", [["--requests", "5"], ["--concurrency", "0"]])
def test_soak_refuses_sizes_it_cannot_run_with_a_clear_message(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["soak", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvcompose soak: --requests must be >= 20") and "Traceback" not in err


class _Server:
    """A local HTTP server answering ``POST /v1/completions`` from a script of statuses."""

    def __init__(self, statuses: list[int], delay_s: float = 0.0) -> None:
        self.statuses = statuses
        self.seen = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                self.rfile.read(int(self.headers["Content-Length"]))
                status = server.statuses[min(server.seen, len(server.statuses) - 1)]
                server.seen += 1
                threading.Event().wait(delay_s)
                body = json.dumps(
                    {"choices": [{"token_ids": [7, 8], "logprobs": {"token_logprobs": [-0.5, -0.25]}}]}
                    if status == 200
                    else {"error": "down"}
                ).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.handle_error = lambda *args: None  # type: ignore[method-assign]  # a client that hung up
        self.http_port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def port(self, role: str) -> int:
        """Every role (router, prefill, decode) is this server."""
        return self.http_port


@pytest.fixture
def server(request: pytest.FixtureRequest) -> Iterator[_Server]:
    s = _Server(*request.param)
    yield s
    s.httpd.shutdown()


@pytest.mark.parametrize("server", [([200],)], indirect=True)
def test_send_tells_an_answer_a_hang_up_and_a_dead_port_apart(server: _Server) -> None:
    kind, _, answer = send(server.http_port, {"prompt": [1]})
    assert kind == "answered" and answer is not None
    assert send(server.http_port, {"prompt": [1]}, hang_up_after=0.0)[0] == "hung-up"
    (dead,) = free_ports(1)
    assert send(dead, {"prompt": [1]})[0] == "dropped"


@pytest.mark.parametrize("server", [([503, 503, 200],)], indirect=True)
def test_a_failed_request_is_sent_again_until_it_is_answered(server: _Server) -> None:
    requests, _ = plan(SoakOptions(requests=20, hangups=0.0))
    load = Load(requests[:1], server, "m", 2)
    load.run(1)
    assert [o.kind for o in load.outcomes] == ["http-error", "http-error", "answered"]
    assert [o.attempt for o in load.outcomes] == [0, 1, 2]
    assert load.outcomes[-1].token_ids == [7, 8]
    assert by_request(load.outcomes) == {"answered": 1, "hung-up": 0, "gave-up": 0}


@pytest.mark.parametrize("server", [([200],)], indirect=True)
def test_the_injector_kills_and_restarts_once_the_count_is_sent(server: _Server) -> None:
    calls: list[str] = []

    class Servers:
        def kill(self, role: str) -> None:
            calls.append(f"kill {role} after {load.sent} sent")

        def restart(self, role: str) -> None:
            calls.append(f"restart {role}")

    requests, _ = plan(SoakOptions(requests=20, hangups=0.0))
    load = Load(requests[:4], server, "m", 1)
    injector = Injector(load, Servers(), [(3, "decode"), (1, "prefill")])
    injector.start()
    load.run(1)
    injector.join()
    assert [c.split(" after")[0] for c in calls] == ["kill prefill", "restart prefill", "kill decode", "restart decode"]
    assert [o[0] for o in injector.outages] == ["prefill", "decode"] and injector.error is None
    assert by_request(load.outcomes)["answered"] == 4


def test_failures_are_counted_against_the_outage_they_fall_in() -> None:
    def o(kind: str, at: float, latency: float = 0.1) -> Outcome:
        return Outcome(0, 0, kind, at, latency, "router")

    outages = [("prefill", 10.0, 40.0)]
    got = [
        o("http-error", 12.0),
        o("http-error", 9.95),
        o("http-error", 50.0),
        o("http-error", 80.0),
        o("answered", 20),
    ]
    assert during(got, outages) == 3  # killed at 10 s; back at 40 s, plus the router's 15 s to take it back


def test_an_engine_not_back_to_zero_is_named_with_what_it_holds() -> None:
    quiet = {"prefill": {"running": 0.0, "kv_usage": 0.25}, "decode": {"running": 0.0}}
    assert quiet_problems(quiet) == ["prefill: not back to 0 once quiet: {'kv_usage': 0.25}"]
    assert quiet_problems({"decode": {"running": 0.0}}) == ["prefill: no reading once quiet (server not answering)"]


def test_the_report_names_every_figure_and_each_failed_check() -> None:
    report = SoakReport(
        options={"concurrency": 8, "seed": 3},
        faults=["SIGKILL the prefill server once 30 requests were sent, then restart it"],
        events=["    4.7 s  prefill killed (SIGKILL) after 36 requests sent"],
        wall_s=200.0,
        requests={"answered": 149, "hung-up": 11, "gave-up": 0},
        hang_ups={"router": 4, "direct": 7},
        attempts={"answered": 149, "http-error": 136, "dropped": 0, "hung": 0, "hung-up": 11},
        first_errors=["http-error: HTTP 500: Transparent proxy request failed"],
        failed_during_outages=136,
        latency_p50_s=1.041,
        latency_p99_s=5.265,
        quiet={"prefill": {"running": 0.0}, "decode": {"running": 0.0}},
        settle_s=1.0,
        counters={"decode": {"aborted_mid_load": 3.0}, "decode-3": {"aborted_mid_load": 1.0}},
        prefill_held_after_decode_kill=0.486,
        lease_releases=32,
        breaker_changes=["open", "half-open", "closed"],
        processes=["prefill: killed by the soak (SIGKILL), as planned"],
        comparison=Comparison(compared=16, bit_equal=16, tokens_equal=16),
        problems=[],
        logs="/tmp/x",
    )
    text = report.render()
    for figure in (
        "answered              149   latency p50 1041 ms, p99 5265 ms",
        "(vllm:kvcompose_aborted_loads): decode 4, prefill 0",
        "failed cleanly        136",
        "up to 48.6%",
        "the blocks of 32 request(s) on NIXL lease expiry",
        "open 1x, half-open 1x, closed 1x",
        "token ids equal 16/16, bit for bit 16/16",
        "result: PASS",
    ):
        assert figure in text, figure
    report.problems = ["decode: not back to 0 once quiet: {'kv_usage': 0.5}"]
    assert report.render().endswith("result: FAIL\n  - decode: not back to 0 once quiet: {'kv_usage': 0.5}")
    assert json.loads(json.dumps(report.as_dict()))["requests"]["answered"] == 149
