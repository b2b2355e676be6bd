"""1P2D (marker ``engine``): one prefill and two decode servers behind vLLM's router, whose
``consistent_hash`` policy keeps a conversation on one decode instance.

The router hashes each request's ``X-Session-ID`` onto a ring of the decode servers (their URLs,
so the mapping changes with the free ports each run gets): the test asks the router for one
session per decode (:func:`~kvcompose.e2e.flow.session_per_decode`). Then two conversations, one
per session, go through the router turn by turn, interleaved, every decode's own prefix cache
dropped before turns 2 and 3. Each later turn must land on the decode that served the session's
earlier turns, whose host tier holds them: host loads the earlier turns' full blocks and NIXL the
rest, and every answer equals the single-engine baseline's.

Memory: the baseline and prefill first; then the baseline closes and two decodes start (three
engines, 1 GiB of KV space each).
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvcompose.e2e.chat import SYSTEM, ChatTurn, baseline_chat, chat_through_router, load_tokenizer
from kvcompose.e2e.flow import Served, session_per_decode
from kvcompose.e2e.model import kv_bytes_per_token, make_model
from kvcompose.e2e.node import BLOCK_SIZE, EXAMPLES, EngineNode, EngineSpec, free_ports, wait_all_ready
from kvcompose.e2e.router import RouterNode
from kvcompose.e2e.server import ServerNode

pytestmark = pytest.mark.engine

MAX_TOKENS = 16
#: The second conversation's system prompt: words of its own, so that no block of one
#: conversation is a block of the other.
OTHER_SYSTEM = (
    "You answer questions about key and value caches for a team that runs many decode engines "
    "behind one router. Keep every answer short, concrete and friendly."
)


class Stack:
    """The baseline's answers to both conversations, then prefill + two decodes behind the router."""

    def __init__(self, logs: Path) -> None:
        self.model = make_model(0)
        tokenizer = load_tokenizer(self.model)
        p_port, d1_port, d2_port = free_ports(3)
        self.nodes: list[Any] = []
        baseline = EngineNode(EngineSpec("baseline", str(self.model)), logs)
        self.nodes.append(baseline)
        self.prefill = ServerNode(
            EngineSpec("prefill", str(self.model), str(EXAMPLES / "pd-prefill.yaml"), p_port), logs
        )
        self.nodes.append(self.prefill)
        wait_all_ready([baseline, self.prefill])
        self.chats: list[list[ChatTurn]] = [
            baseline_chat(baseline, tokenizer, MAX_TOKENS, system=SYSTEM),
            baseline_chat(baseline, tokenizer, MAX_TOKENS, system=OTHER_SYSTEM),
        ]
        baseline.close()
        self.nodes.remove(baseline)
        decode = str(EXAMPLES / "pd-decode.yaml")
        self.decodes = [
            ServerNode(EngineSpec("decode-1", str(self.model), decode, d1_port), logs),
            ServerNode(EngineSpec("decode-2", str(self.model), decode, d2_port), logs),
        ]
        self.nodes += self.decodes
        wait_all_ready(self.decodes)
        self.router = RouterNode([self.prefill], self.decodes, str(self.model), logs, policy="consistent_hash")
        self.nodes.append(self.router)
        self.router.wait_ready()

    def close(self) -> None:
        for n in reversed(self.nodes):
            n.close()


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with tempfile.TemporaryDirectory(prefix="kvcompose-e2e-1p2d-") as tmp:
        s: Stack | None = None
        try:
            s = Stack(Path(tmp))
            yield s
        finally:
            if s is not None:
                s.close()


def test_each_conversation_stays_on_one_decode_whose_host_tier_serves_its_later_turns(stack: Stack) -> None:
    sessions = session_per_decode(stack.router, stack.decodes)
    assert sorted(sessions) == ["decode-1", "decode-2"]
    runs = [
        chat_through_router(stack.router, stack.decodes, chat, MAX_TOKENS, session=session)
        for chat, session in zip(stack.chats, sessions.values())
    ]
    served: list[list[tuple[ChatTurn, Served]]] = [[], []]
    for _ in range(3):  # interleaved: a turn of each conversation in turn
        for i, run in enumerate(runs):
            served[i].append(next(run))
    for decode, turns in zip(sessions, served):
        assert [s.decode for _, s in turns] == [decode] * 3
        for turn, s in turns:
            assert turn.problems(s) == [], s.label
            assert s.failed_transfers == 0 and s.computed_tokens <= 1
        assert turns[0][1].loaded == {"pd": turns[0][1].prompt_tokens}
        for (previous, _), (_, s) in zip(turns, turns[1:]):
            shared = len(previous.prompt_ids) // BLOCK_SIZE * BLOCK_SIZE
            assert s.loaded == {"host": shared, "pd": s.prompt_tokens - shared}, (decode, s.label)
            pd_blocks = -(-(s.prompt_tokens - shared) // BLOCK_SIZE)
            assert s.nixl_bytes == pd_blocks * BLOCK_SIZE * kv_bytes_per_token(stack.model)
