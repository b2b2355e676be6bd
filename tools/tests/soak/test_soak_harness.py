"""The soak harness without engines: its plan, its clients against a real local HTTP server
(streamed answers included), its report's arithmetic, its reading of vLLM's prefill logs, and
``kvcompose soak``'s refusals. The run itself, with real engines, is
``tools/tests/engine/test_soak.py``."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from kvcompose.cli import main
from kvcompose.compose import load
from kvcompose.examples import EXAMPLES
from kvcompose_tools.e2e.load import LATE_READ, LEASE_EXPIRY, REFUSED_READ
from kvcompose_tools.e2e.ports import free_ports
from kvcompose_tools.e2e.server import completion_body, parse_completion
from kvcompose_tools.e2e.stream import send
from kvcompose_tools.soak.drive import PAUSED, Injector, Load, Outcome
from kvcompose_tools.soak.plan import (
    CUT_BEYOND_LEASE_S,
    FLAKY,
    PAUSE_BEYOND_LEASE_S,
    QUICK,
    SoakOptions,
    decode_composition,
    plan,
    prefill_lease_s,
)
from kvcompose_tools.soak.report import (
    TTFT_BOUND_S,
    Comparison,
    LogLine,
    SoakReport,
    by_request,
    cut_off_problems,
    during,
    first_tokens,
    hang_ups,
    lease_problems,
    log_time,
    logged,
    planned_causes,
    process_logs,
    quiet_problems,
    unplanned_expiries,
    used_late_reads,
)


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
    assert len(faults.describe()) == 2 + len(faults.pauses) + len(faults.flaky_faults)
    native = load(decode_composition(faults, tmp_path / "native", "native"))
    assert [(c.name, c.type.name) for c in native.children] == [
        (FLAKY, "faulty"),
        ("host", "native-offload"),
        ("pd", "nixl"),
    ]


def test_the_host_tier_names_the_shipped_pair_the_soak_runs(capsys: pytest.CaptureFixture[str]) -> None:
    assert SoakOptions(host_tier="native").host_tier == "native"
    with pytest.raises(ValueError, match="--host-tier one of simple, native"):
        SoakOptions(host_tier="lmcache")
    with pytest.raises(SystemExit):
        main(["soak", "--host-tier", "lmcache"])
    assert "invalid choice: 'lmcache'" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--requests", "5"], ["--concurrency", "0"]])
def test_soak_refuses_sizes_it_cannot_run_with_a_clear_message(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["soak", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvcompose soak: --requests must be >= 20") and "Traceback" not in err


#: What a streamed answer of ``_Server`` sends: vLLM's chunks for two tokens (the first carries the
#: prompt's ids), each a ``data:`` event.
CHUNKS = [
    {"choices": [{"text": "", "token_ids": [7], "logprobs": {"token_logprobs": [-0.5]}, "prompt_token_ids": [1]}]},
    {"choices": [{"text": "", "token_ids": [8], "logprobs": {"token_logprobs": [-0.25]}, "finish_reason": "length"}]},
]


class _Server:
    """A local HTTP server answering ``POST /v1/completions`` from a script of statuses; a request
    with ``"stream": true`` gets server-sent events as vLLM sends them (chunked, ``data: {json}``,
    then ``data: [DONE]``), the first token ``first_token_s`` after the request, ``events`` in
    place of :data:`CHUNKS` and ``[DONE]`` when given (an error event, a stream cut off)."""

    def __init__(
        self, statuses: list[int], delay_s: float = 0.0, first_token_s: float = 0.0, events: list[str] | None = None
    ) -> None:
        self.statuses = statuses
        self.seen = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # chunked streams, as vLLM's server (uvicorn) sends them

            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                status = server.statuses[min(server.seen, len(server.statuses) - 1)]
                server.seen += 1
                threading.Event().wait(delay_s)
                if status == 200 and request.get("stream"):
                    self._stream()
                    return
                body = json.dumps(
                    {"choices": [{"token_ids": [7, 8], "logprobs": {"token_logprobs": [-0.5, -0.25]}}]}
                    if status == 200
                    else {"error": "down"}
                ).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _stream(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                threading.Event().wait(first_token_s)
                sent = [f"data: {json.dumps(c)}" for c in CHUNKS] + ["data: [DONE]"] if events is None else events
                for event in sent:
                    data = f"{event}\n\n".encode()
                    self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                    self.wfile.flush()
                    threading.Event().wait(0.05)  # a token's step
                if events is None:
                    self.wfile.write(b"0\r\n\r\n")
                self.close_connection = True  # a scripted stream without its last chunk ends here

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.handle_error = lambda *args: None  # type: ignore[method-assign]  # a client that hung up
        self.http_port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def address(self, role: str) -> tuple[str, int]:
        """Every role (router, prefill, decode) is this server."""
        return "127.0.0.1", self.http_port


@pytest.fixture
def server(request: pytest.FixtureRequest) -> Iterator[_Server]:
    s = _Server(*request.param)
    yield s
    s.httpd.shutdown()


@pytest.mark.parametrize("server", [([200],)], indirect=True)
def test_send_tells_an_answer_a_hang_up_and_a_dead_port_apart(server: _Server) -> None:
    kind, _, answer, ttft = send(server.address("router"), {"prompt": [1]})
    assert kind == "answered" and answer is not None and ttft is None  # not streamed: no first token seen
    assert send(server.address("router"), {"prompt": [1]}, hang_up_after=0.0).kind == "hung-up"
    assert send(server.address("router"), {"prompt": [1], "stream": True}, hang_up_after=0.0).kind == "hung-up"
    (dead,) = free_ports(1)
    assert send(("127.0.0.1", dead), {"prompt": [1]}).kind == "dropped"
    assert send(("127.0.0.1", dead), {"prompt": [1], "stream": True}).kind == "dropped"


@pytest.mark.parametrize("server", [([200], 0.0, 0.4)], indirect=True)
def test_a_streamed_answer_is_joined_and_its_first_token_timed(server: _Server) -> None:
    t0 = time.monotonic()
    kind, detail, answer, ttft = send(server.address("router"), {**completion_body("m", [1], 2), "stream": True})
    wall = time.monotonic() - t0
    assert (kind, detail) == ("answered", "") and answer is not None and ttft is not None
    # The first token came 0.4 s after the request, the second and [DONE] 50 ms apart after it.
    assert 0.4 <= ttft < wall - 0.05
    parsed = parse_completion(answer, wall)
    assert parsed["token_ids"] == [7, 8] and parsed["logprobs"] == [-0.5, -0.25]
    assert parsed["finish_reason"] == "length" and parsed["prompt_token_ids"] == [1]


@pytest.mark.parametrize("server", [([200],)], indirect=True)
def test_a_first_token_is_timed_from_the_t0_given(server: _Server) -> None:
    # The proxy flow times the decode's first token from the prefill's send.
    got = send(server.address("router"), {"prompt": [1], "stream": True}, t0=time.monotonic() - 5.0)
    assert got.kind == "answered" and got.ttft_s is not None and got.ttft_s >= 5.0
    assert got.token_ids == [7, 8]
    assert send(server.address("router"), {"prompt": [1]}).token_ids == [7, 8]


@pytest.mark.parametrize(
    ("server", "kind", "detail"),
    [
        (
            ([200], 0.0, 0.0, ['data: {"error": {"message": "boom", "code": 500}}', "data: [DONE]"]),
            "http-error",
            "boom",
        ),
        # An error event after a token (vLLM's older error shape): failed, whatever came before it.
        (
            ([200], 0.0, 0.0, [f"data: {json.dumps(CHUNKS[0])}", 'data: {"object": "error", "message": "x"}']),
            "http-error",
            "an error in the stream",
        ),
        # A choice finished for error (vLLM's finish_reason when a request fails in the engine).
        (
            ([200], 0.0, 0.0, ['data: {"choices": [{"text": "", "finish_reason": "error"}]}', "data: [DONE]"]),
            "http-error",
            "an error in the stream",
        ),
        # [DONE] with no token before it: nothing was answered.
        (([200], 0.0, 0.0, ["data: [DONE]"]), "http-error", "without a token"),
        (
            ([200], 0.0, 0.0, ['data: {"choices": [{"text": "", "token_ids": []}]}', "data: [DONE]"]),
            "http-error",
            "without a token",
        ),
        # The server behind the router died mid-answer: the 200 went out, [DONE] never comes.
        (([200], 0.0, 0.0, [f"data: {json.dumps(CHUNKS[0])}"]), "cut-off", "after 1 tokens"),
        (([503],), "http-error", "HTTP 503"),
    ],
    indirect=["server"],
)
def test_a_stream_with_an_error_event_or_cut_off_is_not_answered(server: _Server, kind: str, detail: str) -> None:
    got = send(server.address("router"), {"prompt": [1], "stream": True})
    assert (got.kind, got.answer, got.ttft_s) == (kind, None, None)
    assert detail in got.detail


@pytest.mark.parametrize("server", [([503, 503, 200],)], indirect=True)
def test_a_failed_request_is_sent_again_until_it_is_answered(server: _Server) -> None:
    requests, _ = plan(SoakOptions(requests=20, hangups=0.0))
    load = Load(requests[:1], server, "m", 2)
    load.run(1)
    assert [o.kind for o in load.outcomes] == ["http-error", "http-error", "answered"]
    assert [o.attempt for o in load.outcomes] == [0, 1, 2]
    assert load.outcomes[-1].token_ids == [7, 8] and load.outcomes[-1].logprobs == [-0.5, -0.25]
    assert by_request(load.outcomes) == {"answered": 1, "hung-up": 0, "gave-up": 0}
    # The clients stream: the answer's first token is timed, a failed attempt has none.
    assert [o.ttft_s is not None for o in load.outcomes] == [False, False, True]
    assert 0 < (load.outcomes[-1].ttft_s or 0) < load.outcomes[-1].latency_s


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
    before = time.time()
    injector.start()
    load.run(1)
    injector.join()
    assert [c.split(" after")[0] for c in calls] == ["kill prefill", "restart prefill", "kill decode", "restart decode"]
    assert [o[0] for o in injector.outages] == ["prefill", "decode"] and injector.error is None
    # Each kill's wall-clock time, what the servers' log times are read against.
    assert [name for name, _, _ in injector.kills] == ["prefill", "decode"]
    # From just before the SIGKILL until the replacement was healthy.
    (_, killed, healthy), (_, killed_2, _) = injector.kills
    assert before <= killed <= healthy <= killed_2 <= time.time()
    assert by_request(load.outcomes)["answered"] == 4


class _LinkServers:
    """The stack's fault surface (:class:`kvcompose_tools.soak.drive.Servers`), recording its calls."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def kill(self, role: str) -> None:
        self.calls.append(f"kill {role}")

    def restart(self, role: str) -> None:
        self.calls.append(f"restart {role}")

    def cut_link(self) -> None:
        self.calls.append("cut")

    def restore_link(self) -> None:
        self.calls.append("restore")


