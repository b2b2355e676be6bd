"""The call table (``kvcompose/vllm/calls.py``) drives the composite's forwarding and the kit's
fault injection: each forwarded call is dispatched by the idiom its combination names, and each
one can get an injected fault. Read from the composite's source, without importing vLLM (the
table is importable without it: ``tests/unit/test_contract.py``; the table against vLLM's own
class: ``tests/adapter/test_vllm_surface.py``)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kvcompose.rules.faults import NEUTRAL
from kvcompose.testing.types import FAULT_CALLS, Fault
from kvcompose.vllm import calls
from kvcompose.vllm.calls import CALLS, FORWARDED

CONNECTOR = Path(calls.__file__).with_name("connector.py")

#: The composite's three dispatch idioms, by the expression they subscript with a call's name.
IDIOMS = {"self.calls": "calls[m]", "self.calls.combined": "calls.combined[m]", "self._per_layer": "calls.per_layer[m]"}


def idiom_of(combine: str) -> str:
    if combine in ("each", "rule"):
        return "calls[m]"
    return "calls.per_layer[m]" if combine == "per-layer" else "calls.combined[m]"


def dispatched() -> dict[str, set[str]]:
    """Per call name, the idioms by which the composite's methods dispatch it."""
    tree = ast.parse(CONNECTOR.read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "KVComposeConnector"]
    out: dict[str, set[str]] = {}
    for node in ast.walk(cls):
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value in CALLS:
            idiom = IDIOMS.get(ast.unparse(node.value))
            assert idiom is not None, f"{ast.unparse(node)}: not one of the composite's three idioms"
            out.setdefault(node.slice.value, set()).add(idiom)
    return out


def test_every_forwarded_call_is_dispatched_by_the_idiom_its_combination_names() -> None:
    found = dispatched()
    forwarded = {name for name, c in CALLS.items() if c.forwarded}
    assert set(found) == forwarded, sorted(set(found) ^ forwarded)
    assert {name: found[name] for name in forwarded} == {name: {idiom_of(CALLS[name].combine)} for name in forwarded}


def test_a_call_the_composite_answers_from_another_names_a_forwarded_one() -> None:
    for name, c in CALLS.items():
        assert (c.combine == "via") == (c.via is not None), name
        if c.via is not None:
            assert CALLS[c.via].forwarded, name


def test_every_answer_shape_has_a_neutral_answer() -> None:
    assert {c.answer for c in CALLS.values()} <= set(NEUTRAL)


def test_every_forwarded_call_can_get_a_fault_and_no_other() -> None:
    assert FAULT_CALLS == FORWARDED
    assert "get_finished" not in FAULT_CALLS  # answered from get_transfer_results: a fault there never fires
    for name in FORWARDED:
        Fault(call=name, action="raise")
    with pytest.raises(ValueError, match="'get_finished' is not a connector call"):
        Fault(call="get_finished", action="raise")
