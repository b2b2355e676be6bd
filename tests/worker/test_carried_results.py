"""Transfer-result fields kvcompose does not know are carried through, merged by type.

vLLM's main branch already adds fields to ``KVConnectorTransferResults`` (for instance
``prefix_replay_checkpoints``, a dict). A synthetic newer class stands in for such a vLLM: the
composite reads the fields of whatever class vLLM has, hands the ones it knows to the completion
rule and carries the others, each child's value merged by :func:`kvcompose.merge.merge_values`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from kvcompose.testing import inspector
from kvcompose.vllm import metadata

Factory = Callable[..., Any]

TWO = """
version: 1
connectors:
  - {name: a, type: record}
  - {name: b, type: record}
"""


@dataclass
class NewerResults(KVConnectorTransferResults):
    """A newer vLLM's results: fields of each kind the merge rule distinguishes."""

    prefix_replay_checkpoints: dict[str, int] = field(default_factory=dict)
    replayed_blocks: set[int] = field(default_factory=set)
    notes: list[str] = field(default_factory=list)
    replayed_tokens: int = 0
    degraded: bool = False
    source: str | None = None


@pytest.fixture
def newer_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    """The composite built after this sees vLLM's results class as :class:`NewerResults`."""
    monkeypatch.setattr(metadata, "RESULTS_CODEC", metadata.ResultsCodec(NewerResults))


def test_the_codec_knows_the_rules_fields_and_carries_the_rest() -> None:
    codec = metadata.ResultsCodec(NewerResults)
    assert codec.known == ("finished_sending", "finished_recving", "failed_recving")
    assert codec.carried == (
        "prefix_replay_checkpoints",
        "replayed_blocks",
        "notes",
        "replayed_tokens",
        "degraded",
        "source",
    )


@pytest.mark.usefixtures("newer_vllm")
def test_fields_kvcompose_does_not_know_reach_vllm_merged_by_type(kvcompose_worker: Factory) -> None:
    conn = kvcompose_worker(TWO, register=False).connector
    inspector.child(conn, "a").results = NewerResults(
        prefix_replay_checkpoints={"r1": 16, "r2": 32}, replayed_blocks={1}, notes=["a"], replayed_tokens=16
    )
    inspector.child(conn, "b").results = NewerResults(
        prefix_replay_checkpoints={"r1": 8},
        replayed_blocks={2},
        notes=["b"],
        replayed_tokens=8,
        degraded=True,
        source="b",
    )
    out = conn.get_transfer_results(set())
    assert isinstance(out, NewerResults)
    assert dataclasses.asdict(out) == {
        "finished_sending": set(),
        "finished_recving": set(),
        "failed_recving": set(),
        "prefix_replay_checkpoints": {"r1": 24, "r2": 32},
        "replayed_blocks": {1, 2},
        "notes": ["a", "b"],
        "replayed_tokens": 24,
        "degraded": True,
        "source": "b",
    }


@pytest.mark.usefixtures("newer_vllm")
def test_a_step_with_nothing_to_report_is_vllms_empty_report(kvcompose_worker: Factory) -> None:
    conn = kvcompose_worker(TWO, register=False).connector
    out = conn.get_transfer_results(set())
    assert dataclasses.asdict(out) == dataclasses.asdict(NewerResults())


@pytest.mark.usefixtures("newer_vllm")
def test_one_child_reporting_a_field_is_that_childs_value(kvcompose_worker: Factory) -> None:
    conn = kvcompose_worker(TWO, register=False).connector
    checkpoints = {"r1": 16}
    inspector.child(conn, "b").results = NewerResults(prefix_replay_checkpoints=checkpoints)
    assert conn.get_transfer_results(set()).prefix_replay_checkpoints == checkpoints
