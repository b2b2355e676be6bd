"""multi-turn's figures from given conversations (no engines): link scaling, sides, workloads
per model, per-turn TTFT, answers against the baseline, ratios, orderings, the time breakdown and
the issues' targets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvcompose_tools.bench import multi_turn
from kvcompose_tools.bench.measure import Samples
from kvcompose_tools.bench.multi_turn import (
    BASELINES,
    HOST_BYTES_ENV,
    LOADS_ENV,
    MULTI_NATIVE,
    NATIVE,
    P2P,
    PAIRS,
    SIDES,
    SIDES_ENV,
    SUBJECT,
    TRUST_OFF,
    VLLM_P2P,
    WORKLOADS,
    Answers,
    SideRun,
    breakdown,
    chosen_host_bytes,
    chosen_loads,
    chosen_sides,
    mismatches,
    ordering,
    parse_point,
    point,
    scaled_rate,
    specs,
    summarize,
)
from kvcompose_tools.bench.report import AllTargets
from kvcompose_tools.bench.runner import BENCHMARKS, FULL_ONLY
from kvcompose_tools.e2e.flow import CACHED_BY_SOURCE, COMPUTED, NATIVE_LOADED_BYTES, NIXL_BYTES
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


def side(name: str, ttft: dict[int, float], nixl: float = 6000.0, wall_s: float = 6.0) -> SideRun:
    run = SideRun(
        name,
        "slow",
        conversations(ttft),
        Load("prefix", [Turn(0.0, 0.1)], 1.0),
        {
            COMPUTED: 900.0,
            f"{CACHED_BY_SOURCE}host}}": 300.0,
            "vllm:request_prefill_time_seconds_sum": 1.2,
            "vllm:request_prefill_time_seconds_count": 6.0,
        },
        {
            COMPUTED: 6.0,
            NIXL_BYTES: nixl,
            "vllm:nixl_xfer_time_seconds_sum": 0.03,
            "vllm:nixl_xfer_time_seconds_count": 6.0,
            "vllm:request_prefill_time_seconds_sum": 0.06,
            "vllm:request_prefill_time_seconds_count": 6.0,
        },
        8000,
        [0.1, 0.12, 0.11],
        [0.65, 0.71, 0.68],
    )
    run.chat.wall_s = wall_s
    return run


def test_links_are_scaled_by_kv_bytes_per_token() -> None:
    # Llama-3-8B's 128 KiB a token against the tiny model's 1 KiB: 128x fewer bits per second.
    assert multi_turn.LLAMA_8B_KV_PER_TOKEN == 128 * 1024
    assert scaled_rate(100e9) == 781_000_000 and scaled_rate(25e9) == 195_000_000
    # The medium model's 16 KiB a token: 8x fewer than the 8B model's.
    assert scaled_rate(25e9, 16 * 1024) == 3_125_000_000


def test_every_model_has_a_workload_that_outgrows_the_device_and_fits_the_host_tier() -> None:
    from kvcompose.units import ByteSize
    from kvcompose_tools.commands import MODEL_NAMES
    from kvcompose_tools.e2e.model import MODELS

    assert set(WORKLOADS) == set(MODELS) == set(MODEL_NAMES)
    medium = WORKLOADS["medium"]
    assert medium.turns >= 8 and medium.max_model_len >= 4096 and medium.runs >= 5 and medium.links == ("slow",)
    # A conversation's last turn: system prompt, first message, then follow-ups and answers.
    longest = medium.system_tokens + 350 + (medium.turns - 1) * (100 + 24) + 24
    assert longest < medium.max_model_len
    history = medium.conversations * longest
    assert history > medium.device_blocks * 32  # outgrows the device KV
    assert history * 16 * 1024 < ByteSize.parse(medium.host_bytes)  # fits the host tier


def test_each_side_has_its_prefill_and_decode(tmp_path: Path) -> None:
    for name in SIDES:
        (p, p_env), (d, d_env) = specs(name, "m", tmp_path, 5601, 5602, "10.0.0.2", "10.0.0.3")
        assert p.num_gpu_blocks == d.num_gpu_blocks == WORKLOADS["tiny"].device_blocks
        assert p.max_model_len == d.max_model_len == 1024
        if name == "bare":  # vLLM's own class places its side channel from the environment
            assert p_env == {"VLLM_NIXL_SIDE_CHANNEL_HOST": "10.0.0.2", "VLLM_NIXL_SIDE_CHANNEL_PORT": "5601"}
            assert d_env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.0.0.3"
            continue
        assert p_env == d_env == {}
        assert '"kvcompose_side_channel_host": "10.0.0.2"' in json.dumps(p.kv_transfer_config())
        assert '"kvcompose_side_channel_host": "10.0.0.3"' in json.dumps(d.kv_transfer_config())
    (bare_p, _), (bare_d, _) = specs("bare", "m", tmp_path, 5601, 5602)
    # vLLM's NixlConnector as shipped: the name vLLM registers, no module path (no kvcompose class).
    assert bare_d.kv_transfer_config() == {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}
    assert bare_p.kv_transfer_config()["kv_role"] == "kv_producer"
    plugin = specs("nixl-plugin", "m", tmp_path, 5601, 5602)[1][0].kv_transfer_config()
    assert (plugin["kv_connector"], plugin["kv_connector_module_path"]) == ("NixlConnector", "kvcompose_nixl.connector")
    multi = specs("MultiConnector", "m", tmp_path, 5601, 5602)[1][0].kv_transfer_config()
    assert multi["kv_connector"] == "MultiConnector"
    first_wins = specs("kvcompose-first-wins", "m", tmp_path, 5601, 5602)[1][0]
    assert "load: first-wins" in Path(str(first_wins.composition)).read_text()
    medium = specs("kvcompose", "m", tmp_path, 5601, 5602, workload=WORKLOADS["medium"])[1][0]
    assert medium.max_model_len == 4096 and "cpu_bytes: 1GiB" in Path(str(medium.composition)).read_text()
    with pytest.raises(ValueError, match="unknown side"):
        specs("nope", "m", tmp_path, 1, 2)


def test_the_native_sides_are_the_native_examples_under_each_composite(tmp_path: Path) -> None:
    """kvcompose-native runs the native examples (vLLM's OffloadingConnector as the host tier,
    ranges on the decode); MultiConnector-native the same children under vLLM's MultiConnector."""
    (p, _), (d, _) = specs(NATIVE, "m", tmp_path, 1, 2, workload=WORKLOADS["medium"])
    for spec in (p, d):
        text = Path(str(spec.composition)).read_text()
        assert "type: native-offload" in text and "cpu_bytes: 1GiB" in text
    assert "load: ranges" in Path(str(d.composition)).read_text()
    (_, _), (multi, _) = specs(MULTI_NATIVE, "m", tmp_path, 1, 2)
    config = multi.kv_transfer_config()
    assert config["kv_connector"] == "MultiConnector" and "kv_connector_module_path" not in config
    children = config["kv_connector_extra_config"]["connectors"]
    assert [c["kv_connector"] for c in children] == ["OffloadingConnector", "NixlConnector"]
    assert "kv_connector_module_path" not in children[0]  # vLLM's own class, the plugin's spec on CPU
    assert {(s, b) for s, b in PAIRS if s == NATIVE} == {(NATIVE, MULTI_NATIVE), (NATIVE, "bare"), (NATIVE, VLLM_P2P)}


