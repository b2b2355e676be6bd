"""The router's command line, its failures, the chat script and the answer parsers (no engine).

The router tests start the real ``vllm-router`` binary, with no worker behind it: it waits for
their ``/health``, so it never listens, and :class:`RouterNode` must say so, naming its log.
"""

from __future__ import annotations

import importlib.metadata
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvcompose_tools.e2e import flow
from kvcompose_tools.e2e.chat import SYSTEM, USER_TURNS, padded, render
from kvcompose_tools.e2e.flow import measured, routed, same_output
from kvcompose_tools.e2e.model import make_model
from kvcompose_tools.e2e.ports import free_ports
from kvcompose_tools.e2e.processes import NodeError, log_tail
from kvcompose_tools.e2e.router import ROUTER_VERSION, WORKER_LINES, RouterNode, router_argv
from kvcompose_tools.e2e.server import POLLS, HttpClient, ServerNode, chat_body, parse_chat, parse_completion
from kvcompose_tools.e2e.spec import BLOCK_SIZE, EngineSpec

ROOT = Path(__file__).resolve().parents[3]


def test_the_installed_router_is_the_pinned_one() -> None:
    assert importlib.metadata.version("vllm-router") == ROUTER_VERSION
    assert f'"vllm-router=={ROUTER_VERSION}"' in (ROOT / "tools" / "pyproject.toml").read_text()
    assert f"vllm-router=={ROUTER_VERSION}" in (ROOT / "scripts" / "setup.sh").read_text()


def test_router_argv_is_vllm_pd_over_nixl_by_the_routers_own_parser() -> None:
    from vllm_router.launch_router import parse_router_args

    argv = router_argv(["http://127.0.0.1:8100"], ["http://127.0.0.1:8200"], 8000, 29100)
    assert argv[1:3] == ["-m", "vllm_router.launch_router"]
    args = parse_router_args(argv[3:])
    assert args.vllm_pd_disaggregation is True
    assert args.kv_connector == "nixl"
    assert (args.host, args.port) == ("127.0.0.1", 8000)
    assert [url for url, _ in args.prefill_urls] == ["http://127.0.0.1:8100"]
    assert args.decode_urls == ["http://127.0.0.1:8200"]
    assert (args.prometheus_host, args.prometheus_port) == ("127.0.0.1", 29100)
    assert args.policy == "round_robin"
    two = router_argv(["http://p"], ["http://d1", "http://d2"], 8000, 29100, policy="consistent_hash")
    args = parse_router_args(two[3:])
    assert args.decode_urls == ["http://d1", "http://d2"] and args.policy == "consistent_hash"


def _nowhere() -> Any:
    return SimpleNamespace(url=f"http://127.0.0.1:{free_ports(1)[0]}")


def test_a_router_whose_workers_are_down_is_not_ready_and_names_its_log(tmp_path: Path) -> None:
    router = RouterNode([_nowhere()], [_nowhere()], "m", tmp_path)
    log = tmp_path / "router.log"
    try:
        with pytest.raises(NodeError, match=r"router not ready after 3 s; router running, log .*router\.log"):
            router.wait_ready(timeout=3)
        # On a loaded machine the router may not have logged within those 3 s: give it time to.
        deadline = time.monotonic() + 60
        while "Waiting for" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        router.close()
    assert router.proc.returncode is not None
    assert "Waiting for" in log.read_text()


def test_a_missing_router_package_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(NodeError, match=r"vllm-router package is not installed: pip install 'vllm-router==0\.1\.17'"):
        RouterNode([_nowhere()], [_nowhere()], "m", tmp_path)


def test_a_dead_router_is_a_clear_error(tmp_path: Path) -> None:
    router = RouterNode([_nowhere()], [_nowhere()], "m", tmp_path)
    router.close()
    with pytest.raises(NodeError, match=r"router: POST /v1/completions failed .*router exited"):
        router.generate([[1, 2, 3]], 4)


