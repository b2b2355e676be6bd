"""2P2D (marker ``engine``): two prefill and two decode servers of the shipped compositions behind
vLLM's router, prefills chosen by ``kv_aware`` over their composed KV events (relayed in the
16-token blocks the router indexes), decodes kept per session by its affinity.

Two conversations, three turns each, interleaved: every later turn is computed by the prefill
that computed the earlier ones (it holds their blocks: only the new part is computed) and
answered by the same decode. Then that prefill is killed: within the router's health window
(one check a second, two failures) a request may fail with the router's own error, after it
every turn is served by the other prefill, which computes the history once, and every answer
equals the single-engine baseline's.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.stack import Nodes, module_stack
from kvcompose_tools.e2e.fleet import Fleet
from kvcompose_tools.e2e.flow import Served, same_output
from kvcompose_tools.e2e.model import make_model
from kvcompose_tools.e2e.node import EngineNode
from kvcompose_tools.e2e.processes import NodeError
from kvcompose_tools.e2e.spec import BLOCK_SIZE

pytestmark = pytest.mark.engine

MAX_TOKENS = 8
#: Tokens each turn adds after the answer (a user's next message).
TURN_TOKENS = 40
#: How long after the kill a request may still fail: the router's health window (HEALTH_ARGS:
#: two failed checks a second apart) and a check's own timeout.
DETECT_S = 6.0


class Stack(Nodes):
    def __init__(self, logs: Path) -> None:
        super().__init__()
        self.fleet = Fleet(make_model(0), logs, policy="kv_aware")
        self.nodes.append(self.fleet)
        self.fleet.start()


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    yield from module_stack(Stack, "kvcompose-e2e-fleet-")


def first_prompt(seed: int) -> list[int]:
    return [5 + (seed * 7919 + i * 31) % 500 for i in range(9 * BLOCK_SIZE + 12)]  # vocab 512


def test_turns_follow_their_history_and_move_once_when_its_prefill_dies(stack: Stack, baseline: EngineNode) -> None:
    fleet = stack.fleet
    prompts = {"conv-a": first_prompt(1), "conv-b": first_prompt(2)}
    served: dict[str, list[tuple[list[int], Served]]] = {s: [] for s in prompts}

    def turn(session: str) -> Served:
        prompt = prompts[session]
        s = fleet.turn(prompt, MAX_TOKENS, session)
        served[session].append((prompt, s))
        prompts[session] = prompt + s.token_ids + [7 + len(served[session])] * TURN_TOKENS
        return s

    for _ in range(3):
        for session in prompts:
            turn(session)
    for session, turns in served.items():
        (_, first), *later = turns
        assert first.prefill_computed_tokens == first.prompt_tokens, (session, first)
        for (previous, _), (prompt, s) in zip(turns, later):
            held = len(previous) // BLOCK_SIZE * BLOCK_SIZE
            assert (s.prefill, s.decode) == (first.prefill, first.decode), (session, s.label)
            assert s.prefill_computed_tokens == len(prompt) - held, (session, s)  # only the new part

    victim = served["conv-a"][-1][1].prefill
    assert victim is not None
    fleet.kill_prefill(victim)
    killed = time.monotonic()
    failed_late: list[str] = []
    after: dict[str, list[Served]] = {s: [] for s in prompts}
    while min(len(v) for v in after.values()) < 2:
        for session in prompts:
            if len(after[session]) >= 2:
                continue
            try:
                after[session].append(turn(session))
            except NodeError as exc:
                if time.monotonic() - killed > DETECT_S:
                    failed_late.append(f"{session}: {exc}"[:400])
                time.sleep(0.5)
        assert time.monotonic() - killed < 60, "the router did not move the conversations within 60 s"
    assert not failed_late, failed_late
    (survivor,) = [p.name for p in fleet.alive]
    for session, (moved, then) in after.items():
        assert moved.prefill == survivor and then.prefill == survivor, session
        assert moved.prefill_computed_tokens == moved.prompt_tokens  # the history computed once
        assert then.prefill_computed_tokens is not None and then.prefill_computed_tokens < then.prompt_tokens

    # Every answer equals the single engine's, asked the conversations in the same order.
    for session, turns in served.items():
        for prompt, s in turns:
            (want,) = baseline.generate([prompt], MAX_TOKENS)
            assert same_output(s.token_ids, s.logprobs, want), (session, s.label, s.token_ids, want["token_ids"])