@pytest.mark.parametrize("server", [([200],)], indirect=True)
def test_the_injector_cuts_the_link_restores_it_and_waits_for_the_pair_to_serve(server: _Server) -> None:
    servers = _LinkServers()
    requests, _ = plan(SoakOptions(requests=20, hangups=0.0))
    load = Load(requests, server, "m", 1)
    injector = Injector(load, servers, [(12, "decode")], cut=(2, 0.3))
    before = time.time()
    injector.start()
    load.run(1)
    injector.join()
    assert servers.calls == ["cut", "restore", "kill decode", "restart decode"] and injector.error is None
    (cut,) = injector.cuts
    assert before <= cut[0] and cut[1] - cut[0] >= 0.3
    (name, down, back), _ = injector.outages
    assert name == "link"
    # The outage lasts until a request sent after the restore was answered.
    restored = down + 0.3
    assert any(
        o.kind == "answered" and restored <= o.sent_at and o.sent_at + o.latency_s <= back for o in load.outcomes
    )


@pytest.mark.parametrize("server", [([200],)], indirect=True)
def test_a_pair_that_serves_no_request_after_the_restore_is_a_failed_injection(server: _Server) -> None:
    servers = _LinkServers()
    requests, _ = plan(SoakOptions(requests=20, hangups=0.0))
    load = Load(requests[:3], server, "m", 1)
    injector = Injector(load, servers, [], cut=(3, 1.5))  # the load ends while the link is cut
    injector.start()
    load.run(1)
    injector.join()
    assert servers.calls == ["cut", "restore"]
    assert "no request sent after the link's restore was answered" in str(injector.error)


