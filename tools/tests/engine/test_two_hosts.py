"""1P1D across two hosts through the router (marker ``engine``; issue 36, item 5).

The prefill and the decode API server of the shipped examples each run in a host of their own
(:mod:`kvcompose_tools.e2e.hosts`: a network namespace, its link at :data:`LINK` both ways, UCX held
to tcp over the host's ``eth0``); vLLM's router runs in the root namespace and reaches them
through the switch. A three-turn chat through the router must equal the session's offline
baseline turn by turn, turn 1 pulled over NIXL whole, turns 2 and 3 served ``host + pd``, each
turn's NIXL bytes those of the blocks ``pd`` pulled, and at least that many bytes must have
crossed the decode's link during the turn: shared memory between the hosts would leave it idle.
Skipped, with the kit's one-line reason, where namespaces cannot be made.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.stack import Nodes, module_stack
from kvcompose.examples import EXAMPLES
from kvcompose_tools.e2e.chat import ChatTurn, baseline_chat, chat_through_router, load_tokenizer
from kvcompose_tools.e2e.hosts import Hosts, LinkBytes, kit_namespaces, skip_reason
from kvcompose_tools.e2e.linkprobe import off_network, ucx_lanes
from kvcompose_tools.e2e.model import kv_bytes_per_token, make_model
from kvcompose_tools.e2e.node import EngineNode, wait_all_ready
from kvcompose_tools.e2e.ports import free_ports
from kvcompose_tools.e2e.router import RouterNode
from kvcompose_tools.e2e.server import ServerNode
from kvcompose_tools.e2e.spec import BLOCK_SIZE, EngineSpec

NO_HOSTS = skip_reason()
# 90 s of its own stack: `make test-long`, to keep `make test`'s CI run under the hour (test_link_cut.py
# keeps P/D across two hosts in `make test`).
pytestmark = [pytest.mark.engine, pytest.mark.long, pytest.mark.skipif(NO_HOSTS is not None, reason=NO_HOSTS or "")]

MAX_TOKENS = 16
LINK = "1gbit"
#: UCX prints the protocols it chose for each new endpoint into the engine's log.
UCX_LOG = {"UCX_PROTO_INFO": "y"}


class Stack(Nodes):
    """The baseline's chat, and a prefill and a decode server, each in its host, behind the router."""

    def __init__(self, logs: Path, baseline: EngineNode, hosts: Hosts) -> None:
        self.model = make_model(0)
        self.hosts = hosts
        p_port, d_port = free_ports(2)
        super().__init__()
        self.prefill = ServerNode(
            EngineSpec("prefill", str(self.model), str(EXAMPLES / "pd-prefill.yaml"), p_port),
            logs,
            extra_env=UCX_LOG,
            host=hosts["prefill"],
        )
        self.decode = ServerNode(
            EngineSpec("decode", str(self.model), str(EXAMPLES / "pd-decode.yaml"), d_port),
            logs,
            extra_env=UCX_LOG,
            host=hosts["decode"],
        )
        self.nodes += [self.prefill, self.decode]  # starting while the baseline answers
        self.chat: list[ChatTurn] = baseline_chat(baseline, load_tokenizer(self.model), MAX_TOKENS)
        wait_all_ready([self.prefill, self.decode])
        self.router = RouterNode([self.prefill], [self.decode], str(self.model), logs)
        self.nodes.append(self.router)
        self.router.wait_ready()


@pytest.fixture(scope="module")
def stack(baseline: EngineNode) -> Iterator[Stack]:
    assert kit_namespaces(os.getpid()) == []
    with Hosts(["prefill", "decode"], link=LINK) as hosts:
        yield from module_stack(Stack, "kvcompose-e2e-hosts-", baseline, hosts)
    assert kit_namespaces(os.getpid()) == [], "the hosts' namespaces outlived the module"


def test_a_chat_across_two_hosts_is_served_host_plus_pd_over_the_link_and_equals_the_baseline(
    stack: Stack,
) -> None:
    decode_host = stack.hosts["decode"]
    turns = []
    before = decode_host.link_bytes()
    for turn, s in chat_through_router(stack.router, [stack.decode], stack.chat, MAX_TOKENS):
        after = decode_host.link_bytes()
        turns.append((turn, s, after - before))
        before = after
    assert len(turns) == 3
    per_block = BLOCK_SIZE * kv_bytes_per_token(stack.model)
    previous: ChatTurn | None = None
    for turn, s, moved in turns:
        print(f"\n{s.label}: {s.served_by()}, NIXL {s.nixl_bytes} B, decode's link received {moved.rx} B")
        assert turn.problems(s) == [], s.label
        assert s.failed_transfers == 0 and s.computed_tokens <= 1
        # Prefix: the previous turn's full blocks, which decode's host tier stored; pd the rest.
        shared = len(previous.prompt_ids) // BLOCK_SIZE * BLOCK_SIZE if previous else 0
        expected = {"host": shared, "pd": s.prompt_tokens - shared} if shared else {"pd": s.prompt_tokens}
        assert s.loaded == expected, s.label
        assert s.nixl_bytes == -(-(s.prompt_tokens - shared) // BLOCK_SIZE) * per_block, s.label
        _crossed_the_link(moved, s.nixl_bytes, s.label)
        previous = turn
    assert [s.children for _, s, _ in turns[1:]] == [("host", "pd")] * 2
    # UCX's own account, from the decode engine's log: every lane to the prefill over tcp/eth0.
    lanes = ucx_lanes(stack.decode.log_path.read_text(errors="replace"))
    print(f"decode's UCX lanes: {sorted({(lane.peer, lane.transport) for lane in lanes})}")
    assert any(lane.peer == "inter-node" and "read" in lane.operation for lane in lanes), lanes
    assert off_network(lanes, decode_host.device) == []


def _crossed_the_link(moved: LinkBytes, nixl_bytes: int, label: str) -> None:
    """The turn's KV reached decode over its link: the link received at least the bytes NIXL
    reports (HTTP adds a little; shared memory would add nothing)."""
    assert moved.rx >= nixl_bytes, f"{label}: decode's link received {moved.rx} B for {nixl_bytes} B of NIXL reads"
