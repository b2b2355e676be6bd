"""1P2D (marker ``engine``): one prefill and two decode servers behind vLLM's router, whose
``consistent_hash`` policy keeps a conversation on one decode instance.

The router hashes each request's ``X-Session-ID`` onto a ring of the decode servers (their URLs,
so the mapping changes with the free ports each run gets): the test asks the router for one
session per decode (:func:`~kvcompose_tools.e2e.flow.session_per_decode`). Then two conversations, one
per session, go through the router turn by turn, interleaved, every decode's own prefix cache
dropped before turns 2 and 3. Each later turn must land on the decode that served the session's
earlier turns, whose host tier holds them: host loads the earlier turns' full blocks and NIXL the
rest, and every answer equals the single-engine baseline's.

Memory: the prefill and two decodes start together (three engines, 1 GiB of KV space each) while
the session's baseline engine (``conftest.py``) answers the conversations; it stays up, idle.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.stack import Nodes, module_stack
from kvcompose.examples import EXAMPLES
from kvcompose_tools.e2e.chat import OTHER_SYSTEM, SYSTEM, ChatTurn, baseline_chat, chat_through_router, load_tokenizer
from kvcompose_tools.e2e.events import EventListener, kv_events_config
from kvcompose_tools.e2e.flow import Served, session_per_decode
from kvcompose_tools.e2e.model import kv_bytes_per_token, make_model
from kvcompose_tools.e2e.node import EngineNode, wait_all_ready
from kvcompose_tools.e2e.ports import free_ports
from kvcompose_tools.e2e.router import RouterNode
from kvcompose_tools.e2e.server import ServerNode
from kvcompose_tools.e2e.spec import BLOCK_SIZE, EngineSpec

#: Long (``make test-long``), kept out of CI's hour for time; test_fleet_2p2d.py keeps a fleet
#: behind the router in ``make test``.
pytestmark = [pytest.mark.engine, pytest.mark.long]

MAX_TOKENS = 16


class Stack(Nodes):
    """The baseline's answers to both conversations, then prefill + two decodes behind the router."""

    def __init__(self, logs: Path, baseline: EngineNode) -> None:
        self.model = make_model(0)
        tokenizer = load_tokenizer(self.model)
        p_port, d1_port, d2_port = free_ports(3)
        super().__init__()
        self.prefill = self.prefill_server(self.model, logs, p_port)
        decode = str(EXAMPLES / "pd-decode.yaml")
        events = {name: kv_events_config(logs / f"{name}.events") for name in ("decode-1", "decode-2")}
        self.decodes = [
            ServerNode(EngineSpec(name, str(self.model), decode, port, kv_events=events[name]), logs)
            for name, port in zip(events, (d1_port, d2_port))
        ]
        self.nodes += [self.prefill, *self.decodes]  # starting while the baseline answers
        self.chats: list[list[ChatTurn]] = [
            baseline_chat(baseline, tokenizer, MAX_TOKENS, system=SYSTEM),
            baseline_chat(baseline, tokenizer, MAX_TOKENS, system=OTHER_SYSTEM),
        ]
        wait_all_ready([self.prefill, *self.decodes])
        self.events = {name: EventListener(config["endpoint"]) for name, config in events.items()}
        self.router = RouterNode([self.prefill], self.decodes, str(self.model), logs, policy="consistent_hash")
        self.nodes.append(self.router)
        self.router.wait_ready()

    def close(self) -> None:
        for listener in getattr(self, "events", {}).values():
            listener.close()
        super().close()


@pytest.fixture(scope="module")
def stack(baseline: EngineNode) -> Iterator[Stack]:
    yield from module_stack(Stack, "kvcompose-e2e-1p2d-", baseline)


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

    # Both decodes published their KV events through vLLM's publisher: the host tier's stores
    # (medium CPU) of a conversation's blocks come only from the decode that served it, and
    # they outlive the device cache's resets (AllBlocksCleared), which is what a router needs
    # to send a later turn where its prefix is.
    blocks = {
        decode: {b for turn, _ in turns for b in _full_blocks(turn.prompt_ids)}
        for decode, turns in zip(sessions, served)
    }
    for decode, other in (("decode-1", "decode-2"), ("decode-2", "decode-1")):
        listener = stack.events[decode]
        host = {tuple(b.token_ids) for b in listener.stored() if b.medium == "CPU"}
        device = {tuple(b.token_ids) for b in listener.stored() if b.medium == "GPU"}
        first_turn = _full_blocks(served[list(sessions).index(decode)][0][0].prompt_ids)
        assert first_turn <= host and first_turn <= device, decode
        # (by token ids: blocks of padding words can be equal in both conversations)
        theirs = blocks[other] - blocks[decode]
        assert theirs and not (theirs & host), f"{decode} published host blocks of {other}'s conversation"
        assert listener.cleared() >= 2


def _full_blocks(ids: list[int]) -> set[tuple[int, ...]]:
    """The token ids of each full block of a prompt."""
    return {tuple(ids[k : k + BLOCK_SIZE]) for k in range(0, len(ids) // BLOCK_SIZE * BLOCK_SIZE, BLOCK_SIZE)}
