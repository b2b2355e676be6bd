"""The native-offload type (vLLM's OffloadingConnector): vLLM's keys, the spec it names, the fs
tier, checks, descriptions, import from a MultiConnector config, and the examples that use it."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from kvcompose.catalog import Child
from kvcompose.compose import load, loads
from kvcompose.config import dec_hook
from kvcompose.errors import CompositionError, Problem
from kvcompose.examples import EXAMPLES
from kvcompose.vllm.args import kv_transfer_config
from kvcompose_cpu_offload.offloading_type import (
    CPU_SPEC,
    SPEC_MODULE,
    TIERING_SPEC,
    NativeOffloadOptions,
    NativeOffloadType,
)

MiB = 2**20


def child(options: dict[str, Any]) -> Child:
    opts = msgspec.convert(options, type=NativeOffloadOptions, dec_hook=dec_hook)
    return Child(index=0, name="host", type=NativeOffloadType(), role="both", options=opts)


def problems(options: dict[str, Any]) -> list[Problem]:
    c = child(options)
    return list(c.type.check(c, None))  # type: ignore[arg-type]  # the plan is not consulted


@pytest.mark.parametrize(
    ("options", "extra"),
    [
        ({"cpu_bytes": "256MiB"}, {"cpu_bytes_to_use": 256 * MiB}),
        ({"cpu_bytes": "1MiB", "eviction": "arc"}, {"cpu_bytes_to_use": MiB, "eviction_policy": "arc"}),
        ({"cpu_bytes": "1MiB", "block_size": 64}, {"cpu_bytes_to_use": MiB, "block_size": 64}),
        ({"cpu_bytes": "1MiB", "store_threshold": 2}, {"cpu_bytes_to_use": MiB, "store_threshold": 2}),
        ({"cpu_bytes": "1MiB", "prompt_only": False}, {"cpu_bytes_to_use": MiB, "offload_prompt_only": False}),
    ],
)
def test_options_render_as_vllms_keys_with_the_plugins_cpu_spec(options: dict[str, Any], extra: dict[str, Any]) -> None:
    c = child(options)
    assert c.vllm_config() == {
        "kv_connector": "OffloadingConnector",  # vLLM's class, no module path
        "kv_connector_extra_config": {**extra, "spec_name": CPU_SPEC, "spec_module_path": SPEC_MODULE},
        "kv_role": "kv_both",
    }


def test_a_disk_dir_puts_vllms_fs_tier_behind_host_memory() -> None:
    cfg = child({"cpu_bytes": "1MiB", "disk_dir": "/mnt/kv", "disk_threads": 4}).vllm_config()
    extra = cfg["kv_connector_extra_config"]
    assert extra["spec_name"] == TIERING_SPEC and extra["spec_module_path"] == SPEC_MODULE
    assert extra["secondary_tiers"] == [
        {"type": "fs", "root_dir": "/mnt/kv", "n_read_threads": 4, "n_write_threads": 4}
    ]


def test_the_spec_names_resolve_in_the_plugins_module() -> None:
    """What vLLM's factory imports (``spec_module_path`` + ``spec_name``) exists and is an
    ``OffloadingSpec`` (``vllm/v1/kv_offload/factory.py``)."""
    import importlib

    from vllm.v1.kv_offload.base import OffloadingSpec

    module = importlib.import_module(SPEC_MODULE)
    for name in (CPU_SPEC, TIERING_SPEC):
        assert issubclass(getattr(module, name), OffloadingSpec), name


def test_checks_name_the_option_to_change() -> None:
    (zero,) = problems({"cpu_bytes": 0})
    assert zero.path[-1] == "cpu_bytes" and not zero.warning
    (threads,) = problems({"cpu_bytes": "1MiB", "disk_threads": 2})
    assert threads.path[-1] == "disk_threads" and "disk_dir" in threads.message
    assert problems({"cpu_bytes": "1MiB", "disk_dir": "/d", "disk_threads": 2}) == []


def test_cpu_bytes_is_required_and_eviction_is_vllms_choice_of_two() -> None:
    base = "version: 1\nconnectors:\n  - name: host\n    type: native-offload\n"
    with pytest.raises(CompositionError, match="cpu_bytes"):
        loads(base + "    options: {}\n", filename="x.yaml")
    with pytest.raises(CompositionError, match="eviction"):
        loads(base + "    options: {cpu_bytes: 1MiB, eviction: fifo}\n", filename="x.yaml")


def test_describe_says_one_fact_a_line() -> None:
    lines = child({"cpu_bytes": "256MiB", "disk_dir": "/mnt/kv"}).type.describe(
        child({"cpu_bytes": "256MiB", "disk_dir": "/mnt/kv"})
    )
    assert lines.splitlines()[0].startswith("keeps prefix blocks in 256MiB of host memory")
    assert "then tier 1, fs: block files in /mnt/kv" in lines


def test_an_existing_offloadingconnector_entry_is_not_taken_as_this_type() -> None:
    """``kvcompose import`` keeps it ``type: vllm``: rendered as written, with vLLM's spec."""
    entry = {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"cpu_bytes_to_use": MiB}}
    assert NativeOffloadType().options_from_vllm(entry) is None


@pytest.mark.parametrize("name", ["native-decode.yaml", "native-prefill.yaml"])
def test_the_native_examples_check_and_render(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCOMPOSE_PD_KEY", "k" * 40)
    plan = load(EXAMPLES / name)
    cfg = kv_transfer_config(plan)
    host = cfg["kv_connector_extra_config"]["connectors"][0]
    assert host["kv_connector"] == "OffloadingConnector" and host["kv_role"] == "kv_both"
    assert [c.type.name for c in plan.children] == ["native-offload", "nixl"]