def test_a_router_failure_quotes_what_each_server_behind_it_did_last(tmp_path: Path) -> None:
    # A server that cannot load its model exits after importing vLLM; the router never gets a
    # healthy worker, and its error quotes that server's last words (not the router's alone).
    prefill = ServerNode(EngineSpec("prefill", str(tmp_path / "no-such-model")), tmp_path)
    try:
        assert prefill.proc.wait(120) != 0
        router = RouterNode([prefill], [_nowhere()], "m", tmp_path)
        try:
            with pytest.raises(NodeError) as err:
                router.wait_ready(timeout=3)
        finally:
            router.close()
    finally:
        prefill.close()
    said = str(err.value)
    assert f"--- prefill: exited, log {tmp_path / 'prefill.log'}:" in said
    assert said.endswith(log_tail(tmp_path / "prefill.log", WORKER_LINES))
    assert "no-such-model" in said.split("--- prefill:")[1]


def test_a_server_error_quotes_the_servers_state_and_a_client_error_does_not() -> None:
    # vLLM answers a request whose KV load failed with a bare "Internal server error"; the cause
    # is in the logs that ``died`` quotes. A 4xx body already says what was wrong with the request.
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            self.rfile.read(int(self.headers["Content-Length"]))
            body = b'{"error": {"message": "Internal server error"}}'
            self.send_response(int(self.path.strip("/")))
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        client = HttpClient("router", f"http://127.0.0.1:{httpd.server_address[1]}", lambda: "decode's last words")
        with pytest.raises(
            NodeError, match=r"router: POST /500 -> HTTP 500: .*Internal server error.*; decode's last words$"
        ):
            client.post("/500", {})
        with pytest.raises(NodeError) as err:
            client.post("/400", {})
        assert str(err.value).startswith("router: POST /400 -> HTTP 400: ") and "last words" not in str(err.value)
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_log_tail_can_leave_out_the_kits_own_polls(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    lines = ['INFO: 127.0.0.1:1 - "GET /metrics HTTP/1.1" 200 OK', "NIXL compatibility check passed"]
    lines += ['INFO: 127.0.0.1:2 - "GET /health HTTP/1.1" 200 OK', 'INFO: 1 - "POST /v1/completions HTTP/1.1"']
    log.write_text("\n".join(lines))
    assert log_tail(log, 2) == "\n".join(lines[2:])
    assert log_tail(log, 2, skip=POLLS) == "\n".join([lines[1], lines[3]])
    assert log_tail(tmp_path / "none.log", 2, skip=POLLS) == ""


def test_chat_turns_are_padded_one_past_a_block_boundary() -> None:
    from kvcompose_tools.e2e.chat import load_tokenizer

    tokenizer = load_tokenizer(make_model(0))
    history = [{"role": "system", "content": SYSTEM}]
    for user in USER_TURNS:
        text = padded(tokenizer, history, user)
        assert text.startswith(user)
        ids = render(tokenizer, [*history, {"role": "user", "content": text}])
        assert len(ids) % BLOCK_SIZE == 1 and ids[0] == tokenizer.bos_token_id
        history += [{"role": "user", "content": text}, {"role": "assistant", "content": "fine"}]


def test_chat_answer_parsing_ties_each_logprob_to_its_token_id() -> None:
    answer = {
        "prompt_token_ids": [1, 2, 3],
        "choices": [
            {
                "message": {"role": "assistant", "content": "hi"},
                "token_ids": [7, 8],
                "finish_reason": "length",
                "logprobs": {
                    "content": [{"token": "token_id:7", "logprob": -1.5}, {"token": "token_id:8", "logprob": -2.0}]
                },
            }
        ],
    }
    got = parse_chat(answer, 0.5)
    assert (got["token_ids"], got["logprobs"], got["text"], got["prompt_token_ids"]) == (
        [7, 8],
        [-1.5, -2.0],
        "hi",
        [1, 2, 3],
    )
    answer["choices"][0]["logprobs"]["content"][1]["token"] = "token_id:9"
    with pytest.raises(NodeError, match="do not match token ids"):
        parse_chat(answer, 0.5)
    body = chat_body("m", [{"role": "user", "content": "x"}], 4)
    assert body["return_token_ids"] and body["return_tokens_as_token_ids"] and body["temperature"] == 0


def test_http_ttft_is_wall_time_less_decodes_time_after_its_first_token() -> None:
    class Decode:
        def __init__(self) -> None:
            self.snapshots = iter([{}, {"vllm:request_decode_time_seconds_sum": 0.25}])

        def metrics(self) -> dict[str, float]:
            return next(self.snapshots)

    answer = {"choices": [{"token_ids": [5], "logprobs": {"token_logprobs": [-1.0]}, "finish_reason": "length"}]}
    s = measured(Decode(), lambda: parse_completion(answer, 1.0), 10, "x", ("pd",))
    assert s.ttft_s == pytest.approx(0.75)
    assert (s.token_ids, s.logprobs, s.prompt_tokens) == ([5], [-1.0], 10)


def test_logprobs_are_compared_as_the_float32_values_the_engine_computed() -> None:
    expected = {"token_ids": [1, 2], "logprobs": [-3.8056788444519043, -1.0]}
    # What the router's JSON re-encoding returned for the first: one double ulp off, same float32.
    assert same_output([1, 2], [-3.805678844451904, -1.0], expected)
    assert not same_output([1, 2], [-3.8056786, -1.0], expected)  # the next float32 towards 0
    assert not same_output([1, 3], expected["logprobs"], expected)
    assert not same_output([1, 2], [-3.8056788444519043], expected)


class FakeDecode:
    """A decode server's metrics as a router's request moves them (only ``answered`` moves)."""

    def __init__(self, name: str, answers: bool) -> None:
        self.name = name
        self.answers = answers
        self.requests = 0
        self.counted = 0

    def metrics(self) -> dict[str, float]:
        loaded = {"vllm:kvcompose_loads{child=pd}": 1.0, "vllm:kvcompose_loaded_tokens{child=pd}": 10.0}
        done = {"vllm:request_success{finished_reason=length}": float(self.requests)}
        return {**done, **(loaded if self.requests else {})}

    def answered_elsewhere(self, n: int = 1) -> None:
        self.counted += n

    def reset_prefix_cache(self) -> bool:
        return True


def _answer() -> dict[str, Any]:
    return parse_completion({"choices": [{"token_ids": [5], "logprobs": {"token_logprobs": [-1.0]}}]}, 1.0)


def test_a_routed_request_is_measured_on_the_decode_that_answered_it() -> None:
    decodes = [FakeDecode("decode-1", False), FakeDecode("decode-2", True)]

    def send() -> dict[str, Any]:
        decodes[1].requests += 1  # the router chose decode-2
        return _answer()

    s = routed(decodes, send, 10, "x", ("pd",))
    assert s.decode == "decode-2" and s.loaded == {"pd": 10}
    assert [d.counted for d in decodes] == [0, 1]


def test_a_routed_request_no_decode_counted_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flow, "SETTLE_TIMEOUT_S", 0.1)
    decodes = [FakeDecode("decode-1", False), FakeDecode("decode-2", False)]
    with pytest.raises(NodeError, match="x: one decode should have answered; counted by none"):
        routed(decodes, _answer, 10, "x", ("pd",))