class _PauseServers(_LinkServers):
    """:class:`_LinkServers` that pauses and resumes too, with the load's count at each call."""

    def __init__(self, load: Load | None = None) -> None:
        super().__init__()
        self.load = load

    def pause(self, role: str) -> None:
        self.calls.append(f"pause {role}")

    def resume(self, role: str) -> None:
        self.calls.append(f"resume {role}")


@pytest.mark.parametrize("server", [([200],)], indirect=True)
def test_the_injector_pauses_resumes_and_waits_for_the_pair_to_serve(server: _Server) -> None:
    servers = _PauseServers()
    requests, _ = plan(SoakOptions(requests=20, hangups=0.0))
    load = Load(requests, server, "m", 1)
    injector = Injector(load, servers, [(14, "prefill")], pauses=[(8, "decode"), (2, "prefill")], pause_s=0.3)
    before = time.time()
    injector.start()
    load.run(1)
    injector.join()
    assert injector.error is None
    assert servers.calls == [
        "pause prefill",
        "resume prefill",
        "pause decode",
        "resume decode",
        "kill prefill",
        "restart prefill",
    ]
    # Each pause's wall-clock stop and resume, what the prefill's log times are read against.
    assert [name for name, _, _ in injector.pauses] == ["prefill", "decode"]
    assert before <= injector.pauses[0][1] < injector.pauses[0][2] <= injector.pauses[1][1]
    # Each pause is an outage until a request sent after its resume was answered.
    names = [name for name, _, _ in injector.outages]
    assert names == [PAUSED.format(role="prefill"), PAUSED.format(role="decode"), "prefill"]
    for _, down, back in injector.outages[:2]:
        assert any(
            o.kind == "answered" and down + 0.3 <= o.sent_at and o.sent_at + o.latency_s <= back for o in load.outcomes
        )
    text = "\n".join(injector.events)
    assert "prefill paused (SIGSTOP) after" in text and "decode resumed (SIGCONT) after" in text
    assert "the pair serves again: a request sent after the decode's resume answered" in text


