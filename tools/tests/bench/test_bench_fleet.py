"""fleet's figures from given conversations (no engines): where each turn was served (read from
the answer ids vllm-router makes), the shares of turns 2+ at home, the counters per server, the
ratios of kv_aware over the other policies and their orderings."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcompose.compose import load
from kvcompose.router import POLICIES
from kvcompose_cpu_offload import tiers
from kvcompose_tools.bench.fleet import (
    HOST_CACHED,
    POOL_SIDES,
    SIDES_ENV,
    SideRun,
    chosen_sides,
    minimum_tokens,
    served_by,
    side_of,
    summarize,
)
from kvcompose_tools.bench.runner import BENCHMARKS, FULL_ONLY, TAKE_MODEL
from kvcompose_tools.e2e.chat import load_tokenizer, render
from kvcompose_tools.e2e.fleet import POOL_WAIT_MS, fleet_compositions
from kvcompose_tools.e2e.flow import COMPUTED, NIXL_BYTES
from kvcompose_tools.e2e.load import Load, Turn
from kvcompose_tools.e2e.model import make_model

P = {"prefill-1": "127.0.0.1:8001", "prefill-2": "127.0.0.1:8002"}
D = {"decode-1": "127.0.0.1:9001", "decode-2": "127.0.0.1:9002"}


def answer_id(prefill: str, decode: str) -> str:
    """What vLLM's server answers behind vllm-router 0.1.17 in P/D mode (a real one's shape)."""
    return f"chatcmpl-___prefill_addr_{P[prefill]}___decode_addr_{D[decode]}_a9477ea522d04d02afee3b3db8260f54"


def test_the_answer_id_names_the_prefill_and_the_decode() -> None:
    assert served_by(answer_id("prefill-2", "decode-1")) == ("127.0.0.1:8002", "127.0.0.1:9001")
    assert served_by("chatcmpl-4f1c2d") is None


def run_of(policy: str, placements: list[list[tuple[str, str]]], ttft: float, computed: int) -> SideRun:
    """Conversations whose turns were served at ``placements`` (per conversation, per turn)."""
    turns = [
        Turn(float(t), ttft, None, c, t, [], [1, 2], ttft + 0.1, [], answer_id(*where))
        for c, conv in enumerate(placements)
        for t, where in enumerate(conv)
    ]
    turns.append(Turn(9.0, None, "HTTP 500", 9, 0))  # a failed turn: not placed, counted failed
    moved = {
        "prefill-1": {COMPUTED: computed * 0.75, HOST_CACHED: 64.0},
        "prefill-2": {COMPUTED: computed * 0.25},
        "decode-1": {NIXL_BYTES: 1000.0, HOST_CACHED: 32.0},
        "decode-2": {NIXL_BYTES: 500.0},
    }
    names = {**{v: k for k, v in P.items()}, **{v: k for k, v in D.items()}}
    router = {"vllm_router_pd_kv_prepare_seconds_sum": 2.1, "vllm_router_pd_kv_prepare_seconds_count": 59.0}
    return SideRun(policy, Load("chat", turns, wall_s=4.0), moved, names, router=router if "kv" in policy else {})


def test_figures_count_the_turns_served_where_the_previous_one_was() -> None:
    home = [("prefill-1", "decode-1")] * 3
    moved = [("prefill-2", "decode-2"), ("prefill-1", "decode-2"), ("prefill-1", "decode-1")]
    f = run_of("round_robin", [home, moved], 0.5, 1000).figures()
    assert f["turns_2plus"] == 4
    assert f["home_share"] == 0.5  # conversation 0's turns 2 and 3
    assert f["same_prefill_share"] == 0.75  # and conversation 1's turn 3 on prefill-1 again
    assert f["computed_by_prefill"] == {"prefill-1": 750, "prefill-2": 250} and f["computed_tokens"] == 1000
    assert (f["host_tokens"], f["nixl_bytes"], f["failed"], f["unplaced"]) == (96, 1500, 1, 0)
    assert f["cached_by_source"] == {"prefills": {"host": 64}, "decodes": {"host": 32}}
    assert f["requests_per_s"] == 1.5  # 6 served in 4 s
    assert f["prepare_mean_s"] is None  # no kv_aware placement prepared


def test_summary_takes_kv_aware_over_each_other_policy_run_by_run(tmp_path: Path) -> None:
    home = [("prefill-1", "decode-1")] * 3
    done = {
        "round_robin": [run_of("round_robin", [home], 1.0, 1000), run_of("round_robin", [home], 0.8, 900)],
        "consistent_hash": [run_of("consistent_hash", [home], 0.5, 500), run_of("consistent_hash", [home], 0.3, 300)],
        "kv_aware": [run_of("kv_aware", [home], 0.5, 400), run_of("kv_aware", [home], 0.4, 350)],
    }
    result = summarize(done, 2, False, tmp_path, 10.0, "tiny")
    orderings = result.config["orderings"]
    assert orderings["turns 2+ TTFT p50"] == {"kv_aware/round_robin": "<", "kv_aware/consistent_hash": "undecided"}
    assert orderings["prompt tokens computed"] == {"kv_aware/round_robin": "<", "kv_aware/consistent_hash": "undecided"}
    done["kv_aware+hash"] = [run_of("kv_aware+hash", [home], 0.2, 100), run_of("kv_aware+hash", [home], 0.2, 100)]
    orderings = summarize(done, 2, False, tmp_path, 10.0, "tiny").config["orderings"]
    assert orderings["turns 2+ TTFT p50"]["kv_aware+hash/consistent_hash"] == "<"
    assert {(r.case, r.baseline) for r in result.ratios} >= {("requests/s", "round_robin")}
    assert "fleet" in result.to_json()["benchmark"] and result.table()
    assert done["kv_aware"][0].figures()["prepare_mean_s"] == 0.0356
    done["kv_aware"][0].answers.equal, done["kv_aware"][1].answers.equal = 7, 6
    (note,) = [n for n in summarize(done, 2, False, tmp_path, 10.0, "tiny").notes if n.startswith("kv_aware:")]
    assert "answers over the runs: 13 equal, 0 parted at a near tie (0 later turns not compared), 0 wrong" in note


def test_the_benchmark_is_registered_as_a_full_run_that_takes_a_model() -> None:
    assert BENCHMARKS["fleet"] == "fleet" and "fleet" in FULL_ONLY and "fleet" in TAKE_MODEL
    assert POLICIES == ("round_robin", "consistent_hash", "kv_aware", "kv_aware+hash")


# -- the fleet's pool (issue 62)


def test_sides_name_a_policy_and_a_pool() -> None:
    assert side_of("round_robin") == ("round_robin", "simple", "off")  # issue 53's side
    assert side_of("round_robin@off") == ("round_robin", "native", "off")
    assert side_of("kv_aware+hash@peers") == ("kv_aware+hash", "native", "peers")
    assert len(POOL_SIDES) == 9 and chosen_sides({}) == POOL_SIDES
    assert chosen_sides({SIDES_ENV: "kv_aware, round_robin@shared"}) == ("kv_aware", "round_robin@shared")
    for bad in ("round_robin@disk", "random@peers", "round_robin@"):
        with pytest.raises(ValueError, match="POLICY or POLICY@POOL"):
            chosen_sides({SIDES_ENV: bad})


def test_the_minimum_is_the_first_prompt_and_each_turns_tokens_past_what_was_computed() -> None:
    """Turn 1's prompt starts with turn 0's prompt and the first ``k`` ids of its answer: only the
    rest of turn 1 is new; in whole blocks, the common prefix rounded down (and never the last token)."""
    tokenizer = load_tokenizer(make_model(0))
    first = [{"role": "system", "content": "You answer."}, {"role": "user", "content": "one two three " * 9}]
    second = [
        *first,
        {"role": "assistant", "content": "four five six " * 5},
        {"role": "user", "content": "seven " * 30},
    ]
    p0, p1 = render(tokenizer, first), render(tokenizer, second)
    assert p1[: len(p0)] == p0
    k = 7
    answer = p1[len(p0) : len(p0) + k] + [1, 1, 1]  # the answer's ids part from the next prompt after k
    turns = [Turn(0.0, 0.1, None, 0, 0, first, answer), Turn(1.0, 0.1, None, 0, 1, second, [5])]
    exact, whole = minimum_tokens(Load("chat", turns, 2.0), tokenizer, 32)
    common = len(p0) + k
    assert exact == len(p0) + len(p1) - common
    assert whole == len(p0) + len(p1) - min(common // 32, (len(p1) - 1) // 32) * 32
    failed = Turn(2.0, None, "HTTP 500", 1, 0, first, [])
    assert minimum_tokens(Load("chat", [*turns, failed], 2.0), tokenizer, 32) == (exact, whole)
    # Another conversation sharing the first prompt (a shared system prompt) computes its last token only.
    other = Turn(3.0, 0.1, None, 1, 0, first, [9])
    repeated = (exact + 1, whole + (len(p0) % 32 or 32))
    assert minimum_tokens(Load("chat", [*turns, other], 2.0), tokenizer, 32) == repeated


def test_the_pools_compositions_load_and_name_every_other_server(tmp_path: Path) -> None:
    prefills, decodes = ["prefill-1", "prefill-2"], ["decode-1", "decode-2"]
    names = prefills + decodes
    ports = {n: 6000 + i for i, n in enumerate(names)}
    events = {n: {"endpoint": f"ipc://{tmp_path}/{n}.events"} for n in names}
    files = fleet_compositions(prefills, decodes, "native", "peers", tmp_path, p2p_ports=ports, events=events)
    for name in names:
        host = load(files[name]).child("host")
        extra = host.vllm_config()["kv_connector_extra_config"]
        assert extra["secondary_tiers"] == [{"type": "p2p", "host": "127.0.0.1", "port": ports[name]}]
        assert extra[tiers.P2P_PD_TRANSPORT_KEY] == "pd"  # NIXL keeps the P/D legs
        assert extra[tiers.P2P_PROGRESS_DELAY_KEY] == 100
        pool = extra.get(tiers.P2P_POOL_KEY)
        if name in decodes:
            assert pool is None
            continue
        named = {(p["p2p_port"], p["kv_events"]) for p in pool["peers"]}
        assert named == {(ports[n], events[n]["endpoint"]) for n in names if n != name}
        assert pool["wait_ms"] == POOL_WAIT_MS
    shared = tmp_path / "kv"
    shared.mkdir(mode=0o700)
    files = fleet_compositions(prefills, decodes, "native", "shared", tmp_path, shared=shared)
    for name in names:
        extra = load(files[name]).child("host").vllm_config()["kv_connector_extra_config"]
        assert extra["secondary_tiers"] == [{"type": "fs", "root_dir": str(shared)}]
    assert fleet_compositions(prefills, decodes, "native", "off", tmp_path)["decode-1"].name == "native-decode.yaml"
