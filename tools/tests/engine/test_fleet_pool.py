"""2P2D with the fleet's peer pool (marker ``engine``): the native examples on two prefill and two
decode servers behind vLLM's router under ``consistent_hash``, each server with vLLM's p2p tier,
each prefill's pool naming the other three from their KV events (``Fleet(pool="peers")``, what
``kvcompose bench --only fleet-kill`` runs on the medium model).

Two conversations, two turns each; then the prefill that served the first conversation's last
turn is killed and each conversation has one more turn. A conversation whose prefill died
moves to the survivor, which held none of its history: its first turn there loads the history's
whole blocks from the decode's CPU tier, where the decode stored the prompt it answered, and
computes only the rest (the new message, the previous answer, the prompt's tail). Without the
pool the survivor computes the whole prompt (benchmark 5l's ``@off`` side): the check below fails
when the pool is inert, its index empty, or its source refused. Every answer equals the single
engine's, asked the same prompts.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from engine.stack import FleetStack, assert_answers_as_one_engine, assert_served_after_detection, module_stack
from kvcompose_tools.bench.fleet_kill import moved_turns
from kvcompose_tools.e2e.fleet import first_prompt, kill_scenario
from kvcompose_tools.e2e.node import EngineNode
from kvcompose_tools.e2e.spec import BLOCK_SIZE

pytestmark = pytest.mark.engine

MAX_TOKENS = 8
POOLED = {"policy": "consistent_hash", "host_tier": "native", "pool": "peers"}


@pytest.fixture(scope="module")
def stack() -> Iterator[FleetStack]:
    yield from module_stack(FleetStack, "kvcompose-e2e-fleet-pool-", POOLED)


def test_a_killed_prefills_conversations_load_their_history_from_a_live_peer(
    stack: FleetStack, baseline: EngineNode
) -> None:
    first = {f"conv-{i}": first_prompt(20 + i) for i in range(2)}
    scenario = kill_scenario(stack.fleet, first, MAX_TOKENS, before=2, after=1)
    assert_served_after_detection(scenario)

    moved = moved_turns(scenario, BLOCK_SIZE)
    assert moved, "no conversation was on the killed prefill"  # the first one is, by construction
    for m in moved:
        assert m.held >= 9 * BLOCK_SIZE, m  # the history a live decode's CPU tier held
        assert m.computed < m.prompt_tokens, m  # not the whole prompt: the pool loaded
        assert m.recomputed == 0, m  # none of what a live peer held computed again

    assert_answers_as_one_engine(scenario, baseline, MAX_TOKENS)