@pytest.mark.parametrize("server", [([200],)], indirect=True)
def test_a_paused_server_is_resumed_even_when_nothing_is_answered_after(server: _Server) -> None:
    servers = _PauseServers()
    requests, _ = plan(SoakOptions(requests=20, hangups=0.0))
    load = Load(requests[:3], server, "m", 1)
    injector = Injector(load, servers, [], pauses=[(3, "decode")], pause_s=1.5)  # the load ends while paused
    injector.start()
    load.run(1)
    injector.join()
    assert servers.calls == ["pause decode", "resume decode"]
    assert "no request sent after the decode's resume was answered" in str(injector.error)


def test_a_plan_pauses_each_server_once_longer_than_the_lease_and_keeps_the_other_faults() -> None:
    """The pauses are drawn after every other fault: a seed's kills, flaky faults and cut are the
    ones it drew before pauses existed, whatever the pause's margin."""
    n = QUICK.requests
    for hosts in (False, True):
        _, f = plan(SoakOptions(requests=n, concurrency=8, hosts=hosts))
        _, quick = plan(SoakOptions(requests=n, concurrency=8, hosts=hosts, pause_beyond_lease_s=1.0))
        assert (f.kill_prefill_at, f.kill_decode_at, f.flaky_faults, f.cut_link_at) == (
            quick.kill_prefill_at,
            quick.kill_decode_at,
            quick.flaky_faults,
            quick.cut_link_at,
        )
        assert sorted(role for _, role in f.pauses) == ["decode", "prefill"]
        assert f.pause_prefill_at is not None and f.pause_decode_at is not None
        # Clear of the kills and the cut, with requests left to send after the decode's resume.
        assert 0.05 * n <= f.pause_prefill_at <= 0.12 * n < f.kill_prefill_at
        assert f.kill_decode_at < 0.78 * n <= f.pause_decode_at <= 0.88 * n
        assert f.pause_s == prefill_lease_s() + PAUSE_BEYOND_LEASE_S > prefill_lease_s()
        assert quick.pause_s == prefill_lease_s() + 1.0
        assert sum("SIGSTOP" in line and "then SIGCONT" in line for line in f.describe()) == 2
    assert plan(QUICK)[1].pause_s > prefill_lease_s()  # CI's shorter margin still outlives the lease
    with pytest.raises(ValueError, match="the pauses' margin past the lease > 0"):
        SoakOptions(pause_beyond_lease_s=0.0)


def test_expiries_are_planned_from_a_pause_to_a_lease_after_its_resume() -> None:
    """A stopped decode reads nothing: the leases of what the prefill holds for it run out while it
    is stopped; a stopped prefill's reaper runs out the leases its pause held up on its first steps
    after the resume. Either pause is a span, like a cut."""

    class Faults:
        kills = [("prefill", datetime(2026, 11, 26, 5, 0, 0).timestamp(), datetime(2026, 11, 26, 5, 1, 0).timestamp())]
        cuts: list[tuple[float, float]] = []
        pauses = [
            ("prefill", datetime(2026, 11, 26, 5, 10, 0).timestamp(), datetime(2026, 11, 26, 5, 10, 35).timestamp())
        ]

    causes = planned_causes(Faults(), [], 0.0)  # type: ignore[arg-type]
    assert causes == [
        (datetime(2026, 11, 26, 5, 10, 0), datetime(2026, 11, 26, 5, 10, 35))
    ]  # a prefill kill plans none
    lines = [
        LogLine(datetime(2026, 11, 26, 5, m, sec), f"{m}:{sec}") for m, sec in ((0, 20), (10, 36), (11, 20), (11, 21))
    ]
    # From the pause's second to the resume plus the lease and its slack (05:11:20).
    assert [e.text for e in unplanned_expiries(lines, causes, lease_s=30.0, slack_s=15.0)] == ["0:20", "11:21"]


