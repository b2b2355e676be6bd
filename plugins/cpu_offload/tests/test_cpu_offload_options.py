"""Options of the cpu-offload type: validation, vLLM keys, checks, descriptions, registration."""

from __future__ import annotations

import json
from importlib.metadata import entry_points
from typing import Any

import msgspec
import pluggy
import pytest

from kvcompose import NAME, hookspecs, units
from kvcompose.catalog import Child
from kvcompose.compose import loads
from kvcompose.config import dec_hook
from kvcompose.errors import CompositionError, Problem
from kvcompose_cpu_offload.plugin import CpuOffloadOptions, CpuOffloadType

GiB = 2**30


def child(options: dict[str, Any], index: int = 0) -> Child:
    """A resolved child, with options decoded the way kvcompose's loader decodes them."""
    opts = msgspec.convert(options, type=CpuOffloadOptions, dec_hook=dec_hook)
    return Child(index=index, name="host", type=CpuOffloadType(), role="both", options=opts)


def problems(options: dict[str, Any], index: int = 0) -> list[Problem]:
    c = child(options, index)
    return list(c.type.check(c, None))  # type: ignore[arg-type]  # the plan is not consulted


@pytest.mark.parametrize(
    ("options", "extra"),
    [
        ({}, {}),
        ({"backend": "cpu"}, {}),  # the default is left to vLLM
        (
            {"backend": "disk", "disk_path": "/d/kv"},
            {"kv_offload_backend": "disk", "disk_path": "/d/kv"},
        ),
        ({"cpu_bytes": "32GiB"}, {"cpu_bytes_to_use": 32 * GiB}),
        ({"cpu_bytes": 1 << 20}, {"cpu_bytes_to_use": 1 << 20}),
        ({"cpu_bytes_per_rank": "4GiB"}, {"cpu_bytes_to_use_per_rank": 4 * GiB}),
        ({"num_cpu_blocks": 1000}, {"num_cpu_blocks": 1000}),
        ({"lazy": True}, {"lazy_offload": True}),
        ({"lazy": False}, {}),
        (
            {"backend": "disk", "disk_path": "/d/kv", "disk_capacity": "200GB"},
            {
                "kv_offload_backend": "disk",
                "disk_path": "/d/kv",
                "disk_capacity_bytes": 200 * 10**9,
            },
        ),
        (
            {"backend": "disk", "disk_path": "/d/kv", "disk_buffer_slots": 4},
            {"kv_offload_backend": "disk", "disk_path": "/d/kv", "disk_buffer_slots": 4},
        ),
        (
            {"backend": "disk", "disk_path": "/d/kv", "use_page_cache": False},
            {"kv_offload_backend": "disk", "disk_path": "/d/kv", "use_page_cache": False},
        ),
    ],
)
def test_each_option_maps_to_its_vllm_key(options: dict[str, Any], extra: dict[str, Any]) -> None:
    c = child(options)
    cfg = c.vllm_config()
    assert cfg == {
        "kv_connector": "SimpleCPUOffloadConnector",
        "kv_connector_module_path": "kvcompose_cpu_offload.connector",
        "kv_connector_extra_config": extra,
        "kv_role": "kv_both",
    }
    # Sizes leave as plain ints: the config is rendered to JSON for vLLM's command line.
    assert all(type(v) in (int, bool, str) for v in cfg["kv_connector_extra_config"].values())
    json.dumps(cfg)


def test_every_field_has_a_vllm_key() -> None:
    assert set(CpuOffloadOptions.__struct_fields__) == set(CpuOffloadType.extra_config_keys)


def test_vllm_resolves_the_rendered_config_to_our_connector() -> None:
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvcompose_cpu_offload.connector import SimpleCPUOffloadConnector

    ktc = KVTransferConfig(**child({"cpu_bytes": "1GiB"}).vllm_config())
    assert KVConnectorFactory.get_connector_class(ktc) is SimpleCPUOffloadConnector
    # The literal name keeps vLLM's by-name checks working.
    assert ktc.has_connector("SimpleCPUOffloadConnector")


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"cpu_byte": "1GiB"}, "unknown field `cpu_byte`"),
        ({"backend": "ssd"}, "Invalid enum value 'ssd'"),
        ({"num_cpu_blocks": 0}, "Expected `int` >= 1"),
        ({"disk_buffer_slots": -1}, "Expected `int` >= 1"),
        ({"cpu_bytes": "lots"}, "expected a size"),
        ({"cpu_bytes": -5}, "cannot be negative"),
        ({"lazy": "yes"}, "Expected `bool`"),
    ],
)
def test_bad_options_are_rejected(options: dict[str, Any], match: str) -> None:
    with pytest.raises(msgspec.ValidationError, match=match):
        msgspec.convert(options, type=CpuOffloadOptions, dec_hook=dec_hook)


def test_disk_without_path_is_a_problem() -> None:
    (p,) = problems({"backend": "disk"}, index=2)
    assert p.path == ("connectors", 2, "options", "disk_path")
    assert "disk" in p.message and p.hint and "disk_path" in p.hint