def test_a_load_sweep_runs_every_side_at_each_client_count(tmp_path: Path) -> None:
    medium = WORKLOADS["medium"]
    assert chosen_loads({}) == () and chosen_loads({LOADS_ENV: "1, 5,10"}) == (1, 5, 10)
    for bad in ("0", "five", "2,-1"):
        with pytest.raises(ValueError, match="KVCOMPOSE_BENCH_CLIENTS"):
            chosen_loads({LOADS_ENV: bad})
    assert point("slow", medium.clients, medium) == "slow" == point("slow", medium.clients, medium, medium.host_bytes)
    assert point("slow", 10, medium) == "slow, 10 clients"
    assert parse_point("slow, 10 clients", medium) == ("slow", 10, medium.host_bytes)
    assert parse_point("slow", medium) == ("slow", medium.clients, medium.host_bytes)
    assert point("slow", 1, medium, "256MiB") == "slow, 1 client, 256MiB host tiers"
    assert parse_point("slow, 1 client, 256MiB host tiers", medium) == ("slow", 1, "256MiB")
    assert parse_point("slow, 256MiB host tiers", medium) == ("slow", medium.clients, "256MiB")
    assert chosen_host_bytes({}) == () and chosen_host_bytes({HOST_BYTES_ENV: "1GiB, 256MiB"}) == ("1GiB", "256MiB")
    with pytest.raises(ValueError, match="KVCOMPOSE_BENCH_HOST_BYTES: expected a size"):
        chosen_host_bytes({HOST_BYTES_ENV: "lots"})
    runs = {"kvcompose": 0.5, "MultiConnector": 1.0}
    done = {
        at: {s: [side(s, {0: 1.0, 1: t * k, 2: t * k})] for s, t in runs.items()}
        for at, k in (("slow", 1.0), ("slow, 10 clients", 3.0))
    }
    r = summarize(done, 1, False, tmp_path, {}, 1.0, model="medium")
    assert [c.label for c in r.cases][:4] == [
        "slow link, turn 1",
        "slow link, turns 2+",
        "slow link, requests/s",
        "slow link, 10 clients, turn 1",
    ]
    assert r.config["orderings"]["slow link, 10 clients, turns 2+"] == {"kvcompose/MultiConnector": "<"}
    # The targets are the workload's own load point's.
    assert isinstance(r.target, AllTargets) and {t.case for t in r.target.items} == {"slow link, turns 2+"}