def test_expiries_are_planned_while_the_killed_decode_restarts_and_a_lease_after() -> None:
    """A direct request (the proxy flow by hand) retried while the decode is down is prefilled at
    every try, and its blocks wait for a lease however long the restart takes (a soak run here saw
    one such expiry every 8 s, a client's longest back-off, through an 85 s restart)."""

    class Faults:
        kills = [("decode", datetime(2026, 11, 26, 5, 0, 0).timestamp(), datetime(2026, 11, 26, 5, 1, 25).timestamp())]
        cuts: list[tuple[float, float]] = []
        pauses: list[tuple[str, float, float]] = []

    causes = planned_causes(Faults(), [], 0.0)  # type: ignore[arg-type]
    lines = [LogLine(datetime(2026, 11, 26, 5, m, sec), f"{m}:{sec}") for m, sec in ((0, 46), (2, 10), (2, 11))]
    # Until the replacement was healthy (05:01:25), plus the lease and its slack (05:02:10).
    assert [e.text for e in unplanned_expiries(lines, causes, lease_s=30.0, slack_s=15.0)] == ["2:11"]


def test_a_plan_across_hosts_adds_a_link_cut_longer_than_the_lease_and_keeps_the_other_faults() -> None:
    requests, one = plan(QUICK)
    across, two = plan(SoakOptions(requests=QUICK.requests, concurrency=8, hosts=True))
    assert [r.prompt for r in requests] == [r.prompt for r in across]
    assert (one.kill_prefill_at, one.kill_decode_at, one.flaky_faults) == (
        two.kill_prefill_at,
        two.kill_decode_at,
        two.flaky_faults,
    )
    assert one.cut_link_at is None and not any("link" in f for f in one.describe())
    n = QUICK.requests
    assert two.cut_link_at is not None and two.kill_prefill_at < 0.40 * n <= two.cut_link_at <= 0.50 * n
    assert two.cut_s == prefill_lease_s() + CUT_BEYOND_LEASE_S
    assert any(
        f.startswith(f"cut the link between the prefill and the decode host once {two.cut_link_at}")
        for f in two.describe()
    )


def test_a_lease_expiry_during_a_link_cut_and_a_lease_after_it_is_planned() -> None:
    cut, restored = datetime(2026, 11, 26, 5, 12, 0, 300_000), datetime(2026, 11, 26, 5, 12, 40)
    lines = [LogLine(datetime(2026, 11, 26, 5, 11, 59), "before"), LogLine(datetime(2026, 11, 26, 5, 12, 0), "cut")]
    lines += [LogLine(datetime(2026, 11, 26, 5, 13, 25), "in"), LogLine(datetime(2026, 11, 26, 5, 13, 26), "late")]
    # From the cut's second to the restore plus the lease and its slack (05:13:25).
    got = unplanned_expiries(lines, [(cut, restored)], lease_s=30.0, slack_s=15.0)
    assert [e.text for e in got] == ["before", "late"]


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
        options={"concurrency": 8, "seed": 3, "hosts": True, "link": "781mbit"},
        faults=["SIGKILL the prefill server once 30 requests were sent, then restart it"],
        events=["    4.7 s  prefill killed (SIGKILL) after 36 requests sent"],
        wall_s=200.0,
        requests={"answered": 149, "hung-up": 11, "gave-up": 0},
        hang_ups={"router": 4, "direct": 7},
        attempts={"answered": 149, "http-error": 136, "dropped": 0, "cut-off": 3, "hung": 0, "hung-up": 11},
        first_errors=["http-error: HTTP 500: Transparent proxy request failed"],
        failed_during_outages=136,
        cut_off_during_outages=3,
        latency_p50_s=1.041,
        latency_p99_s=5.265,
        ttft_p50_s=0.312,
        ttft_p99_s=2.5,
        ttft_max_s=7.25,
        ttft_slow=0,
        ttft_in_outages=40,
        ttft_slow_in_outages=2,
        quiet={"prefill": {"running": 0.0}, "decode": {"running": 0.0}},
        settle_s=1.0,
        counters={"decode": {"aborted_mid_load": 3.0}, "decode-3": {"aborted_mid_load": 1.0}},
        prefill_held_after_decode_kill=0.486,
        lease_releases=32,
        lease_releases_unplanned=0,
        late_reads=0,
        refused_reads=2,
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
        "cut off                 3   (the stream ended before [DONE]; 3 while a server was down",
        "up to 48.6%",
        "the blocks of 32 request(s) on NIXL lease expiry",
        "seed 3, prefill and decode on hosts of their own, link 781mbit, 200 s",
        "0 outside the lease after the decode's kill, a pause or the link's cut (must be 0)",
        "decode reads after the prefill's lease expired, not refused: 0 (must be 0",
        "refused by the decode's nixl child: 2",
        "time to first token (streamed): p50 312 ms, p99 2500 ms, max 7250 ms; above 5 s: 0 outside the outages",
        "2 of 40 answered while a server was down",
        "open 1x, half-open 1x, closed 1x",
        "token ids equal 16/16, bit for bit 16/16",
        "result: PASS",
    ):
        assert figure in text, figure
    report.problems = ["decode: not back to 0 once quiet: {'kv_usage': 0.5}"]
    assert report.render().endswith("result: FAIL\n  - decode: not back to 0 once quiet: {'kv_usage': 0.5}")
    as_json = json.loads(json.dumps(report.as_dict()))
    assert as_json["requests"]["answered"] == 149
    assert {k: as_json[k] for k in ("late_reads", "lease_releases_unplanned", "ttft_p99_s", "ttft_max_s")} == {
        "late_reads": 0,
        "lease_releases_unplanned": 0,
        "ttft_p99_s": 2.5,
        "ttft_max_s": 7.25,
    }


