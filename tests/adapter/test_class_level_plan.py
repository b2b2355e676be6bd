"""vLLM asks some connector questions of the class, before any instance exists; the composite
answers them from the one plan per config that its instances use (``kvcompose.vllm.children``).

``requires_piecewise_for_cudagraph`` is given the ``kv_connector_extra_config`` alone (no role,
no engine id): it reads the plan this process built for that config, and builds none of its own
once an instance's plan exists.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector

from kvcompose.compose import loads
from kvcompose.vllm import children
from kvcompose.vllm.args import kv_transfer_config

#: Two children as vLLM's own MultiConnector takes them (a drop-in), roles left out.
DROPIN = {
    "connectors": [
        {"kv_connector": "ExampleConnector", "kv_connector_extra_config": {"shared_storage_path": path}}
        for path in ("/tmp/kv-a", "/tmp/kv-b")
    ]
}


def rendered() -> dict[str, Any]:
    """The ``kv_connector_extra_config`` that ``kvcompose vllm-args`` renders of the same two
    children (``type: vllm``), as vLLM parses it."""
    children_ = [{"name": f"disk-{i}", "type": "vllm", "options": c} for i, c in enumerate(DROPIN["connectors"])]
    composition = loads(json.dumps({"version": 1, "connectors": children_}), filename="two.yaml")
    config = json.loads(json.dumps(kv_transfer_config(composition)))
    return config["kv_connector_extra_config"]  # type: ignore[no-any-return]


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """Every plan built from here on (the process's plans forgotten first)."""
    built: list[Any] = []
    build = children.build
    monkeypatch.setattr(children, "_plans", {})
    monkeypatch.setattr(children, "_composites", {})
    monkeypatch.setattr(children, "build", lambda *a, **k: built.append(a) or build(*a, **k))
    # Only disk-b needs piecewise CUDA graphs: each child is asked with its own extra config.
    monkeypatch.setattr(
        ExampleConnector,
        "requires_piecewise_for_cudagraph",
        classmethod(lambda cls, extra: extra.get("shared_storage_path") == "/tmp/kv-b"),
    )
    yield built


@pytest.mark.parametrize("extra", [rendered(), DROPIN], ids=["rendered", "drop-in"])
def test_the_class_level_question_reads_the_instances_plan(extra: dict[str, Any], builds: list[Any]) -> None:
    first = children.composite_of(extra, "kv_both", "engine-a")
    assert children.requires_piecewise_for_cudagraph(extra) is True
    assert len(builds) == 1
    other = children.composite_of(extra, "kv_both", "engine-b")  # another engine id: the same plan
    assert len(builds) == 1 and other.plan is first.plan
    assert [c.engine_id for c in other.configs] == ["engine-b", "engine-b"]
    assert [c.engine_id for c in first.configs] == ["engine-a", "engine-a"]


@pytest.mark.parametrize("extra", [rendered(), DROPIN], ids=["rendered", "drop-in"])
def test_asked_first_the_class_level_question_builds_the_plan_once(extra: dict[str, Any], builds: list[Any]) -> None:
    assert children.requires_piecewise_for_cudagraph(extra) is True
    assert children.requires_piecewise_for_cudagraph(extra) is True
    assert len(builds) == 1


def test_a_dropins_children_take_the_composites_role(builds: list[Any]) -> None:
    """A drop-in's entries leave their roles out: its plan is the role's own."""
    assert [c.kv_role for c in children.composite_of(DROPIN, "kv_producer").configs] == ["kv_producer"] * 2
    assert [c.kv_role for c in children.composite_of(DROPIN, "kv_consumer").configs] == ["kv_consumer"] * 2
    assert len(builds) == 2
