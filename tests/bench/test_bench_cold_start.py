"""The cold-start benchmark's set-up, without engines: its compositions, its sides, its runner entry."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcompose.bench import cold_start
from kvcompose.bench.runner import BENCHMARKS, FULL_ONLY
from kvcompose.compose import load


@pytest.mark.parametrize("mode", ["peer", "none"])
def test_compositions_are_the_examples_with_the_error_handling_asked_for(tmp_path: Path, mode: str) -> None:
    files = cold_start.compositions(tmp_path, mode)
    for role, path in files.items():
        plan = load(path)
        (pd,) = [c for c in plan.children if c.name == "pd"]
        assert pd.vllm_config()["kv_connector_extra_config"]["kvcompose_ucx_error_handling"] == mode
        example = load(cold_start.EXAMPLES / f"pd-{role}.yaml")
        assert [c.name for c in plan.children] == [c.name for c in example.children]


def test_the_baseline_is_the_examples_nixl_child_alone_on_its_own_port(tmp_path: Path) -> None:
    files = cold_start.compositions(tmp_path, "none")
    composite = cold_start.engine_spec("kvcompose", "decode", files["decode"], "model", 4321)
    alone = cold_start.engine_spec("NixlConnector", "decode", files["decode"], "model", 4321).kv_transfer_config()
    assert composite.composition == str(files["decode"]) and composite.side_channel_port == 4321
    assert alone is not None and alone["kv_connector"] == "NixlConnector" and alone["kv_role"] == "kv_consumer"
    extra = alone["kv_connector_extra_config"]
    assert extra["kvcompose_side_channel_port"] == 4321 and extra["kvcompose_ucx_error_handling"] == "none"


def test_it_starts_engines_so_quick_leaves_it_out() -> None:
    assert BENCHMARKS["cold-start"] == "cold_start" and "cold-start" in FULL_ONLY
