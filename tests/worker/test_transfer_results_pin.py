"""Pins :class:`kvcompose.contract.TransferResults` to vLLM's ``KVConnectorTransferResults``.

The rules see a child's report as kvcompose's own class (so they stay testable without vLLM);
the adapter copies the fields both have by name, with the same default shape and type. A field
only vLLM's class has (a newer vLLM added it) is carried through, merged by type
(tests/worker/test_carried_results.py), never dropped.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from kvcompose.contract import TransferResults
from kvcompose.vllm.metadata import RESULTS_CODEC as RESULTS

VLLM_FIELDS = {f.name: f for f in dataclasses.fields(KVConnectorTransferResults)}
OUR_FIELDS = {f.name: f for f in dataclasses.fields(TransferResults)}
#: The fields the rules read: both classes have them.
SHARED = sorted(set(VLLM_FIELDS) & set(OUR_FIELDS))


def default_of(f: dataclasses.Field[Any]) -> tuple[str, Any]:
    """How a field gets its default: ``("factory", value)``, ``("value", value)`` or ``("required", None)``."""
    if f.default_factory is not dataclasses.MISSING:
        return "factory", f.default_factory()
    if f.default is not dataclasses.MISSING:
        return "value", f.default
    return "required", None


def test_vllm_still_has_transfer_results_fields() -> None:
    # If vLLM renames or drops the class's fields, this pin would hold vacuously.
    assert dataclasses.is_dataclass(KVConnectorTransferResults)
    assert {"finished_sending", "finished_recving", "failed_recving"} <= set(VLLM_FIELDS)


@pytest.mark.parametrize("name", sorted(VLLM_FIELDS))
def test_every_vllm_field_is_read_by_the_rules_or_carried(name: str) -> None:
    assert (name in RESULTS.known) != (name in RESULTS.carried)
    assert (name in RESULTS.known) == (name in OUR_FIELDS)


@pytest.mark.parametrize("name", SHARED)
def test_every_shared_field_has_the_same_default_shape_in_ours(name: str) -> None:
    theirs_kind, theirs = default_of(VLLM_FIELDS[name])
    ours_kind, ours = default_of(OUR_FIELDS[name])
    assert ours_kind == theirs_kind
    assert type(ours) is type(theirs) and ours == theirs


@pytest.mark.parametrize("name", SHARED)
def test_every_shared_field_has_the_same_type_in_ours(name: str) -> None:
    theirs = typing.get_type_hints(KVConnectorTransferResults)[name]
    ours = typing.get_type_hints(TransferResults)[name]
    assert ours == theirs


def test_defaults_are_not_shared_between_instances() -> None:
    for cls in (KVConnectorTransferResults, TransferResults):
        one, two = cls(), cls()
        for name in SHARED:
            assert getattr(one, name) is not getattr(two, name), f"{cls.__name__}.{name}"


def test_the_adapter_copies_every_vllm_field() -> None:
    assert set(RESULTS.known + RESULTS.carried) == set(VLLM_FIELDS)


def test_a_report_round_trips_through_ours_field_by_field() -> None:
    values = {name: {f"{name}-1", f"{name}-2"} for name in SHARED}
    theirs = KVConnectorTransferResults(**values)
    ours = RESULTS.read(theirs)
    assert ours is not None
    for name, value in values.items():
        assert getattr(ours, name) == value
        assert getattr(ours, name) is not getattr(theirs, name)  # a copy: the rules may change it
    back = RESULTS.write(ours)
    assert isinstance(back, KVConnectorTransferResults)
    assert dataclasses.asdict(back) == dataclasses.asdict(theirs)


def test_an_empty_report_is_none_and_empty_ours_is_an_empty_vllm_report() -> None:
    assert RESULTS.read(None) is None
    assert RESULTS.read(KVConnectorTransferResults()) is None
    assert dataclasses.asdict(RESULTS.write(TransferResults())) == dataclasses.asdict(KVConnectorTransferResults())