@pytest.mark.parametrize("key", ["disk_path", "disk_capacity", "disk_buffer_slots", "use_page_cache"])
def test_disk_keys_under_cpu_are_problems(key: str) -> None:
    value = {
        "disk_path": "/d/kv",
        "disk_capacity": "1GiB",
        "disk_buffer_slots": 2,
        "use_page_cache": True,
    }[key]
    (p,) = problems({key: value}, index=1)
    assert p.path == ("connectors", 1, "options", key)
    assert p.hint == f"set backend: disk, or remove {key}"


@pytest.mark.parametrize("key", ["cpu_bytes", "cpu_bytes_per_rank", "num_cpu_blocks"])
def test_host_sizes_under_disk_are_problems(key: str) -> None:
    value = 8 if key == "num_cpu_blocks" else "1GiB"
    (p,) = problems({"backend": "disk", "disk_path": "/d/kv", key: value})
    assert p.path == ("connectors", 0, "options", key)


def test_competing_host_sizes_are_problems() -> None:
    found = problems({"num_cpu_blocks": 10, "cpu_bytes": "1GiB", "cpu_bytes_per_rank": "1GiB"})
    assert [p.path[-1] for p in found] == ["cpu_bytes", "cpu_bytes_per_rank"]
    (p,) = problems({"cpu_bytes": "2GiB", "cpu_bytes_per_rank": "1GiB"})
    assert p.path[-1] == "cpu_bytes"


def test_host_memory_beyond_this_machine_is_a_warning_naming_both_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(units, "host_memory", lambda: 16 * 2**30)
    (p,) = problems({"cpu_bytes_per_rank": "32GiB"})
    assert p.warning and p.path[-1] == "cpu_bytes_per_rank"
    assert "32GiB (34359738368 bytes) is more than this machine's memory, 16GiB (17179869184 bytes)" in p.message
    assert problems({"backend": "disk", "disk_path": "/d/kv", "disk_capacity": "1TiB"}) == []  # a disk is not memory


def test_zero_size_is_a_problem() -> None:
    (p,) = problems({"cpu_bytes": 0})
    assert p.path[-1] == "cpu_bytes" and "0 bytes" in p.message


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"cpu_bytes": "1GiB", "lazy": True},
        {"num_cpu_blocks": 5},
        {"backend": "disk", "disk_path": "/d/kv", "disk_capacity": "1TiB", "use_page_cache": True},
    ],
)
def test_valid_options_have_no_problems(options: dict[str, Any]) -> None:
    assert problems(options) == []


@pytest.mark.parametrize(
    ("options", "text"),
    [
        (
            {"cpu_bytes": "32GiB"},
            "keeps evicted prefix blocks in 32GiB of host memory and loads them back on a hit (eager offload)",
        ),
        (
            {"cpu_bytes_per_rank": "4GiB", "lazy": True},
            "keeps evicted prefix blocks in 4GiB per rank of host memory and loads them back on a hit (lazy offload)",
        ),
        ({"num_cpu_blocks": 512}, "in 512 KV blocks per rank of host memory"),
        ({}, "in 8GiB (vLLM's default) of host memory"),
        (
            {"backend": "disk", "disk_path": "/nvme/kv", "disk_capacity": "2TiB"},
            "keeps evicted prefix blocks in a 2TiB file per rank at /nvme/kv and loads them back "
            "on a hit (eager offload, O_DIRECT I/O)",
        ),
    ],
)
def test_describe(options: dict[str, Any], text: str) -> None:
    c = child(options)
    assert text in c.type.describe(c)


def test_registered_through_the_kvcompose_entry_point_group() -> None:
    (ep,) = [e for e in entry_points(group=NAME) if e.name == "cpu-offload"]
    assert ep.value == "kvcompose_cpu_offload.plugin"
    pm = pluggy.PluginManager(NAME)
    pm.add_hookspecs(hookspecs)
    pm.register(ep.load())
    (types,) = pm.hook.kvcompose_connector_types()
    assert [t.name for t in types] == ["cpu-offload", "native-offload"]
    t = types[0]
    assert isinstance(t, CpuOffloadType)
    assert t.options is CpuOffloadOptions


@pytest.mark.parametrize(("lazy", "which"), [(False, "every block a request computes"), (True, "the blocks it evicts")])
def test_the_tier_left_out_of_the_save_hooks_is_refused(lazy: bool, which: str) -> None:
    """Its scheduler's stores would never start, and their KV blocks never be freed (an engine
    with such a composition stopped answering once its KV cache was used up)."""
    text = (
        "version: 1\nconnectors:\n"
        f"  - {{name: host, type: cpu-offload, options: {{lazy: {str(lazy).lower()}}}}}\n"
        "  - {name: other, type: vllm, options: {kv_connector: ExampleConnector}}\n"
        "rules:\n  store: {use: only, children: [other]}\n"
    )
    with pytest.raises(CompositionError) as err:
        loads(text, filename="compose.yaml")
    [problem] = err.value.problems
    assert problem.path == ("rules", "store") and problem.line == 6
    assert "leaves host out of the save hooks, but it is vLLM's SimpleCPUOffloadConnector" in problem.message
    assert f"its scheduler plans a store of {which}" in problem.message
    assert loads(text.replace("children: [other]", "children: [host, other]")).store.targets == (0, 1)