def test_the_router_takes_decode_kv_events_only_in_regular_mode() -> None:
    """Where routing P/D decodes by the host tier's KV events stops with vllm-router 0.1.17: in
    P/D mode it refuses static event sources for decode workers (only prefill ones, through
    ``--pd-kv-events``); in regular mode it takes them. No worker needs to be up: the router
    checks its configuration first. If a router release lifts this, this test says so."""
    import subprocess
    import sys

    d1, d2, e1, e2 = (f"http://127.0.0.1:{p}" for p in free_ports(4))

    def start(*mode: str) -> str:
        port, metrics = (str(p) for p in free_ports(2))
        argv = [sys.executable, "-m", "vllm_router.launch_router", "--host", "127.0.0.1", "--port", port, *mode]
        argv += ["--policy", "kv_aware", "--kv-event-block-size", str(BLOCK_SIZE), "--kv-event-model", "m"]
        argv += ["--kv-event-source", f"{d1}={e1.replace('http', 'tcp')}"]
        argv += ["--kv-event-source", f"{d2}={e2.replace('http', 'tcp')}"]
        argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", metrics, "--worker-startup-timeout-secs", "1"]
        argv += ["--worker-startup-check-interval", "1"]
        out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        return out.stdout + out.stderr

    pd = ["--vllm-pd-disaggregation", "--kv-connector", "nixl", "--prefill", "http://127.0.0.1:3"]
    assert "static --kv-event-source is only supported in regular mode" in start(*pd, "--decode", d1, "--decode", d2)
    regular = start("--worker-urls", d1, d2)  # accepted; then it waits for workers that never come up
    assert "Incompatible configuration" not in regular and "waiting for hosts" in regular, regular[-2000:]