def test_trust_off_is_the_examples_without_a_key_placed_by_vllms_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No key on either instance; the side channels from VLLM_NIXL_SIDE_CHANNEL_HOST, beyond
    loopback with insecure_side_channel (refused without it), the decode's peers the prefill's host."""
    from kvcompose_tools.e2e.hosts import Host
    from kvcompose_tools.e2e.spec import placed

    (p, p_env), (d, d_env) = specs(TRUST_OFF, "m", tmp_path, 5601, 5602, "10.0.0.2", "10.0.0.3")
    assert p_env == {"VLLM_NIXL_SIDE_CHANNEL_HOST": "10.0.0.2", "VLLM_NIXL_SIDE_CHANNEL_PORT": "5601"}
    assert d_env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.0.0.3"
    for spec, env, address in ((p, p_env, "10.0.0.2"), (d, d_env, "10.0.0.3")):
        text = Path(str(spec.composition)).read_text()
        assert "key_env" not in text and "side_channel_host" not in text
        assert "insecure_side_channel: true" in text  # keyless beyond loopback is refused otherwise
        assert ("load: ranges" in text) is (spec is d)  # the examples' rules otherwise
        monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_HOST", env["VLLM_NIXL_SIDE_CHANNEL_HOST"])
        # As ServerNode places it in its host: the spec's unset host wins over the host's address.
        config = placed(spec, Host(spec.name, "ns", address)).kv_transfer_config()
        assert config is not None
        (nixl,) = [c for c in config["kv_connector_extra_config"]["connectors"] if c["kv_connector"] == "NixlConnector"]
        extra = nixl["kv_connector_extra_config"]
        assert "kvcompose_key_env" not in extra and "kvcompose_side_channel_host" not in extra
        assert extra.get("kvcompose_peers") == (["10.0.0.2"] if spec is d else None)
    # The shipped examples, keyed, on the kvcompose side.
    assert "key_env: KVCOMPOSE_PD_KEY" in Path(str(specs(SUBJECT, "m", tmp_path, 1, 2)[1][0].composition)).read_text()
    assert TRUST_OFF not in SIDES and TRUST_OFF in BASELINES


def test_the_sides_run_are_chosen_by_the_environment() -> None:
    assert chosen_sides({}) == SIDES and chosen_sides({SIDES_ENV: ""}) == SIDES
    assert chosen_sides({SIDES_ENV: "kvcompose, kvcompose-trust-off"}) == (SUBJECT, TRUST_OFF)
    with pytest.raises(ValueError, match="unknown side.*'trust'.*choose from bare"):
        chosen_sides({SIDES_ENV: "kvcompose,trust"})


def test_trust_on_over_trust_off_is_a_ratio_of_every_case(tmp_path: Path) -> None:
    done = {
        "slow": {
            SUBJECT: [side(SUBJECT, {0: 1.0, 1: 0.22, 2: 0.22})],
            TRUST_OFF: [side(TRUST_OFF, {0: 1.0, 1: 0.2, 2: 0.2})],
        }
    }
    r = summarize(done, 1, False, tmp_path, {}, 1.0)
    trust = {x.case: round(x.by_median, 3) for x in r.ratios if x.baseline == TRUST_OFF}
    assert trust == {"slow link, turn 1": 1.0, "slow link, turns 2+": 1.1, "slow link, requests/s": 1.0}
    assert r.target is None  # no target without bare or MultiConnector
    assert f"kvcompose/{TRUST_OFF} is what trust costs" in r.table()
    assert r.config["orderings"]["slow link, turns 2+"] == {f"kvcompose/{TRUST_OFF}": ">"}


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
    # Where the time went, per instance, in ms per request (the histograms' sums over 6 requests).
    assert f["phases_ms"] == {"prefill": {"prefill_step": 200.0}, "decode": {"prefill_step": 10.0, "nixl_read": 5.0}}
    assert f["breakdown_ms"]["decode: NIXL read"] == 5.0
    assert (
        f["breakdown_ms"]["decode: first step less the read (host-tier load, compute)"] == 5.0
    )  # the decode's first step less the read
    assert f["fixed_ttft_p50_s"] == 0.11
    assert f["compute_over_fixed"] == 5.18  # (0.68 - 0.11) / 0.11: a long prompt's compute over the fixed cost
    assert SideRun("bare", "slow", run.chat, run.prefix).compute_over_fixed() is None  # not probed
    broken = SideRun("bare", "slow", conversations({0: 1.0, 1: 1.0, 2: 1.0}, failed=1), Load("prefix", [], 1.0))
    assert broken.figures()["failed"] == 1 and broken.figures()["requests_per_s"] == 0.833  # 5 served in 6 s


def test_answers_are_compared_with_the_baseline_by_conversation_and_turn() -> None:
    baseline = conversations({0: 1, 1: 1, 2: 1})
    same = mismatches(conversations({0: 2, 1: 2, 2: 2}), baseline)
    assert (same.equal, same.wrong, same.near_ties, same.not_compared) == (6, [], [], 0)
    differs = mismatches(conversations({0: 2, 1: 2, 2: 2}, answer=[9]), baseline)
    assert differs.wrong == ["conversation 0 turn 1", "conversation 0 turn 2", "conversation 0 turn 3"]
    assert differs.equal == 3


def test_an_answer_that_parts_at_a_near_tie_is_not_wrong_and_its_later_turns_are_not_compared() -> None:
    """With a model whose KV, computed in other batches, differs from the baseline's in the last
    float32 bits, greedy decoding may pick the other of two tokens as likely within rounding."""
    msgs = [{"role": "user", "content": "hi"}]
    tops = [{5: -0.1, 6: -3.0}, {7: -0.6931, 8: -0.6935}, {9: -0.2, 4: -2.0}]
    base = [
        Turn(0.0, 0.1, None, 0, 0, msgs, [5, 7, 9], top=tops),
        Turn(1.0, 0.1, None, 0, 1, [*msgs, {"role": "assistant", "content": "a"}], [1], top=[{1: -0.1}]),
        Turn(0.0, 0.1, None, 1, 0, msgs, [5, 7, 9], top=tops),
    ]
    run = [
        Turn(0.0, 0.1, None, 0, 0, msgs, [5, 8, 3]),  # token 2: 8 for 7, 4e-4 nats apart: a near tie
        Turn(1.0, 0.1, None, 0, 1, [*msgs, {"role": "assistant", "content": "b"}], [2]),  # another prompt
        Turn(0.0, 0.1, None, 1, 0, msgs, [5, 7, 4]),  # token 3: 4 for 9, 1.8 nats apart: wrong
    ]
    got = mismatches(Load("chat", run, 1.0), Load("chat", base, 1.0))
    assert got.near_ties == ["conversation 0 turn 1 token 2 (4.0e-04 nats)"]
    assert got.wrong == ["conversation 1 turn 1"] and got.not_compared == 1 and got.equal == 0
    assert multi_turn.NEAR_TIE == 1e-3


def test_targets_are_the_slow_links_later_turns_and_requests_per_second(tmp_path: Path) -> None:
    ttft = {
        "bare": 1.0,
        "nixl-plugin": 0.9,
        "MultiConnector": 0.5,
        "kvcompose": 0.3,
        "kvcompose-first-wins": 0.6,
        MULTI_NATIVE: 0.5,
        NATIVE: 0.4,
    }
    wall = {s: 6.0 if s == "bare" else 3.0 for s in SIDES}
    done = {
        link: {s: [side(s, {0: 1.0, 1: ttft[s], 2: ttft[s]}, wall_s=wall[s])] for s in SIDES}
        for link in ("fast", "slow")
    }
    r = summarize(done, 1, False, tmp_path, {}, 60.0)
    assert r.target_met is True  # 0.3 <= 0.5 x bare, <= 0.8 x MultiConnector, turn 1 equal, 2x the requests/s
    later = [x for x in r.ratios if x.case == "slow link, turns 2+"]
    assert [(x.baseline, round(x.by_median, 2)) for x in later] == [
        ("bare", 0.3),
        ("nixl-plugin", 0.33),
        ("MultiConnector", 0.6),
        (MULTI_NATIVE, 0.8),
        ("bare", 0.4),
    ]
    assert r.config["ttft_by_turn"]["slow"]["kvcompose"] == [1.0, 0.3, 0.3]
    assert "token ids (a turn whose prompt is the baseline's): all equal" in r.table()
    slow = {**ttft, "kvcompose": 0.45}
    done["slow"] = {s: [side(s, {0: 1.0, 1: slow[s], 2: slow[s]}, wall_s=wall[s])] for s in SIDES}
    wrong = {"slow/kvcompose": [Answers(equal=5, wrong=["conversation 0 turn 2"])]}
    missed = summarize(done, 1, False, tmp_path, wrong, 60.0)
    assert missed.target_met is False
    assert "slow/kvcompose: 5 equal, 0 parted at a near tie (0 later turns not compared), 1 wrong" in missed.table()
    done["slow"] = {s: [side(s, {0: 1.0, 1: ttft[s], 2: ttft[s]}, wall_s=6.0)] for s in SIDES}
    assert summarize(done, 1, False, tmp_path, {}, 60.0).target_met is False  # requests/s only equal to bare's
    assert BENCHMARKS["multi-turn"] == "multi_turn" and "multi-turn" in FULL_ONLY


def test_an_ordering_is_claimed_only_where_every_run_lies_on_one_side_of_1(tmp_path: Path) -> None:
    assert ordering(Samples([0.4, 0.6, 0.9])) == "<" and ordering(Samples([1.1, 1.3])) == ">"
    assert ordering(Samples([0.8, 1.02])) == "undecided" and ordering(Samples([])) == "undecided"
    runs = {"kvcompose": [0.3, 0.5], "MultiConnector": [0.5, 0.45]}  # run 2: kvcompose slower
    done = {"slow": {s: [side(s, {0: 1.0, 1: t, 2: t}) for t in ts] for s, ts in runs.items()}}
    r = summarize(done, 2, False, tmp_path, {}, 1.0)
    assert r.config["orderings"]["slow link, turns 2+"] == {"kvcompose/MultiConnector": "undecided"}
    later = next(c for c in r.cases if c.label == "slow link, turns 2+")
    assert [round(v, 2) for v in later.derived["kvcompose/MultiConnector per run"].values] == [0.6, 1.11]
    assert "slow link, turns 2+: kvcompose/MultiConnector undecided" in r.table()


def test_the_breakdown_takes_the_nixl_read_out_of_the_decodes_first_step() -> None:
    decode = {
        "vllm:request_prefill_time_seconds_sum": 0.004,
        "vllm:request_prefill_time_seconds_count": 2.0,
        "vllm:nixl_xfer_time_seconds_sum": 0.01,  # more than the phase (a read before the step began)
        "vllm:nixl_xfer_time_seconds_count": 2.0,
        "vllm:request_decode_time_seconds_sum": 0.2,
        "vllm:request_decode_time_seconds_count": 2.0,
    }
    # One-token answers on the prefill: the decode phase's count moves, its sum stays 0.
    prefill = {"vllm:request_queue_time_seconds_sum": 0.02, "vllm:request_queue_time_seconds_count": 2}
    prefill["vllm:request_decode_time_seconds_count"] = 2.0
    parts = breakdown(
        {"vllm:request_queue_time_seconds_sum": 0.02, "vllm:request_queue_time_seconds_count": 2}, decode, 2
    )
    assert parts == {
        "prefill: queue": 10.0,
        "prefill: compute": 0.0,
        "decode: queue": 0.0,
        "decode: NIXL read": 2.0,
        "decode: first step less the read (host-tier load, compute)": 0.0,
        "decode: later tokens": 100.0,
    }


def test_the_png_is_ttft_by_turn_one_line_per_side(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from kvcompose_tools.bench.plot import draw

    done = {"slow": {s: [side(s, {0: 1.0, 1: 0.5, 2: 0.4})] for s in SIDES}}
    result = summarize(done, 1, False, tmp_path, {}, 1.0)
    assert set(result.config["breakdown_ms"]["slow"]) == set(SIDES)  # a stacked bar per side beside the lines
    assert result.config["compute_over_fixed"]["slow"]["bare"] == 5.18
    assert "a 700-token prompt's compute over the fixed cost" in result.table()
    path = draw(result, tmp_path)
    assert path.name == "multi_turn.png" and path.stat().st_size > 10_000


def test_vllm_p2p_is_vllms_offloading_connector_alone_with_a_p2p_tier_on_each_host(tmp_path: Path) -> None:
    """No kvcompose class and no MultiConnector: the name vLLM registers, vLLM's keys; the p2p
    tier's socket on each instance's host, the CPU tier the workload's host tier."""
    from kvcompose.units import ByteSize

    (p, p_env), (d, d_env) = specs(VLLM_P2P, "m", tmp_path, 5601, 5602, "10.0.0.2", "10.0.0.3")
    assert p_env == d_env == {} and p.composition is None and d.composition is None
    for spec, socket in ((p, ("10.0.0.2", 5601)), (d, ("10.0.0.3", 5602))):
        config = spec.kv_transfer_config()
        assert config is not None
        assert config["kv_connector"] == "OffloadingConnector" and config["kv_role"] == "kv_both"
        assert "kv_connector_module_path" not in config  # vLLM's own class
        extra = config["kv_connector_extra_config"]
        assert extra["secondary_tiers"] == [{"type": "p2p", "host": socket[0], "port": socket[1]}]
        assert extra["cpu_bytes_to_use"] == ByteSize.parse(WORKLOADS["tiny"].host_bytes)
        # vLLM's TieringOffloadingSpec (the portable subclass, which runs vLLM's worker on CUDA):
        # the only kvcompose name in the config, no composite, no kvcompose keys.
        assert (extra["spec_name"], extra["spec_module_path"]) == (
            "PortableTieringOffloadingSpec",
            "kvcompose_cpu_offload.native",
        )
        rest = json.dumps({**config, "kv_connector_extra_config": {**extra, "spec_module_path": None}})
        assert "kvcompose" not in rest and "MultiConnector" not in rest
    # The native decode example's load_failure, on the decode only.
    assert d.kv_transfer_config()["kv_load_failure_policy"] == "recompute"  # type: ignore[index]
    assert "kv_load_failure_policy" not in p.kv_transfer_config()  # type: ignore[operator]


