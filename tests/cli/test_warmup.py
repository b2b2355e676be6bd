"""``kvcompose warmup`` without engines: every prefill/decode pair gets one small P/D request of
its own, and a server that cannot be reached is a one-line error. Against real servers:
``tests/engine/test_router.py``; its effect on a fresh pair's first request: ``kvcompose bench
--only cold-start``."""

from __future__ import annotations

from typing import Any

import pytest

from kvcompose.cli import main
from kvcompose.e2e.flow import NIXL_BYTES
from kvcompose.e2e.node import free_ports
from kvcompose.e2e.warmup import WARMUP_TOKENS, warm

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
