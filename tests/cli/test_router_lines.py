"""``kvcompose check`` says how to run vllm-router in front of a P/D composition, and
``kvcompose relay-events`` refuses what it cannot relay with a line, not a traceback."""

from __future__ import annotations

import pytest

from kvcompose.cli import main
from kvcompose.examples import pd_pair
from kvcompose.router import pd_router_args


def test_check_gives_the_router_flags_for_the_prefill_and_the_decode(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVCOMPOSE_PD_KEY", "00" * 32)
    prefill, decode = pd_pair()
    assert main(["check", str(prefill)]) == 0
    out = capsys.readouterr().out
    assert "behind vllm-router: --prefill URL --policy kv_aware --pd-kv-events URL=tcp://HOST:PORT" in out
    assert "--enable-scale-out" in out and "kvcompose relay-events" in out
    assert main(["check", str(decode)]) == 0
    out = capsys.readouterr().out
    assert "behind vllm-router: --decode URL" in out and "--decode-policy consistent_hash" in out


def test_kv_aware_needs_every_prefills_event_endpoint() -> None:
    args = pd_router_args(
        ["http://p1", "http://p2"], ["http://d1"], "kv_aware", {"http://p1": "tcp://h:1", "http://p2": "tcp://h:2"}
    )
    assert args[args.index("--pd-kv-events") + 1] == "http://p1=tcp://h:1"
    assert "--kv-aware-session-affinity-ttl-secs" in args
    with pytest.raises(ValueError, match="no endpoint for http://p2"):
        pd_router_args(["http://p1", "http://p2"], ["http://d1"], "kv_aware", {"http://p1": "tcp://h:1"})
    with pytest.raises(ValueError, match="one of round_robin, consistent_hash, kv_aware, kv_aware\\+hash"):
        pd_router_args(["http://p1"], ["http://d1"], "cache_aware")
    assert "--pd-kv-events" not in pd_router_args(["http://p1"], ["http://d1"], "consistent_hash")
    hashed = pd_router_args(["http://p1"], ["http://d1"], "kv_aware+hash", {"http://p1": "tcp://h:1"})
    assert hashed[hashed.index("--decode-policy") + 1] == "consistent_hash" and "--pd-kv-events" in hashed
    assert "--kv-aware-session-affinity-ttl-secs" not in hashed


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--to", "tcp://127.0.0.1:99999", "--engine-block-size", "32"], "a port 1-65535"),
        (["--to", "tcp://127.0.0.1:5999", "--engine-block-size", "24"], "24-token blocks cannot be told in 16"),
        (["--to", "http://x", "--engine-block-size", "32"], "--to 'http://x'"),
    ],
)
def test_relay_events_refuses_with_a_line(argv: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["relay-events", "--from", "ipc:///tmp/kvcompose-none.events", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvcompose relay-events: ") and says in err and "Traceback" not in err