def test_kvcompose_p2p_is_the_native_examples_host_tier_alone_with_a_keyed_p2p_tier(tmp_path: Path) -> None:
    import yaml

    (p, p_env), (d, d_env) = specs(P2P, "m", tmp_path, 5601, 5602, "10.0.0.2", "10.0.0.3", WORKLOADS["medium"])
    assert p_env == d_env == {}
    for spec, socket in ((p, ("10.0.0.2", 5601)), (d, ("10.0.0.3", 5602))):
        data = yaml.safe_load(Path(str(spec.composition)).read_text())
        (child,) = data["connectors"]  # no NIXL child: KV moves through the p2p tier only
        assert child["type"] == "native-offload" and child["options"]["cpu_bytes"] == "1GiB"
        assert child["options"]["tiers"] == [{"type": "p2p", "host": socket[0], "port": socket[1]}]
        # The examples' key: a role naming the other host is refused as ``peer`` unless signed.
        assert child["options"]["key_env"] == "KVCOMPOSE_PD_KEY"
        assert data["rules"]["load"] == "first-wins"
        config = spec.kv_transfer_config()
        assert config is not None
        (inner,) = config["kv_connector_extra_config"]["connectors"]
        assert inner["kv_connector_module_path"] == "kvcompose_cpu_offload.p2p"  # maps the router's protocol
        assert inner["kv_connector_extra_config"]["kvcompose_p2p_key_env"] == "KVCOMPOSE_PD_KEY"
    assert "load_failure: recompute" in Path(str(d.composition)).read_text()
    with pytest.raises(ValueError, match="p2p socket"):
        multi_turn.compositions(P2P, WORKLOADS["tiny"], tmp_path)


