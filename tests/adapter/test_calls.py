"""Each engine call is written out in the composite (``kvcompose/vllm/connector.py``) as a loop
over the children ``kvcompose/vllm/calls.py`` names for it: what the kit can fault, which
children a call skips and why, and that a child's error reaches vLLM through the composite's own
method whatever the composition (the calls against vLLM's own class: ``test_vllm_surface.py``)."""

from __future__ import annotations

import inspect
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from vllm.config.kv_transfer import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, SupportsHMA

from kvcompose.plugins import get_plugins
from kvcompose.testing import inspector
from kvcompose.testing.bodies import check_empty_calls, has_empty_body
from kvcompose.testing.connectors import FaultInjected
from kvcompose.testing.types import Fault, fault_calls
from kvcompose.vllm.calls import (
    INHERITED_DEFAULT_DOES_NOTHING,
    MAY_BE_DECLARED_EMPTY,
    TO_EVERY_CHILD,
    Calls,
)
from kvcompose.vllm.connector import KVComposeConnector

Factory = Callable[..., Any]


def test_every_forwarded_call_can_get_a_fault_and_no_other() -> None:
    assert "get_finished" not in fault_calls()  # answered from get_transfer_results: a fault there never fires
    for name in fault_calls():
        Fault(call=name, action="raise")
    with pytest.raises(ValueError, match="'get_finished' is not a connector call"):
        Fault(call="get_finished", action="raise")


def test_each_forwarded_call_is_a_method_written_in_the_composite() -> None:
    """No call is made by a decorator or a descriptor: each is a plain function in the class body."""
    for name in fault_calls():
        fn = vars(KVComposeConnector)[name]
        assert inspect.isfunction(fn) and fn.__qualname__ == f"KVComposeConnector.{name}", name
        assert f"self._calls.{name}" in inspect.getsource(fn) or name in TO_EVERY_CHILD, name


def test_the_table_names_each_call_once_and_only_calls_of_vllms_base_class() -> None:
    names = [n for n in Calls.__annotations__ if n != "active"]
    assert len(names) == len(set(names))
    assert all(callable(getattr(KVConnectorBase_V1, n, getattr(SupportsHMA, n, None))) for n in names)


def _defaults() -> Iterator[str]:
    yield from sorted(INHERITED_DEFAULT_DOES_NOTHING)


@pytest.mark.parametrize("name", list(_defaults()))
def test_each_default_the_composite_skips_does_nothing_but_answer_what_the_loop_drops(name: str) -> None:
    base = getattr(KVConnectorBase_V1, name)
    if has_empty_body(base):
        return
    # A constant answer: called with anything, it answers "nothing" in the call's own terms.
    assert base(None, *[None] * (base.__code__.co_argcount - 1)) in (set(), False, ()), name


def _connector_classes() -> Iterator[tuple[Any, type]]:
    """Every installed connector type that declares empty calls, with each vLLM class it may name."""
    for t in get_plugins().connector_types.values():
        if not t.empty_calls:
            continue
        names = {t.vllm_connector}
        if t.name == "nixl":  # the push variant is another class
            from kvcompose_nixl.plugin import CONNECTOR_CLASS

            names |= set(CONNECTOR_CLASS.values())
        for name in sorted(names):
            ktc = KVTransferConfig(kv_connector=name, kv_role="kv_both", kv_connector_module_path=t.vllm_module_path)
            yield t, KVConnectorFactory.get_connector_class(ktc)


def test_each_plugins_empty_calls_are_empty_in_its_classes() -> None:
    seen = 0
    for t, cls in _connector_classes():
        check_empty_calls(type(t), cls)
        assert t.empty_calls <= MAY_BE_DECLARED_EMPTY, t.name  # a call whose None the composite drops
        seen += 1
    assert seen >= 3  # nixl pull and push, cpu-offload, native-offload


def test_a_declared_empty_call_that_has_a_body_is_named() -> None:
    class Declared:
        empty_calls = frozenset({"save_kv_layer"})

    class Saves:
        def save_kv_layer(self, layer: str) -> None:
            print(layer)

    with pytest.raises(AssertionError, match=r"\['save_kv_layer'\] are declared empty"):
        check_empty_calls(Declared, Saves)


TWO = """
version: 1
connectors:
  - name: a
    type: faulty
    options: {{faults: [{{call: wait_for_save, action: raise}}]}}
{second}"""


@pytest.mark.parametrize("second", ["", "  - {name: b, type: record}\n"])
def test_a_childs_error_reaches_vllm_through_the_composites_own_method(kvcompose_worker: Factory, second: str) -> None:
    """One child or two: the traceback shows the composite's method and its loop, then the child's."""
    conn = kvcompose_worker(TWO.format(second=second)).connector
    with pytest.raises(FaultInjected) as raised:
        conn.wait_for_save()
    frames = traceback.extract_tb(raised.value.__traceback__)[1:]  # [0] is this test
    ours = [f.name for f in frames if f.filename == inspect.getsourcefile(KVComposeConnector)]
    assert ours == ["wait_for_save", "_each"]  # the method, and the loop it hands the call to
    assert "/kvcompose/vllm/" not in frames[2].filename  # the child's own code, straight under it


def test_a_bypassed_child_is_left_out_of_every_call_and_let_back(kvcompose_worker: Factory) -> None:
    h = kvcompose_worker("version: 1\nconnectors: [{name: a, type: record}, {name: b, type: record}]\n")
    conn = h.connector
    inspector.bypass(conn, "a")
    assert inspector.bypassed(conn) == ("a",)
    before = len(inspector.child(conn, "a").called("wait_for_save"))
    conn.wait_for_save()
    assert len(inspector.child(conn, "a").called("wait_for_save")) == before
    assert len(inspector.child(conn, "b").called("wait_for_save")) == before + 1
    inspector.call_again(conn, "a")
    conn.wait_for_save()
    assert len(inspector.child(conn, "a").called("wait_for_save")) == before + 1


def _pass() -> None:
    pass


def _doc() -> None:
    """Only a docstring."""


def _ellipsis(*args: Any, **kwargs: Any) -> None: ...


def _bare_return(x: int) -> None:
    return


def _none() -> None:
    return None


def _zero() -> int:
    return 0


def _effect(log: list[int]) -> None:
    log.append(1)


def _generator() -> Iterator[int]:
    yield from ()


class _Child:
    def hook(self, layer: str) -> None:
        """Nothing to do per layer."""

    @staticmethod
    def static() -> None:
        pass


@pytest.mark.parametrize(
    "fn", [_pass, _doc, _ellipsis, _bare_return, _none, _Child().hook, _Child.static, lambda: None]
)
def test_functions_that_do_nothing_have_an_empty_body(fn: Callable[..., Any]) -> None:
    assert has_empty_body(fn)


@pytest.mark.parametrize("fn", [_zero, _effect, _generator, print, lambda: 0, None])
def test_functions_that_do_or_answer_something_have_a_body(fn: Callable[..., Any]) -> None:
    assert not has_empty_body(fn)