def test_a_stream_cut_off_is_a_problem_only_outside_the_outages() -> None:
    def o(kind: str, at: float) -> Outcome:
        return Outcome(0, 0, kind, at, 1.0, "router", detail=f"broke at {at}")

    outages = [("decode", 100.0, 150.0)]
    got = [o("cut-off", 99.5), o("cut-off", 120.0), o("http-error", 30.0), o("answered", 30.0)]
    assert cut_off_problems(got, outages) == []  # the decode killed mid-answer
    assert during(got, outages, kind="cut-off") == 2
    got.append(o("cut-off", 30.0))
    assert cut_off_problems(got, outages) == [
        "1 stream(s) broke off before [DONE] while every server was up, e.g. broke at 30.0"
    ]


def test_first_tokens_are_held_to_the_bound_outside_the_outages_only() -> None:
    def o(at: float, ttft: float | None, kind: str = "answered", latency: float = 8.0) -> Outcome:
        return Outcome(len(got), 0, kind, at, latency, "router", ttft_s=ttft)

    outages = [("decode", 100.0, 150.0)]
    got: list[Outcome] = []
    got += [o(10.0 + i, 0.2 + i / 100) for i in range(20)]  # the quiet part of the run
    got.append(o(40.0, TTFT_BOUND_S + 1.5))  # a stall with every server up: the check's target
    got.append(o(93.0, 30.0))  # sent 7 s before the kill, still running at it
    got.append(o(160.0, 12.0))  # within 15 s of the decode being healthy again: the router taking it back
    got.append(o(120.0, 0.1))  # answered in an outage, under the bound
    got.append(o(50.0, None, kind="http-error"))  # failed: no first token
    ft = first_tokens(got, outages)
    assert [x.index for x in ft.slow] == [20]
    assert (ft.in_outages, ft.slow_in_outages) == (3, 2)
    assert ft.max_s == 30.0 and 0.2 <= ft.p50_s <= 0.4
    (problem,) = ft.problems()
    assert problem.startswith(f"1 answered request(s) outside the outages waited over {TTFT_BOUND_S:g} s")
    assert "request 20 6.5 s (sent at 40.0 s)" in problem
    # Without the stall: nothing to report, however slow the requests during the outage were.
    assert first_tokens([x for x in got if x.index != 20], outages).problems() == []
    # Without outage windows every slow answer counts.
    assert len(first_tokens(got, []).slow) == 3


#: Lines as vLLM's prefill writes them (vllm/logger.py's format; NIXL's worker's messages).
NEAR = datetime(2026, 11, 26, 5, 0, 0)
EXPIRY = (
    "(EngineCore pid=3627) WARNING 11-26 {t} [nixl/base_worker.py:3033] Releasing expired KV blocks for request "
    "cmpl-{r}-0 which were retrieved by 0 remote worker(s) before lease expired."
)
LATE = (
    "(EngineCore pid=3627) ERROR 11-26 {t} [nixl/pull_worker.py:668] Potentially invalid KV blocks for unrecognized "
    "request cmpl-{r}-0 were retrieved by a decode worker. They may have expired."
)


