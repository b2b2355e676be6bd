"""The serving stack (marker ``engine``): vLLM's router in P/D mode (nixl) in front of a prefill and
a decode API server started with ``kvcompose vllm-args`` of the shipped examples.

Every request goes to the router only; what the engines did is read from their own ``/metrics``.
The baseline is an offline engine given the same token ids (for chat: the chat template's
rendering). At most two engines at a time (baseline with prefill, then decode), shared by the
module; every process group is killed on teardown.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.stack import Nodes, module_stack
from kvcompose.cli import main
from kvcompose.examples import EXAMPLES
from kvcompose_tools.e2e.attacks import Listener
from kvcompose_tools.e2e.chat import ChatTurn, baseline_chat, chat_through_router, load_tokenizer
from kvcompose_tools.e2e.flow import EXTERNAL, delta, drop_prefix_cache, routed_request, same_output, token_prompt
from kvcompose_tools.e2e.model import kv_bytes_per_token, make_model
from kvcompose_tools.e2e.node import EngineNode, wait_all_ready
from kvcompose_tools.e2e.ports import free_ports
from kvcompose_tools.e2e.processes import NodeError
from kvcompose_tools.e2e.router import RouterNode
from kvcompose_tools.e2e.server import ServerClient, ServerNode
from kvcompose_tools.e2e.spec import BLOCK_SIZE, EngineSpec
from kvcompose_tools.e2e.warmup import WARMUP_TOKENS

pytestmark = pytest.mark.engine

MAX_TOKENS = 16
PROMPT = token_prompt(20, 500)
REPEATED = token_prompt(11, 400)
TEXT = "Hello, how are you today? Tell me about the router, the prefill engine and the decode engine."
SUCCESS = "vllm:request_success{finished_reason=length}"


class Stack(Nodes):
    """The baseline's answers, and a prefill and a decode server behind the router."""

    def __init__(self, logs: Path, baseline: EngineNode) -> None:
        self.model = make_model(0)
        self.tokenizer = load_tokenizer(self.model)
        self.text_ids: list[int] = self.tokenizer(TEXT)["input_ids"]
        p_port, d_port = free_ports(2)
        super().__init__()
        self.prefill = self.prefill_server(self.model, logs, p_port)
        self.decode = ServerNode(EngineSpec("decode", str(self.model), str(EXAMPLES / "pd-decode.yaml"), d_port), logs)
        self.nodes += [self.prefill, self.decode]  # starting while the baseline answers
        self.expected = {
            "ids": baseline.generate([PROMPT], MAX_TOKENS)[0],
            "repeated": baseline.generate([REPEATED], MAX_TOKENS)[0],
            "text": baseline.generate([self.text_ids], MAX_TOKENS)[0],
        }
        self.chat: list[ChatTurn] = baseline_chat(baseline, self.tokenizer, MAX_TOKENS)
        wait_all_ready([self.prefill, self.decode])
        self.router = RouterNode([self.prefill], [self.decode], str(self.model), logs)
        self.nodes.append(self.router)
        self.router.wait_ready()


@pytest.fixture(scope="module")
def stack(baseline: EngineNode) -> Iterator[Stack]:
    yield from module_stack(Stack, "kvcompose-e2e-router-", baseline)


