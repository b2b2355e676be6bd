"""``kvcompose demo --hosts`` without engines: its options checked before anything starts, the
table's link header and NIXL pull column (issue 36, item 2)."""

from __future__ import annotations

import io

import pytest

from kvcompose_tools.e2e import demo
from kvcompose_tools.e2e.flow import Served
from kvcompose_tools.e2e.hosts import DEFAULT_LINK, parse_rate


def test_a_link_that_is_no_rate_is_refused_before_anything_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(demo, "Hosts", lambda *a, **k: pytest.fail("hosts made for a bad rate"))
    out = io.StringIO()
    assert demo.run(out=out, link="fast") == 2
    assert "--link" in out.getvalue() and "tc's units" in out.getvalue()


def test_a_model_that_is_not_one_of_the_kits_is_refused_before_anything_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(demo, "make_model", lambda *a, **k: pytest.fail("a model made for a bad name"))
    out = io.StringIO()
    assert demo.run(out=out, model="huge") == 2
    assert "demo: --model: unknown model 'huge'; choose from tiny, medium" in out.getvalue()


def test_the_hosts_are_the_prefill_and_each_decode_and_imply_http(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[tuple[list[str], str]] = []

    class Refused(Exception):
        pass

    class FakeHosts:
        def __init__(self, names: list[str], link: str) -> None:
            made.append((names, link))

        def __enter__(self) -> None:
            raise Refused

        def __exit__(self, *exc: object) -> None:
            pass

    monkeypatch.setattr(demo, "Hosts", FakeHosts)
    for decodes, names in ((1, ["prefill", "decode"]), (2, ["prefill", "decode1", "decode2"])):
        with pytest.raises(Refused):
            demo.run(out=io.StringIO(), link="1gbit", decodes=decodes)  # --decodes 2 without --http
        assert made.pop() == (names, "1gbit")


def test_the_default_link_is_a_100_gbit_link_for_llama_3_8b_scaled_to_the_tiny_model() -> None:
    llama_8b = 32 * 2 * 8 * 128 * 2  # layers x (K, V) x KV heads x head dim x bf16 bytes
    tiny = 2 * 2 * 2 * 32 * 4  # kv_bytes_per_token(make_model(0)), float32
    assert (llama_8b, tiny) == (128 * 1024, 1024)
    assert abs(parse_rate(DEFAULT_LINK) - 100 * 10**9 * tiny / llama_8b) / parse_rate(DEFAULT_LINK) < 0.03
    assert demo.link_text(parse_rate(DEFAULT_LINK)) == "800 Mbit/s"
    assert demo.link_text(parse_rate("1.5gbit")) == "1.5 Gbit/s"


def _served(nixl_bytes: int, xfer_s: float) -> Served:
    return Served(
        label="A (600)",
        prompt_tokens=600,
        token_ids=[1],
        logprobs=[0.0],
        finish_reason="length",
        loaded={"pd": 600} if nixl_bytes else {},
        computed_tokens=0 if nixl_bytes else 600,
        nixl_bytes=nixl_bytes,
        host_blocks=0,
        failed_transfers=0,
        ttft_s=0.05,
        prefill_params=None,
        counters={demo.XFER_TIME: xfer_s},
    )


def test_each_row_gives_the_requests_nixl_pull_time_across_hosts_only() -> None:
    row = demo._row(_served(622_592, 0.0123), True, pull=True)
    assert "12.3 ms" in row and row.endswith("equal")
    assert "12.3 ms" not in demo._row(_served(622_592, 0.0123), True)
    assert demo._row(_served(0, 0.0), True, pull=True).count(" ms") == 1  # the TTFT's only: nothing pulled


def test_an_answer_agrees_bit_for_bit_or_within_the_models_tolerance() -> None:
    """The tiny model's answers over P/D are the baseline's bit for bit; the medium model's
    logprobs move in float32's last bits (its KV computed in other batches), token ids equal."""
    from dataclasses import replace

    from kvcompose_tools.e2e.model import LOGPROB_TOLERANCE, MODELS

    assert set(LOGPROB_TOLERANCE) == set(MODELS) and LOGPROB_TOLERANCE["tiny"] == 0.0
    s = replace(_served(1000, 0.01), token_ids=[4, 5, 6], logprobs=[-0.5, -1.25, -2.0])
    want = {"token_ids": [4, 5, 6], "logprobs": [-0.5, -1.25, -2.0]}
    assert demo.verdict(s, want) == (True, "")
    moved = {**want, "logprobs": [-0.5, -1.25003, -2.0]}
    assert demo.verdict(s, moved) == (False, " (token ids equal, logprobs within 3.0e-05)")
    assert demo.verdict(s, moved, LOGPROB_TOLERANCE["medium"]) == (True, " (token ids equal, logprobs within 3.0e-05)")
    other = {**want, "token_ids": [4, 9, 6]}
    assert demo.verdict(s, other, 1.0) == (False, " (token ids differ from token 2)")
