"""A MultiConnector config taken as it is: no ``kvcompose`` entry, only vLLM's ``connectors`` list.

Built in vLLM's real scheduler: the composite composes the listed children with kvcompose's
defaults, kvcompose's own types standing in for NIXL and the CPU tier, and says so in one line.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from kvcompose.testing.harness import connector_entry, make_request, multiconnector_config, scheduler_for
from kvcompose.vllm.connector import KVComposeConnector


def dropin(disk: Path, role: str = "kv_consumer") -> dict[str, Any]:
    """vLLM's documented MultiConnector shape (docs/features/disagg_prefill.md), pointed at kvcompose."""
    nixl = connector_entry("NixlConnector", role)
    nixl["kv_buffer_device"] = "cpu"
    return multiconnector_config(
        connector_entry("SimpleCPUOffloadConnector", cpu_bytes_to_use=1 << 24),
        connector_entry("ExampleConnector", shared_storage_path=str(disk)),
        nixl,
        connector_entry("ExampleConnector", shared_storage_path=str(disk / "2")),
        kv_role=role,
    )


def test_a_multiconnector_config_without_a_kvcompose_entry_is_composed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The line goes to vLLM's log, which may not propagate to the root (where caplog listens).
    vllm_log = logging.getLogger("vllm")
    if not vllm_log.propagate:
        vllm_log.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="vllm.kvcompose"):
            scheduler = scheduler_for(dropin(tmp_path), block_size=32)
    finally:
        vllm_log.removeHandler(caplog.handler)
    composite = scheduler.connector
    assert isinstance(composite, KVComposeConnector)
    assert composite.names == ("simple-cpu-offload", "example", "nixl", "example-2")
    # kvcompose's own types where they apply: its CPU-offload and NIXL subclasses, vLLM's ExampleConnector as is
    classes = [f"{type(c).__module__}.{type(c).__name__}" for c in composite.sub_connectors]
    assert classes == [
        "kvcompose_cpu_offload.connector.SimpleCPUOffloadConnector",
        "vllm.distributed.kv_transfer.kv_connector.v1.example_connector.ExampleConnector",
        "kvcompose_nixl.connector.NixlConnector",
        "vllm.distributed.kv_transfer.kv_connector.v1.example_connector.ExampleConnector",
    ]
    plan = composite.plan
    assert [c.type.name for c in plan.children] == ["cpu-offload", "vllm", "nixl", "vllm"]
    assert [plan.rules[k].name for k in ("load", "store", "metadata")] == ["first-wins", "all", "merge"]
    lines = [r.getMessage() for r in caplog.records if "taken as it is" in r.getMessage()]
    assert lines == [
        "kvcompose: MultiConnector config taken as it is (no 'kvcompose' entry), composed with kvcompose's defaults "
        "(load: first-wins in list order, store: all, metadata: merge): simple-cpu-offload (cpu-offload, both), "
        "example (vllm ExampleConnector, both), nixl (nixl, consumer), example-2 (vllm ExampleConnector, both); "
        "`kvcompose import` writes it as YAML"
    ]


def test_a_dropin_composite_serves_requests(tmp_path: Path) -> None:
    scheduler = scheduler_for(dropin(tmp_path / "serve"), block_size=32)
    request = make_request(num_tokens=96, block_size=32)
    scheduler.add_request(request)
    out = scheduler.schedule()  # every child asked in list order, none holds the prompt
    assert out.num_scheduled_tokens[request.request_id] == 96


def test_a_dropin_that_breaks_a_rule_says_which_entry(tmp_path: Path) -> None:
    cfg = dropin(tmp_path)
    cfg["kv_connector_extra_config"]["connectors"][3] = {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}
    where = r"<MultiConnector connectors>: connectors\[3\].type: "
    with pytest.raises(Exception, match=where + "nixl-2 and nixl both are P/D transports"):
        scheduler_for(cfg, block_size=32)