def test_completion_through_the_router_is_prefilled_then_pulled_over_nixl(stack: Stack) -> None:
    before = stack.prefill.metrics()
    s = routed_request(stack.router, [stack.decode], PROMPT, MAX_TOKENS)
    # The router sent prefill one request of one token (max_tokens=1, do_remote_decode) ...
    stack.prefill.answered_elsewhere()
    on_prefill = delta(before, stack.prefill.metrics())
    assert on_prefill.get(SUCCESS) == 1 and on_prefill.get("vllm:generation_tokens") == 1
    # ... and decode pulled all of the prompt's KV from it: nothing computed but what vLLM recomputes.
    assert s.loaded == {"pd": len(PROMPT)} and s.counters.get(EXTERNAL) == len(PROMPT)
    assert s.nixl_bytes == -(-len(PROMPT) // BLOCK_SIZE) * BLOCK_SIZE * kv_bytes_per_token(stack.model)
    assert s.failed_transfers == 0
    # logprobs and return_token_ids went through the router both ways: the baseline's, bit for bit.
    assert s.equals(stack.expected["ids"]), (s.token_ids, stack.expected["ids"]["token_ids"])
    assert 0 < s.ttft_s < 60


def test_repeated_prompt_through_the_router_loads_host_blocks_and_pulls_only_the_tail(stack: Stack) -> None:
    first = routed_request(stack.router, [stack.decode], REPEATED, MAX_TOKENS)
    assert first.loaded == {"pd": len(REPEATED)}
    drop_prefix_cache(stack.decode)
    again = routed_request(stack.router, [stack.decode], REPEATED, MAX_TOKENS)
    # load: ranges: host's full blocks, then NIXL the partial last block (one block), no second
    # pull of the whole prompt.
    full_blocks = len(REPEATED) // BLOCK_SIZE * BLOCK_SIZE
    assert again.loaded == {"host": full_blocks, "pd": len(REPEATED) - full_blocks}
    assert again.host_blocks == full_blocks // BLOCK_SIZE
    assert again.nixl_bytes == BLOCK_SIZE * kv_bytes_per_token(stack.model)
    assert first.equals(stack.expected["repeated"]) and again.equals(stack.expected["repeated"])


def test_text_prompt_through_the_router_equals_the_baseline_on_its_tokens(stack: Stack) -> None:
    (got,) = stack.router.generate([TEXT], MAX_TOKENS)
    stack.decode.answered_elsewhere()
    assert got["prompt_token_ids"] == stack.text_ids
    assert same_output(got["token_ids"], got["logprobs"], stack.expected["text"])


def test_three_turn_chat_later_turns_loaded_by_host_and_nixl_equal_the_baseline(stack: Stack) -> None:
    turns = list(chat_through_router(stack.router, [stack.decode], stack.chat, MAX_TOKENS))
    assert len(turns) == 3
    for turn, s in turns:
        assert turn.problems(s) == [], s.label
        assert s.failed_transfers == 0 and s.computed_tokens <= 1
    first = turns[0][1]
    assert first.loaded == {"pd": first.prompt_tokens}
    for (previous, _), (turn, s) in zip(turns, turns[1:]):
        # The host tier holds the previous turn's full blocks (decode stored them); the new
        # turn starts with them, so host loads exactly those and NIXL the rest, fewer bytes
        # than the whole prompt.
        shared = len(previous.prompt_ids) // BLOCK_SIZE * BLOCK_SIZE
        assert turn.prompt_ids[:shared] == previous.prompt_ids[:shared]
        assert s.loaded == {"host": shared, "pd": s.prompt_tokens - shared}, s.label
        assert s.host_blocks == shared // BLOCK_SIZE
        pd_blocks = -(-(s.prompt_tokens - shared) // BLOCK_SIZE)
        assert s.nixl_bytes == pd_blocks * BLOCK_SIZE * kv_bytes_per_token(stack.model)
        assert s.cached_by_source() == {"host": shared, "p2p": s.prompt_tokens - shared}


def test_a_clients_own_kv_transfer_params_do_not_reach_the_decode_through_the_router(stack: Stack) -> None:
    """docs/security.md, through vLLM's router: a client that names its own side channel in the
    body gets the prefill's params instead (the decode connects nowhere else), and its answer."""
    listener = Listener("127.0.0.1")
    try:
        params = {
            "do_remote_prefill": True,
            "remote_engine_id": "client",
            "remote_request_id": "client-0",
            "remote_host": "127.0.0.1",
            "remote_port": listener.port,
            "remote_block_ids": [[0, 1, 2]],
            "tp_size": 1,
        }
        client = ServerClient("client", stack.router.url, stack.router.model)  # the body as the client writes it
        (answer,) = client.generate([PROMPT], MAX_TOKENS, [params])
        stack.decode.answered_elsewhere()
        assert same_output(answer["token_ids"], answer["logprobs"], stack.expected["ids"])
        assert listener.connections == 0
    finally:
        listener.close()


def test_a_prompt_the_servers_refuse_is_a_clear_error_and_the_stack_stays_up(stack: Stack) -> None:
    too_long = token_prompt(21, 2 * 1024)  # longer than the servers' max_model_len (1024)
    with pytest.raises(NodeError, match=r"router: POST /v1/completions -> HTTP \d+: .*"):
        stack.router.generate([too_long], MAX_TOKENS)
    (again,) = stack.router.generate([PROMPT], MAX_TOKENS)
    stack.decode.answered_elsewhere()
    assert same_output(again["token_ids"], again["logprobs"], stack.expected["ids"])


def test_warmup_sends_one_small_pd_request_through_the_pair(stack: Stack, capsys: pytest.CaptureFixture[str]) -> None:
    """``kvcompose warmup`` against the running servers (its own clients, found by URL)."""
    before = stack.decode.metrics()
    assert main(["warmup", "--prefill", stack.prefill.url, "--decode", stack.decode.url]) == 0
    out = capsys.readouterr().out
    assert f"{stack.prefill.url} -> {stack.decode.url}: warm" in out and "B over NIXL" in out
    stack.decode.answered_elsewhere()
    moved = delta(before, stack.decode.metrics())
    assert moved.get(EXTERNAL, 0) == WARMUP_TOKENS  # the decode pulled every token's KV, computed none
