"""The composite declares each call of vLLM's connector API once (``kvcompose/vllm/forward.py``):
what the kit can fault, how the per-layer calls forward and what a contained child answers are read from
those declarations (the declarations against vLLM's own class: ``test_vllm_surface.py``)."""

from __future__ import annotations

import ast
import inspect

import pytest

from kvcompose.testing.types import Fault, fault_calls
from kvcompose.vllm import connector
from kvcompose.vllm.connector import KVComposeConnector
from kvcompose.vllm.forward import Call, Read, declared

CALLS = declared(KVComposeConnector)


def test_every_forwarded_call_can_get_a_fault_and_no_other() -> None:
    assert fault_calls() == {name for name, c in CALLS.items() if not isinstance(c, Read)}
    assert "get_finished" not in fault_calls()  # answered from get_transfer_results: a fault there never fires
    for name in fault_calls():
        Fault(call=name, action="raise")
    with pytest.raises(ValueError, match="'get_finished' is not a connector call"):
        Fault(call="get_finished", action="raise")


def test_vllms_two_per_layer_calls_are_plain_forwards() -> None:
    """The calls vLLM makes once per layer per step reach the children with no method of the
    composite's in between (one child: its own callable, ``test_worker_hot_path.py``)."""
    for name in ("wait_for_layer_load", "save_kv_layer"):
        assert CALLS[name].how == "each" and CALLS[name].method is None, name


def test_a_method_that_decides_gets_the_children_right_after_self() -> None:
    """A decorated method is the call's own: its second parameter is the children's callables."""
    for name, c in CALLS.items():
        if c.method is not None:
            params = list(inspect.signature(c.method).parameters)
            assert params[:2] == ["self", "children"], name
            assert c.method.__name__ == name, name


def test_no_call_is_looked_up_by_its_name_in_the_composite() -> None:
    """Each call is reached where it is declared: no ``x["a_call"]`` and no ``getattr(x, "a_call")``."""
    tree = ast.parse(inspect.getsource(connector))
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            assert node.slice.value not in CALLS, ast.unparse(node)
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "getattr":
            assert not any(isinstance(a, ast.Constant) and a.value in CALLS for a in node.args), ast.unparse(node)


def test_a_declaration_reads_as_itself_on_the_class_and_as_the_childrens_callables_on_an_instance(
    kvcompose_worker,  # type: ignore[no-untyped-def]
) -> None:
    conn = kvcompose_worker("version: 1\nconnectors: [{name: a, type: record}, {name: b, type: record}]\n").connector
    assert isinstance(KVComposeConnector.wait_for_save, Call)
    first = conn.wait_for_save
    assert conn.wait_for_save is first  # resolved once, kept in the instance
    conn.fanout.disable(0)
    assert conn.wait_for_save is not first  # resolved again without the bypassed child
