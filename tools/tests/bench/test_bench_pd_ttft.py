"""The engine TTFT benchmark's set-up, without engines: its sides, its lock, its place in the runner."""

from __future__ import annotations

import fcntl
import subprocess
import sys
from pathlib import Path

import pytest

from kvcompose_tools.bench import pd_ttft


def test_the_baseline_is_the_composites_own_nixl_child_alone(tmp_path: Path) -> None:
    """Same connector class, module path and options as the composite's ``pd`` child: only the
    composite (and the host tier) differs between the two engines."""
    from kvcompose_tools.e2e.spec import composed_kv_transfer_config

    composite = pd_ttft.engine_spec("kvcompose", "model", tmp_path, 4321).kv_transfer_config()
    alone = pd_ttft.engine_spec("NixlConnector", "model", tmp_path, 4321).kv_transfer_config()
    assert composite == composed_kv_transfer_config(tmp_path / "kvcompose" / "pd-both.yaml")
    assert composite is not None and alone is not None
    assert alone["kv_connector"] == "NixlConnector" and alone["kv_role"] == composite["kv_role"] == "kv_both"
    assert {**alone, "kv_role": "kv_both"} in [
        {**c, "kv_role": "kv_both"} for c in composite["kv_connector_extra_config"]["connectors"]
    ]
    assert alone["kv_connector_extra_config"]["kvcompose_side_channel_port"] == 4321
    assert alone["kv_connector_extra_config"]["kvcompose_progress_delay_us"] > 0  # same NIXL agent settings
    # Every decode pulls from one prefill engine, which runs the baseline's connector.
    prefill = pd_ttft.engine_spec("prefill", "model", tmp_path, 4321).kv_transfer_config()
    assert prefill == alone
    assert (
        pd_ttft.DECODES
        == (pd_ttft.BASELINE, pd_ttft.SUBJECT, pd_ttft.MULTI)
        == ("NixlConnector", "kvcompose", "MultiConnector")
    )
    with pytest.raises(ValueError, match="unknown side"):
        pd_ttft.engine_spec("nope", "model", tmp_path, 1)


def test_over_the_starts_every_decode_engine_takes_every_place_equally_often() -> None:
    """The place an engine draws in the launch order and the turn cycle outweighs its connector on
    this host, so a run's starts give every engine every place, each as often."""
    assert pd_ttft.STARTS % len(pd_ttft.DECODES) == 0
    orders = [pd_ttft.start_order(s) for s in range(pd_ttft.STARTS)]
    for place in range(len(pd_ttft.DECODES)):
        assert sorted(order[place] for order in orders) == sorted(pd_ttft.DECODES) * (
            pd_ttft.STARTS // len(pd_ttft.DECODES)
        )


def test_engine_lock_is_taken_unless_the_process_already_holds_it(tmp_path: Path) -> None:
    lock = str(tmp_path / "engines.lock")
    with pd_ttft.engine_lock(lock, echo=lambda _: None):
        with open(lock) as other, pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held while engines run
    with open(lock) as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released after
    # Under `flock FILE cmd` the child has the file open already and must not wait for itself.
    code = (
        f"from kvcompose_tools.bench import pd_ttft\nwith pd_ttft.engine_lock({lock!r}, echo=print): print('inside')\n"
    )
    out = subprocess.run(["flock", lock, sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "inside", out.stderr


def test_quick_runs_leave_the_engine_benchmark_out() -> None:
    from kvcompose_tools.bench.runner import BENCHMARKS, FULL_ONLY

    assert BENCHMARKS["pd-ttft"] == "pd_ttft" and "pd-ttft" in FULL_ONLY


def test_the_multiconnector_side_is_vllms_own_class_over_the_composites_children(tmp_path: Path) -> None:
    """vLLM loads its own MultiConnector (no kvcompose module path, no composition) over the very
    child entries the composite gets, in the same order, with the same role."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    composite = pd_ttft.engine_spec("kvcompose", "model", tmp_path, 4321).kv_transfer_config()
    multi = pd_ttft.engine_spec("MultiConnector", "model", tmp_path, 4321).kv_transfer_config()
    assert composite is not None and multi is not None
    assert "kv_connector_module_path" not in multi and "kvcompose" not in multi["kv_connector_extra_config"]
    assert multi["kv_connector_extra_config"]["connectors"] == composite["kv_connector_extra_config"]["connectors"]
    assert multi["kv_role"] == composite["kv_role"]
    assert KVConnectorFactory.get_connector_class(KVTransferConfig(**multi)) is MultiConnector
