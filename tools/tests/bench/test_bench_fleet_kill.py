"""fleet-kill's figures from a given kill scenario (no engines): which conversations moved, what
a live instance held of their history, and the tokens the survivor computed again."""

from __future__ import annotations

from pathlib import Path

from kvcompose_tools.bench.fleet_kill import ChangeRun, moved_turns, summarize
from kvcompose_tools.bench.runner import BENCHMARKS, FULL_ONLY, TAKE_MODEL
from kvcompose_tools.e2e.fleet import POOLS, Scenario, Turn
from kvcompose_tools.e2e.flow import Served

BLOCK = 32


def served(
    prefill: str, prompt: list[int], computed: int, answer: int = 40, decode: str = "decode-1", decode_computed: int = 0
) -> Served:
    return Served(
        "t", len(prompt), list(range(answer)), [0.0] * answer, "length", {}, decode_computed, 0, 0, 0, 0.5, None,
        decode=decode, prefill=prefill, prefill_computed_tokens=computed,
    )  # fmt: skip


def scenario(survivor_computes: dict[str, int]) -> Scenario:
    """conv-a on prefill-1 (killed), conv-b on prefill-2; a failed turn inside the router's window."""
    out = Scenario(killed="prefill-1")
    for session, home in (("conv-a", "prefill-1"), ("conv-b", "prefill-2")):
        prompt = [1] * 300
        out.turns.append(Turn(session, prompt, served(home, prompt, 300)))
        prompt = prompt + [2] * 40 + [3] * 40  # 380: its decode's host tier holds 300 // 32 * 32 = 288
        out.turns.append(Turn(session, prompt, served(home, prompt, 380 - 288)))
    for session in ("conv-a", "conv-b"):
        # 460 tokens; the prompt's 380 // 32 * 32 = 352 held (not the answer's: prompt + answer is 384)
        prompt = out.of(session)[-1].prompt + [2] * 40 + [4] * 40
        if session == "conv-a":
            out.turns.append(Turn(session, prompt, None, 0.3, "the router's 503"))
        out.turns.append(Turn(session, prompt, served("prefill-2", prompt, survivor_computes[session]), 1.5))
    return out


def test_a_moved_conversation_counts_what_the_survivor_computed_of_what_a_live_instance_held() -> None:
    recomputed = moved_turns(scenario({"conv-a": 460, "conv-b": 108}), BLOCK)  # pool off: the whole history
    (one,) = recomputed
    assert (one.session, one.prompt_tokens, one.held, one.computed) == ("conv-a", 460, 352, 460)
    assert one.recomputed == 352
    loaded = moved_turns(scenario({"conv-a": 108, "conv-b": 108}), BLOCK)  # the pool: the new part only
    assert [m.recomputed for m in loaded] == [0]


def test_the_summary_gives_each_pools_recomputed_tokens_and_failed_turns(tmp_path: Path) -> None:
    runs = {
        f"consistent_hash@{pool}": [
            ChangeRun(pool, "prefill-1", moved_turns(scenario({"conv-a": n, "conv-b": 108}), BLOCK), 1, 5, 5)
        ]
        for pool, n in zip(POOLS, (460, 108, 140), strict=True)
    }
    result = summarize(runs, 1, False, tmp_path, 1.0, "tiny", [])
    (recomputed, held, failed) = result.cases
    assert {s: v.values for s, v in recomputed.samples.items()} == {
        "consistent_hash@off": [352.0],
        "consistent_hash@peers": [0.0],
        "consistent_hash@shared": [32.0],
    }
    assert held.samples["consistent_hash@peers"].values == [352.0]
    assert failed.samples["consistent_hash@off"].values == [1.0]
    assert result.table() and "fleet-kill" in result.to_json()["benchmark"]
    assert BENCHMARKS["fleet-kill"] == "fleet_kill" and "fleet-kill" in FULL_ONLY and "fleet-kill" in TAKE_MODEL


def joined(new_decode_computes: int) -> Scenario:
    """conv-a and conv-b on prefill-1 and decode-1; decode-3 joins; conv-a's next turn lands there."""
    out = Scenario(joined="decode-3")
    for session in ("conv-a", "conv-b"):
        prompt = [1] * 300
        out.turns.append(Turn(session, prompt, served("prefill-1", prompt, 300)))
    for session, decode in (("conv-a", "decode-3"), ("conv-b", "decode-1")):
        prompt = out.of(session)[-1].prompt + [2] * 40 + [4] * 40  # 380; 300 // 32 * 32 = 288 held
        s = served("prefill-1", prompt, 380 - 288, decode=decode, decode_computed=new_decode_computes)
        out.turns.append(Turn(session, prompt, s, 0.2))
    return out


def test_a_conversation_moved_to_a_joining_decode_counts_what_the_prefill_and_that_decode_computed() -> None:
    (one,) = moved_turns(joined(0), BLOCK)  # conv-b stayed on decode-1: not moved
    assert (one.session, one.prompt_tokens, one.held, one.computed, one.recomputed) == ("conv-a", 380, 288, 92, 0)
    (again,) = moved_turns(joined(380), BLOCK)  # the new decode computed the prompt itself
    assert again.recomputed == 380  # its whole prompt, on top of what the prefill computed
    result = summarize({"consistent_hash@off": [ChangeRun("off", "decode-3", [again], 0, 4, 4)]}, 1, False,
                       Path("."), 1.0, "tiny", [], "join")  # fmt: skip
    assert result.to_json()["benchmark"] == "fleet-join" and "joining" in result.title
    assert result.cases[0].label == "history tokens recomputed after the join"
    assert BENCHMARKS["fleet-join"] == "fleet_join" and "fleet-join" in FULL_ONLY and "fleet-join" in TAKE_MODEL