def test_the_p2p_sides_run_only_when_chosen_and_are_divided_by_vllm_p2p(tmp_path: Path) -> None:
    assert VLLM_P2P not in SIDES and P2P not in SIDES
    assert chosen_sides({SIDES_ENV: "vllm-p2p,kvcompose-p2p"}) == (VLLM_P2P, P2P)
    assert (NATIVE, VLLM_P2P) in PAIRS and (P2P, VLLM_P2P) in PAIRS
    ran = {NATIVE: 0.3, VLLM_P2P: 0.6, P2P: 0.45}
    done = {"slow": {s: [side(s, {0: 1.0, 1: t, 2: t})] for s, t in ran.items()}}
    done["slow"][VLLM_P2P][0].decode[NATIVE_LOADED_BYTES + "{transfer_type=CPU_to_GPU}"] = 60000.0
    done["slow"][VLLM_P2P][0].decode[multi_turn.TIER_READ_BYTES + "{tier=1:p2p}"] = 54000.0
    r = summarize(done, 1, False, tmp_path, {}, 1.0)
    later = {(x.subject, x.baseline): round(x.by_median, 2) for x in r.ratios if x.case == "slow link, turns 2+"}
    assert later == {(NATIVE, VLLM_P2P): 0.5, (P2P, VLLM_P2P): 0.75}
    table = r.table()
    assert "vllm-p2p: vLLM's OffloadingConnector alone on both" in table
    # Per request of 6: 6,000 B over NIXL, 60,000 B loaded, 54,000 B from the tier, 8,000 B received.
    assert "vllm-p2p NIXL 1000, offload 10000, tier 9000, link 1333" in table
    f = done["slow"][VLLM_P2P][0].figures()
    assert f["offload_load_bytes_per_request"] == {"prefill": 0, "decode": 10000}
    assert f["tier_bytes_per_request"] == {"prefill_write": 0, "decode_read": 9000}
    assert f["decode_link_rx_bytes_per_request"] == 1333 and f["p2p_hit_tokens"] == {"prefill": 0, "decode": 0}