def test_a_vllm_log_lines_time_is_read_from_its_header() -> None:
    line = EXPIRY.format(t="05:12:02", r="a")
    assert log_time(line, NEAR) == datetime(2026, 11, 26, 5, 12, 2)
    # Coloured (VLLM_LOGGING_COLOR=1), with a prefix (VLLM_LOGGING_PREFIX), another process's name.
    coloured = (
        "\x1b[0;36m(EngineCore_DP0 pid=7)\x1b[0;0m \x1b[33mWARNING\x1b[0m \x1b[90m11-26 05:12:03\x1b[0m [x.py:1] hi"
    )
    assert log_time(coloured, NEAR) == datetime(2026, 11, 26, 5, 12, 3)
    assert log_time("[node-1] (APIServer pid=12) INFO 11-26 23:59:59 [a.py:2] up", NEAR) == datetime(
        2026, 11, 26, 23, 59, 59
    )
    # No header (a traceback line, a message quoting a time): no time.
    assert log_time("Traceback (most recent call last): 11-26 05:12:02", NEAR) is None
    assert log_time("(EngineCore pid=1) WARNING 13-45 05:12:02 [a.py:1] not a date", NEAR) is None
    # The header has no year: the nearest one to the run (a run over New Year; 02-29 in a leap year).
    assert log_time("(EngineCore pid=1) INFO 12-31 23:59:58 [a.py:1] x", datetime(2027, 1, 1, 0, 0, 5)) == datetime(
        2026, 12, 31, 23, 59, 58
    )
    assert log_time("(EngineCore pid=1) INFO 01-01 00:00:03 [a.py:1] x", datetime(2026, 12, 31, 23, 59)) == datetime(
        2027, 1, 1, 0, 0, 3
    )
    assert log_time("(EngineCore pid=1) INFO 02-29 10:00:00 [a.py:1] x", datetime(2027, 3, 1)) == datetime(
        2028, 2, 29, 10, 0, 0
    )


def test_every_prefill_process_log_is_read_restarts_included(tmp_path: Path) -> None:
    (tmp_path / "prefill.log").write_text(
        "(APIServer pid=1) INFO 11-26 05:10:00 [a.py:1] starting\n" + EXPIRY.format(t="05:12:02", r="a") + "\n"
    )
    # The restarted prefill (Stack.restart names it prefill-<n>), its late read and an expiry.
    (tmp_path / "prefill-2.log").write_text(
        LATE.format(t="05:13:10", r="b") + "\n" + EXPIRY.format(t="05:13:30", r="c") + "\n"
    )
    (tmp_path / "prefill-12.log").write_text(EXPIRY.format(t="05:20:00", r="e") + "\n")  # restarts past 9
    (tmp_path / "decode.log").write_text(LATE.format(t="05:13:11", r="d") + "\n")  # not a prefill's
    assert [p.name for p in process_logs(tmp_path, "prefill")] == ["prefill.log", "prefill-2.log", "prefill-12.log"]
    expiries = logged(tmp_path, "prefill", LEASE_EXPIRY, NEAR)
    assert [e.at for e in expiries] == [
        datetime(2026, 11, 26, 5, 12, 2),
        datetime(2026, 11, 26, 5, 13, 30),
        datetime(2026, 11, 26, 5, 20, 0),
    ]
    (late,) = logged(tmp_path, "prefill", LATE_READ, NEAR)
    assert late.at == datetime(2026, 11, 26, 5, 13, 10) and "cmpl-b-0" in late.text


def test_lease_expiries_are_planned_only_in_the_lease_after_the_decode_kill() -> None:
    kill = datetime(2026, 11, 26, 5, 12, 2, 700_000)

    def at(t: str) -> LogLine:
        return LogLine(datetime.strptime(f"2026-11-26 {t}", "%Y-%m-%d %H:%M:%S"), t)

    lines = [at("05:12:01"), at("05:12:02"), at("05:12:32"), at("05:12:47"), at("05:12:48"), LogLine(None, "?")]
    unplanned = unplanned_expiries(lines, [kill], lease_s=30.0, slack_s=15.0)
    # Before the kill's second; after its lease and slack (05:12:47.7); a line whose time is unreadable.
    assert [e.text for e in unplanned] == ["05:12:01", "05:12:48", "?"]
    assert unplanned_expiries(lines[1:4], [kill], lease_s=30.0) == []
    # No decode was killed: no expiry is planned.
    assert len(unplanned_expiries(lines, [], lease_s=30.0)) == len(lines)


def test_late_reads_and_unplanned_expiries_are_problems() -> None:
    late = [LogLine(datetime(2026, 11, 26, 5, 13, 10), LATE.format(t="05:13:10", r="b"))]
    unplanned = [LogLine(datetime(2026, 11, 26, 5, 20, 1), "x"), LogLine(None, "y")]
    assert lease_problems([], [], 30.0) == []
    first, second = lease_problems(late, unplanned, 30.0)
    assert first.startswith("1 decode read(s) after the prefill's NIXL lease expired") and "cmpl-b-0" in first
    assert second.startswith("2 NIXL lease expiry(ies) on the prefill outside the 30 s")
    assert "05:20:01, time unreadable" in second
    assert lease_problems([], unplanned, 30.0) == [second]


