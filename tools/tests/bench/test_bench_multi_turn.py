"""multi-turn's figures from given conversations (no engines): link scaling, sides, per-turn
TTFT, answers against the baseline, ratios and the issue's targets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvcompose_tools.bench import multi_turn
from kvcompose_tools.bench.multi_turn import SIDES, SideRun, mismatches, scaled_rate, specs, summarize
from kvcompose_tools.bench.runner import BENCHMARKS, FULL_ONLY
from kvcompose_tools.e2e.flow import CACHED_BY_SOURCE, COMPUTED, NIXL_BYTES
from kvcompose_tools.e2e.load import Load, Turn


def conversations(ttft: dict[int, float], answer: list[int] | None = None, failed: int = 0) -> Load:
    """Two conversations of three turns; ``ttft`` by turn index; ``failed`` turns failed."""
    turns = []
    for c in range(2):
        for t in range(3):
            bad = failed > 0 and c == 1 and t == 2
            ids = answer if answer is not None and c == 0 else [c, t, 7]
            turns.append(
                Turn(float(c + t), None if bad else ttft[t], "HTTP 500" if bad else None, c, t, [], ids, ttft[t] + 0.2)
            )
    return Load("chat", turns, wall_s=6.0)


def side(name: str, ttft: dict[int, float], nixl: float = 6000.0) -> SideRun:
    return SideRun(
        name,
        "slow",
        conversations(ttft),
        Load("prefix", [Turn(0.0, 0.1)], 1.0),
        {COMPUTED: 900.0, f"{CACHED_BY_SOURCE}host}}": 300.0},
        {
            COMPUTED: 6.0,
            NIXL_BYTES: nixl,
            "vllm:nixl_xfer_time_seconds_sum": 0.03,
            "vllm:nixl_xfer_time_seconds_count": 6.0,
        },
        8000,
    )


def test_links_are_scaled_by_kv_bytes_per_token() -> None:
    # Llama-3-8B's 128 KiB a token against the tiny model's 1 KiB: 128x fewer bits per second.
    assert multi_turn.LLAMA_8B_KV_PER_TOKEN == 128 * 1024
    assert scaled_rate(100e9) == 781_000_000 and scaled_rate(25e9) == 195_000_000


def test_each_side_has_its_prefill_and_decode(tmp_path: Path) -> None:
    for name in SIDES:
        p, d = specs(name, "m", tmp_path, 5601, 5602, "10.0.0.2", "10.0.0.3")
        assert p.num_gpu_blocks == d.num_gpu_blocks == multi_turn.DEVICE_BLOCKS
        # Every side's side channels on its hosts' addresses, bare connectors' too.
        assert '"kvcompose_side_channel_host": "10.0.0.2"' in json.dumps(p.kv_transfer_config())
        assert '"kvcompose_side_channel_host": "10.0.0.3"' in json.dumps(d.kv_transfer_config())
    bare_p, bare_d = specs("bare", "m", tmp_path, 5601, 5602)
    assert bare_d.kv_transfer_config()["kv_connector"] == "NixlConnector"
    multi = specs("MultiConnector", "m", tmp_path, 5601, 5602)[1].kv_transfer_config()
    assert multi["kv_connector"] == "MultiConnector"
    first_wins = specs("kvcompose-first-wins", "m", tmp_path, 5601, 5602)[1]
    assert "load: first-wins" in Path(str(first_wins.composition)).read_text()
    with pytest.raises(ValueError, match="unknown side"):
        specs("nope", "m", tmp_path, 1, 2)


def test_a_side_that_served_nothing_is_infinitely_slow(tmp_path: Path) -> None:
    dead = SideRun("bare", "slow", conversations({0: 1.0, 1: 1.0, 2: 1.0}, failed=0), Load("prefix", [], 1.0))
    dead.chat = Load("chat", [Turn(0.0, None, "HTTP 500", 0, t) for t in range(3)], 1.0)
    assert dead.figures()["later_ttft_p50_s"] == float("inf")
    done = {"slow": {"bare": [dead], "kvcompose": [side("kvcompose", {0: 1.0, 1: 0.2, 2: 0.2})]}}
    r = summarize(done, 1, False, tmp_path, {}, 1.0)
    assert [x.by_median for x in r.ratios if x.case == "slow link, turns 2+"] == [0.0]


def test_figures_split_turn_1_from_later_turns_and_count_failures() -> None:
    run = side("kvcompose", {0: 0.5, 1: 0.1, 2: 0.2})
    f = run.figures()
    assert f["turn1_ttft_p50_s"] == 0.5 and f["later_ttft_p50_s"] == pytest.approx(0.15)
    assert f["tpot_p50_s"] == pytest.approx(0.1)  # 0.2 s after the first of three tokens
    assert f["nixl_bytes_per_request"] == 1000 and f["host_hit_tokens"] == {"prefill": 300, "decode": 0}
    assert run.ttft_by_turn() == [0.5, 0.1, 0.2]
    assert f["phases_ms"] == {"prefill": {}, "decode": {"nixl_read": 5.0}}  # where the time went, per instance
    broken = SideRun("bare", "slow", conversations({0: 1.0, 1: 1.0, 2: 1.0}, failed=1), Load("prefix", [], 1.0))
    assert broken.figures()["failed"] == 1 and broken.figures()["requests_per_s"] == 0.83  # 5 served in 6 s


def test_answers_are_compared_with_the_baseline_by_conversation_and_turn() -> None:
    baseline = conversations({0: 1, 1: 1, 2: 1})
    assert mismatches(conversations({0: 2, 1: 2, 2: 2}), baseline) == []
    differs = mismatches(conversations({0: 2, 1: 2, 2: 2}, answer=[9]), baseline)
    assert differs == ["conversation 0 turn 1", "conversation 0 turn 2", "conversation 0 turn 3"]


def test_targets_are_the_slow_links_later_turns(tmp_path: Path) -> None:
    ttft = {"bare": 1.0, "MultiConnector": 0.5, "kvcompose": 0.3, "kvcompose-first-wins": 0.6}
    done = {link: {s: [side(s, {0: 1.0, 1: ttft[s], 2: ttft[s]})] for s in SIDES} for link in ("fast", "slow")}
    r = summarize(done, 1, False, tmp_path, {}, 60.0)
    assert r.target_met is True  # 0.3 <= 0.5 x bare, <= 0.8 x MultiConnector, turn 1 equal
    later = [x for x in r.ratios if x.case == "slow link, turns 2+"]
    assert [(x.baseline, round(x.by_median, 2)) for x in later] == [("bare", 0.3), ("MultiConnector", 0.6)]
    assert r.config["ttft_by_turn"]["slow"]["kvcompose"] == [1.0, 0.3, 0.3]
    assert "answers compared with one engine without P/D, token ids: all equal" in r.table()
    slow = {**ttft, "kvcompose": 0.45}
    done["slow"] = {s: [side(s, {0: 1.0, 1: slow[s], 2: slow[s]})] for s in SIDES}
    assert summarize(done, 1, False, tmp_path, {"slow/kvcompose": ["conversation 0 turn 2"]}, 60.0).target_met is False
    assert BENCHMARKS["multi-turn"] == "multi_turn" and "multi-turn" in FULL_ONLY


def test_the_png_is_ttft_by_turn_one_line_per_side(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from kvcompose_tools.bench.plot import draw

    done = {"slow": {s: [side(s, {0: 1.0, 1: 0.5, 2: 0.4})] for s in SIDES}}
    path = draw(summarize(done, 1, False, tmp_path, {}, 1.0), tmp_path)
    assert path.name == "multi_turn.png" and path.stat().st_size > 10_000
