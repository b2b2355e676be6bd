"""fleet-kill's figures from a given kill scenario (no engines): which conversations moved, what
a live instance held of their history, and the tokens the survivor computed again."""

from __future__ import annotations

from pathlib import Path

from kvcompose_tools.bench.fleet_kill import KillRun, moved_turns, summarize
from kvcompose_tools.bench.runner import BENCHMARKS, FULL_ONLY, TAKE_MODEL
from kvcompose_tools.e2e.fleet import POOLS, Scenario, Turn
from kvcompose_tools.e2e.flow import Served

BLOCK = 32


def served(prefill: str, prompt: list[int], computed: int, answer: int = 40) -> Served:
    return Served(
        "t", len(prompt), list(range(answer)), [0.0] * answer, "length", {}, 0, 0, 0, 0, 0.5, None,
        decode="decode-1", prefill=prefill, prefill_computed_tokens=computed,
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
            KillRun(pool, "prefill-1", moved_turns(scenario({"conv-a": n, "conv-b": 108}), BLOCK), 1, 5, 5)
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