def test_the_prefills_lease_is_its_compositions_else_vllms(tmp_path: Path) -> None:
    assert prefill_lease_s() == 30.0  # the shipped example keeps vLLM's default
    text = (
        (EXAMPLES / "pd-prefill.yaml")
        .read_text()
        .replace("backends: [UCX]", "backends: [UCX]\n      lease_seconds: 45")
    )
    (tmp_path / "p.yaml").write_text(text)
    assert load(tmp_path / "p.yaml").children[1].options.lease_seconds == 45  # a valid composition
    assert prefill_lease_s(tmp_path / "p.yaml") == 45.0


def test_a_late_read_the_decode_refused_is_not_one_it_may_have_computed_from() -> None:
    """The nixl plugin refuses a read that ended after the lease (kvcompose_nixl.lease); the prefill
    logs its late notification all the same. Only the prefill's lines for reads the decode did
    not refuse are problems."""
    from kvcompose_nixl.lease import REFUSED

    def late(req: str) -> LogLine:
        return LogLine(None, f"{LATE_READ} {req} were retrieved by a decode worker. They may have expired.")

    decode = [
        f"{REFUSED} chatcmpl-d-1 (prefill request chatcmpl-p-1) ended 0.1 s after the prefill instance's lease",
        "an unrelated line naming chatcmpl-p-2",
    ]
    refused = REFUSED_READ.findall("\n".join(decode))  # as the soak reads the decode's logs
    kept = used_late_reads([late("chatcmpl-p-1"), late("chatcmpl-p-2")], refused)
    assert [line.text for line in kept] == [late("chatcmpl-p-2").text]
    assert used_late_reads([late("chatcmpl-p-1")], []) != []


def test_a_client_that_hung_up_at_the_router_plans_a_lease_expiry_from_when_it_did() -> None:
    """The router sends no decode request for a client gone while prefill computed: the prefill
    holds those blocks until its lease ends. Only router hang-ups plan one; a direct one does not
    (the decode has the request and releases the prefill's blocks when it aborts it)."""
    from kvcompose_tools.soak.report import router_hang_ups

    start = datetime(2026, 11, 26, 5, 12, 0).timestamp()
    outcomes = [
        Outcome(1, 0, "hung-up", 10.0, 0.5, "router"),
        Outcome(2, 0, "hung-up", 20.0, 0.5, "direct"),
        Outcome(3, 0, "answered", 30.0, 0.5, "router"),
    ]
    causes = router_hang_ups(outcomes, start)
    assert causes == [datetime(2026, 11, 26, 5, 12, 10, 500_000)]
    expiry = LogLine(datetime(2026, 11, 26, 5, 12, 41), "05:12:41")
    assert unplanned_expiries([expiry], causes, lease_s=30.0) == []
    assert unplanned_expiries([expiry], [], lease_s=30.0) == [expiry]


def _states(pgid: int) -> dict[int, str]:
    """The state letter (``/proc/<pid>/stat``) of every process in the process group ``pgid``."""
    out = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[2]) == pgid:
            out[int(stat.parent.name)] = fields[0]
    return out


def _until(condition: Callable[[], bool], within_s: float = 10.0) -> bool:
    """Whether ``condition`` holds within ``within_s`` (a signal reaches a process group soon, not
    at once)."""
    deadline = time.monotonic() + within_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def test_a_pause_stops_the_servers_whole_process_group_and_the_resume_starts_it_again() -> None:
    """vLLM's API server and its engine core are one process group (``start_group``): SIGSTOP to
    the group stops both, as a VM pause does; SIGCONT starts both again."""
    from types import SimpleNamespace

    from kvcompose_tools.e2e.processes import start_group, stop_group
    from kvcompose_tools.soak.stack import Stack

    proc = start_group("pause-test", ["sh", "-c", "sleep 60 & sleep 60; wait"])  # a leader and its children
    try:
        stack = Stack.__new__(Stack)  # only its servers: no engine started
        stack.servers = {"decode": SimpleNamespace(proc=proc)}  # type: ignore[dict-item]
        assert _until(lambda: len(_states(proc.pid)) == 3)
        stack.pause("decode")
        assert _until(lambda: set(_states(proc.pid).values()) == {"T"})  # every process of the group stopped
        stack.resume("decode")
        assert _until(lambda: "T" not in _states(proc.pid).values()) and proc.poll() is None
    finally:
        stop_group(proc, 1.0)
