"""overload's engine-free parts: the sides' connector configs, the log lines it counts and
matches, its table and its target (no engines)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcompose_tools.bench import overload
from kvcompose_tools.bench.overload import (
    BASELINE,
    MULTI,
    NATIVE,
    SHORT,
    SIDES,
    SUBJECT,
    SideRun,
    Size,
    specs,
    summarize,
)
from kvcompose_tools.bench.runner import ACROSS_HOSTS, BENCHMARKS, FULL_ONLY
from kvcompose_tools.e2e.burst import Burst, LeaseLines, Outcome, lease_lines

PREFILL = "\n".join(
    [
        "INFO [pull_worker.py:700] Releasing expired KV blocks for request cmpl-a-0 which were retrieved by 0 ...",
        "ERROR [pull_worker.py:667] Potentially invalid KV blocks for unrecognized request cmpl-b-0 were retrieved",
        "ERROR [pull_worker.py:667] Potentially invalid KV blocks for unrecognized request cmpl-b-0 were retrieved",
        "ERROR [pull_worker.py:667] Potentially invalid KV blocks for unrecognized request cmpl-c-0 were retrieved",
        "ERROR [pull_worker.py:667] Potentially invalid KV blocks for unrecognized request cmpl-d-0 were retrieved",
    ]
)
DECODE = "\n".join(
    [
        "WARNING NIXL read refused: cmpl-x-0 (prefill request cmpl-b-0) ended 8.6 s after the prefill instance's",
        "INFO NIXL release without a read: cmpl-y-0 (prefill request cmpl-c-0)",
    ]
)


def test_a_refusal_accounts_for_two_late_read_lines_and_a_release_for_one() -> None:
    lines = lease_lines(PREFILL, DECODE)
    assert (lines.expiries, lines.late_reads, lines.refusals) == (1, 4, 1)
    assert lines.unmatched() == {"cmpl-d-0": 1}  # read after its lease, neither refused nor released
    assert lines.refused_while_held() == {"cmpl-b-0": 1}  # refused, its lease never expired
    assert lease_lines(PREFILL.replace("cmpl-a-0", "cmpl-b-0"), DECODE).refused_while_held() == {}
    assert lease_lines(PREFILL.replace("cmpl-d-0", "cmpl-b-0"), DECODE).unmatched() == {"cmpl-b-0": 1}


def test_a_request_is_answered_only_with_every_token() -> None:
    burst = Burst([Outcome(0, 0.1, 20.0, 300), Outcome(1, 0.1, 9.0, 0, "RuntimeError: HTTP 500"), Outcome(2)], 21.0)
    assert burst.answered == 1 and [o.index for o in burst.failed] == [1, 2]
    assert burst.longest_decode_s == 20.0


def test_vllms_side_is_the_class_vllm_registers_with_its_side_channel_in_its_env() -> None:
    (prefill, p_env), (decode, d_env) = specs(BASELINE, "m", (5600, 5601), SHORT, ("10.0.0.2", "10.0.0.3"))
    assert prefill.kv_config == {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"kv_lease_duration": SHORT.lease_s},
    }
    assert decode.kv_config is not None and decode.kv_config["kv_role"] == "kv_consumer"
    assert p_env == {"VLLM_NIXL_SIDE_CHANNEL_HOST": "10.0.0.2", "VLLM_NIXL_SIDE_CHANNEL_PORT": "5600"}
    assert d_env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.0.0.3"
    assert (prefill.num_gpu_blocks, decode.num_gpu_blocks) == (256, SHORT.decode_blocks)
    (full, _), _ = specs(BASELINE, "m", (5600, 5601), Size(1, 64, 8))
    assert full.kv_config == {"kv_connector": "NixlConnector", "kv_role": "kv_producer"}  # vLLM's own lease


def test_the_other_sides_carry_the_same_lease_to_their_nixl_child() -> None:
    (prefill, env), (decode, _) = specs(SUBJECT, "m", (5600, 5601), SHORT)
    assert env == {} and prefill.composition is not None and prefill.composition.endswith("pd-prefill.yaml")
    for spec in (prefill, decode):
        config = spec.kv_transfer_config()
        assert config is not None
        (nixl,) = [c for c in config["kv_connector_extra_config"]["connectors"] if c["kv_connector"] == "NixlConnector"]
        assert nixl["kv_connector_extra_config"]["kv_lease_duration"] == SHORT.lease_s
    (multi, _), _ = specs(MULTI, "m", (5600, 5601), SHORT)
    assert multi.kv_config is not None and "kv_connector_module_path" not in multi.kv_config
    assert multi.kv_config["kv_connector"] == "MultiConnector"
    (native_p, _), (native_d, _) = specs(NATIVE, "m", (5600, 5601), SHORT)
    assert str(native_p.composition).endswith("native-prefill.yaml")
    assert str(native_d.composition).endswith("native-decode.yaml")
    with pytest.raises(ValueError, match="unknown side 'nope'"):
        specs("nope", "m", (5600, 5601), SHORT)


def side(name: str, answered: int, failed: int, refused: int = 0) -> SideRun:
    outcomes = [Outcome(i, 0.1, 5.0 + i, 300) for i in range(answered)]
    outcomes += [Outcome(answered + i, 0.1, 9.0, 0, "RuntimeError: HTTP 500") for i in range(failed)]
    lines = LeaseLines()
    lines.refused.update(f"cmpl-{i}" for i in range(refused))
    return SideRun(name, Burst(outcomes, 30.0), lines)


def test_the_target_is_kvcompose_answering_as_many_as_vllms_connector(tmp_path: Path) -> None:
    done = {BASELINE: [side(BASELINE, 24, 0)], MULTI: [side(MULTI, 24, 0)], SUBJECT: [side(SUBJECT, 21, 3, 3)]}
    r = summarize(done, SHORT, 1, True, None, tmp_path)
    assert r.target_met is False
    assert [(x.subject, x.baseline, round(x.by_median, 3)) for x in r.ratios] == [
        (MULTI, BASELINE, 1.0),
        (SUBJECT, BASELINE, 0.875),
    ]
    table = r.table()
    assert "0.875 / 0.875 MISS" in table and "one host" in table
    (row,) = [line for line in table.splitlines() if "note: kvcompose " in line]
    assert row.split()[2:5] == ["21", "3", "25.0"]  # answered, failed, longest decode call
    done[SUBJECT] = [side(SUBJECT, 24, 0)]
    assert summarize(done, SHORT, 1, True, "800mbit", tmp_path).target_met is True


def test_no_ratio_over_a_baseline_that_answered_nothing(tmp_path: Path) -> None:
    r = summarize({BASELINE: [side(BASELINE, 0, 4)], SUBJECT: [side(SUBJECT, 4, 0)]}, SHORT, 1, True, None, tmp_path)
    assert r.ratios == [] and r.target_met is None


def test_it_is_an_engine_benchmark_that_runs_across_hosts_too() -> None:
    assert BENCHMARKS["overload"] == "overload" and "overload" in FULL_ONLY and "overload" in ACROSS_HOSTS
    assert SIDES[0] == BASELINE
    with pytest.raises(ValueError, match="unknown side"):
        overload.run(sides=("nope",))
