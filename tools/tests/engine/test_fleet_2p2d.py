"""2P2D (marker ``engine``): two prefill and two decode servers of the shipped compositions behind
vLLM's router, under the policy deploy/kubernetes/ runs (:data:`kvcompose.serving.FLEET_POLICY`):
prefills chosen by ``kv_aware`` over their composed KV events (relayed in the 16-token blocks the
router indexes), decodes by a hash of the session. The servers' P/D flags and the router's are
built as the manifests spell them (:mod:`kvcompose.serving`; tools/tests/e2e/test_kubernetes.py).

First the routing's control: two conversations whose first turns were computed on one prefill
each, sent to it directly (not through the router), go on through the router in the order
C, D, D, C, all under one session. ``kv_aware`` sends each turn to the prefill whose events say
it holds the history; ``round_robin`` alternates (D's second turn would land on C's prefill) and
``consistent_hash`` sends one session to one prefill (C's or D's turns would land on the other's),
so either policy, or a relay that passes the router nothing, fails it.

Then two conversations, three turns each, interleaved: every later turn is computed by the prefill
that computed the earlier ones (it holds their blocks: only the new part is computed) and
answered by the same decode. Then that prefill is killed: within the router's health window
(one check a second, two failures) a request may fail with the router's own error, after it
every turn is served by the other prefill, which computes the history once, and every answer
equals the single-engine baseline's.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from engine.stack import FleetStack, assert_answers_as_one_engine, assert_served_after_detection, module_stack
from kvcompose.serving import FLEET_POLICY
from kvcompose_tools.e2e.fleet import TURN_TOKENS, first_prompt, kill_scenario
from kvcompose_tools.e2e.node import EngineNode
from kvcompose_tools.e2e.spec import BLOCK_SIZE

pytestmark = pytest.mark.engine

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def stack() -> Iterator[FleetStack]:
    yield from module_stack(FleetStack, "kvcompose-e2e-fleet-", {"policy": FLEET_POLICY})


def test_each_turn_goes_to_the_prefill_that_holds_its_history_not_to_its_sessions(
    stack: FleetStack, baseline: EngineNode
) -> None:
    placed = dict(zip(("conv-c", "conv-d"), stack.fleet.prefills, strict=True))
    prompts: dict[str, list[int]] = {}
    held: dict[str, int] = {}  # the full blocks of the history the conversation's prefill holds
    for seed, (name, prefill) in enumerate(placed.items(), start=3):
        prompt = first_prompt(seed)
        (answer,) = prefill.generate([prompt], 1)  # computed there alone: no router, no decode
        held[name] = len(prompt) // BLOCK_SIZE * BLOCK_SIZE
        prompts[name] = prompt + answer["token_ids"] + [7] * TURN_TOKENS
    for name in ("conv-c", "conv-d", "conv-d", "conv-c"):
        prompt = prompts[name]
        served = stack.fleet.turn(prompt, MAX_TOKENS, "one-user")
        assert served.prefill == placed[name].name, (name, served.prefill, served)
        assert served.prefill_computed_tokens == len(prompt) - held[name], (name, served)
        (want,) = baseline.generate([prompt], MAX_TOKENS)
        assert served.equals(want), (name, served.token_ids, want)
        held[name] = len(prompt) // BLOCK_SIZE * BLOCK_SIZE
        prompts[name] = prompt + served.token_ids + [8] * TURN_TOKENS


def test_turns_follow_their_history_and_move_once_when_its_prefill_dies(
    stack: FleetStack, baseline: EngineNode
) -> None:
    first = {"conv-a": first_prompt(1), "conv-b": first_prompt(2)}
    scenario = kill_scenario(stack.fleet, first, MAX_TOKENS, before=3, after=2)
    assert_served_after_detection(scenario)
    (survivor,) = [p.name for p in stack.fleet.alive]
    for session in first:
        turns = [t for t in scenario.of(session) if t.served is not None]
        (one, *later) = [t.served for t in turns if t.after_s is None]
        assert one.prefill_computed_tokens == one.prompt_tokens, (session, one)
        for previous, t in zip(turns, turns[1:3]):  # turns 2 and 3: on the prefill and decode that hold them
            held = len(previous.prompt) // BLOCK_SIZE * BLOCK_SIZE
            assert (t.served.prefill, t.served.decode) == (one.prefill, one.decode), (session, t.served)
            assert t.served.prefill_computed_tokens == len(t.prompt) - held, (session, t.served)
        moved, then = [t.served for t in turns if t.after_s is not None]
        assert moved.prefill == survivor and then.prefill == survivor, session
        if one.prefill == scenario.killed:  # its history computed once on the survivor, then held
            assert moved.prefill_computed_tokens == moved.prompt_tokens, (session, moved)
        assert then.prefill_computed_tokens is not None and then.prefill_computed_tokens < then.prompt_tokens
        assert {t.served.decode for t in turns} == {one.decode}, session

    assert_answers_as_one_engine(scenario, baseline, MAX_TOKENS)
