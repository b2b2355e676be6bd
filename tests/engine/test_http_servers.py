"""The proxy flow through vLLM's OpenAI-compatible HTTP servers (marker ``engine``).

Prefill and decode are ``python -m vllm.entrypoints.openai.api_server`` processes started with
``kvcompose vllm-args`` of the shipped examples; the baseline is an offline engine, so equal
tokens and logprobs also show that the HTTP path returns what ``vllm.LLM`` returns. At most two
engines at a time (baseline with prefill, then decode); every process group is killed on teardown.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvcompose.e2e.flow import EXTERNAL, pd_request, token_prompt
from kvcompose.e2e.model import kv_bytes_per_token, make_model
from kvcompose.e2e.node import BLOCK_SIZE, EngineNode, EngineSpec, free_ports, wait_all_ready
from kvcompose.e2e.server import ServerNode

pytestmark = pytest.mark.engine

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
MAX_TOKENS = 16
PROMPTS = {"pd": token_prompt(10, 600), "turn": token_prompt(11, 400)}


class Servers:
    """The baseline's answers, then a prefill and a decode server."""

    def __init__(self, logs: Path) -> None:
        self.model = make_model(0)
        p_port, d_port = free_ports(2)
        self.nodes: list[Any] = []
        baseline = EngineNode(EngineSpec("baseline", str(self.model)), logs)
        self.nodes.append(baseline)
        self.prefill = ServerNode(
            EngineSpec("prefill", str(self.model), str(EXAMPLES / "pd-prefill.yaml"), p_port), logs
        )
        self.nodes.append(self.prefill)
        wait_all_ready([baseline, self.prefill])
        self.expected = {k: baseline.generate([ids], MAX_TOKENS)[0] for k, ids in PROMPTS.items()}
        baseline.close()
        self.nodes.remove(baseline)
        self.decode = ServerNode(EngineSpec("decode", str(self.model), str(EXAMPLES / "pd-decode.yaml"), d_port), logs)
        self.nodes.append(self.decode)
        wait_all_ready([self.decode])

    def close(self) -> None:
        for n in self.nodes:
            n.close()


@pytest.fixture(scope="module")
def servers() -> Iterator[Servers]:
    with tempfile.TemporaryDirectory(prefix="kvcompose-e2e-http-") as tmp:
        s: Servers | None = None
        try:
            s = Servers(Path(tmp))
            yield s
        finally:
            if s is not None:
                s.close()


def equal(got: Any, expected: dict[str, Any]) -> bool:
    return got.token_ids == expected["token_ids"] and got.logprobs == expected["logprobs"]


def test_pd_over_http_equals_baseline_and_moves_kv_over_nixl(servers: Servers) -> None:
    ids = PROMPTS["pd"]
    s = pd_request(servers.prefill, servers.decode, ids, MAX_TOKENS)
    assert equal(s, servers.expected["pd"]), (s.token_ids, servers.expected["pd"]["token_ids"])
    assert s.prefill_params is not None and s.prefill_params["do_remote_prefill"] is True
    assert s.loaded == {"pd": len(ids)}
    n_blocks = -(-len(ids) // BLOCK_SIZE)
    assert s.nixl_bytes == n_blocks * BLOCK_SIZE * kv_bytes_per_token(servers.model)
    assert s.counters.get(EXTERNAL) == len(ids)
    assert s.failed_transfers == 0


def test_repeated_turn_over_http_loads_host_blocks_and_pulls_only_the_tail(servers: Servers) -> None:
    ids = PROMPTS["turn"]
    first = pd_request(servers.prefill, servers.decode, ids, MAX_TOKENS)
    assert first.loaded == {"pd": len(ids)}
    assert servers.decode.reset_prefix_cache()  # the dev-mode route
    again = pd_request(servers.prefill, servers.decode, ids, MAX_TOKENS)
    # load: ranges: host's full blocks, then NIXL the partial last block (one block), no second pull
    full_blocks = len(ids) // BLOCK_SIZE * BLOCK_SIZE
    assert again.loaded == {"host": full_blocks, "pd": len(ids) - full_blocks}
    assert again.host_blocks == full_blocks // BLOCK_SIZE
    assert again.nixl_bytes == BLOCK_SIZE * kv_bytes_per_token(servers.model)
    assert equal(first, servers.expected["turn"]) and equal(again, servers.expected["turn"])
