"""The cold-start benchmark's set-up, without engines: its compositions, its sides, its runner entry."""

from __future__ import annotations

import pytest

from kvcompose.compose import load
from kvcompose_tools.bench import cold_start
from kvcompose_tools.bench.runner import BENCHMARKS, FULL_ONLY


@pytest.mark.parametrize("mode", ["peer", "none"])
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_both_sides_run_the_example_with_the_error_handling_asked_for(role: str, mode: str) -> None:
    example = load(cold_start.EXAMPLES / f"pd-{role}.yaml")
    composite = cold_start.engine_spec("kvcompose", role, "model", 4321, mode)
    assert composite.composition == str(cold_start.EXAMPLES / f"pd-{role}.yaml")
    config = composite.kv_transfer_config()
    assert config is not None
    children = config["kv_connector_extra_config"]["connectors"]
    assert len(children) == len(example.children)
    (pd,) = [c for c in children if c["kv_connector"] == "NixlConnector"]
    alone = cold_start.engine_spec("NixlConnector", role, "model", 4321, mode).kv_transfer_config()
    assert alone is not None
    for extra in (pd["kv_connector_extra_config"], alone["kv_connector_extra_config"]):
        assert extra["kvcompose_ucx_error_handling"] == mode and extra["kvcompose_side_channel_port"] == 4321


def test_the_baseline_is_the_examples_nixl_child_alone() -> None:
    composite = cold_start.engine_spec("kvcompose", "decode", "model", 4321, "none").kv_transfer_config()
    alone = cold_start.engine_spec("NixlConnector", "decode", "model", 4321, "none").kv_transfer_config()
    assert composite is not None and alone is not None
    assert alone["kv_connector"] == "NixlConnector" and alone["kv_role"] == composite["kv_role"] == "kv_consumer"
    assert alone in composite["kv_connector_extra_config"]["connectors"]  # the same entry, nothing else
    with pytest.raises(ValueError, match="unknown side"):
        cold_start.engine_spec("nope", "decode", "model", 1, "none")


def test_it_starts_engines_so_quick_leaves_it_out() -> None:
    assert BENCHMARKS["cold-start"] == "cold_start" and "cold-start" in FULL_ONLY
