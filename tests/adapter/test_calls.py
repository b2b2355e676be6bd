"""Each engine call is written out in the composite (``kvcompose/vllm/connector.py``) as a loop
over the children ``kvcompose/vllm/calls.py`` names for it: what the kit can fault, which
children a call skips and why, and that a child's error reaches vLLM through the composite's own
method whatever the composition (the calls against vLLM's own class: ``test_vllm_surface.py``)."""

from __future__ import annotations

import inspect
import traceback
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest
from vllm.config.kv_transfer import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    SupportsHMA,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput

from kvcompose.plugins import get_plugins
from kvcompose.testing import inspector
from kvcompose.testing.bodies import check_empty_calls, has_empty_body
from kvcompose.testing.connectors import FaultInjected
from kvcompose.testing.harness import make_request
from kvcompose.testing.types import Fault, fault_calls
from kvcompose.vllm.calls import (
    INHERITED_DEFAULT_DOES_NOTHING,
    MAY_BE_DECLARED_EMPTY,
    TO_EVERY_CHILD,
    Calls,
)
from kvcompose.vllm.connector import KVComposeConnector
from kvcompose.vllm.metadata import ComposedHandshakeMetadata

if TYPE_CHECKING:
    from kvcompose.testing.worker import WorkerHarness

Factory = Callable[..., Any]


def test_every_forwarded_call_can_get_a_fault_and_no_other() -> None:
    assert "get_finished" not in fault_calls()  # answered from get_transfer_results: a fault there never fires
    for name in fault_calls():
        Fault(call=name, action="raise")
    with pytest.raises(ValueError, match="'get_finished' is not a connector call"):
        Fault(call="get_finished", action="raise")


#: Two recording children: ``a`` a P/D transport, the owner of vLLM's host-buffer copy op; ``b``
#: the one with a hit, so the loader of a request looked up.
PAIR = """
version: 1
connectors:
  - {name: a, type: record-pd}
  - {name: b, type: record, options: {matched_tokens: 32}}
"""

#: The children a call reaches in PAIR other than both: the owner of the host buffer, the loader.
REACHES = {
    "set_host_xfer_buffer_ops": ("a",),
    "get_loaded_kv_cache_group_ids": ("b",),
    "get_external_cache_hit_sources": ("b",),
}


def _as_vllm_calls(h: WorkerHarness) -> dict[str, Callable[[], Any]]:
    """Each forwarded call, made on the composite of its role with arguments as vLLM passes them."""
    w, sched = h.connector, h.scheduler
    s = sched.connector
    meta, layer = h.idle_metadata(), h.layer_names[0]
    req, looked_up = make_request(64), make_request(64)
    s.get_num_new_matched_tokens(looked_up, 0)  # b has a hit: it loads this request
    handshakes = {(0, 0): ComposedHandshakeMetadata({n: KVConnectorHandshakeMetadata() for n in s.names})}
    return {
        "register_kv_caches": lambda: w.register_kv_caches(h.kv_caches),
        "set_host_xfer_buffer_ops": lambda: w.set_host_xfer_buffer_ops(lambda *blocks: None),
        "get_mem_pool_context": lambda: w.get_mem_pool_context(),
        "bind_connector_metadata": lambda: w.bind_connector_metadata(meta),
        "clear_connector_metadata": lambda: w.clear_connector_metadata(),
        "handle_preemptions": lambda: w.handle_preemptions(meta),
        "start_load_kv": lambda: w.start_load_kv(None),
        "wait_for_layer_load": lambda: w.wait_for_layer_load(layer),
        "save_kv_layer": lambda: w.save_kv_layer(layer, h.kv_caches[layer], None),
        "wait_for_save": lambda: w.wait_for_save(),
        "finish_forward": lambda: w.finish_forward(),
        "reset_capture_state": lambda: w.reset_capture_state(),
        "get_transfer_results": lambda: w.get_transfer_results(set()),
        "get_block_ids_with_load_errors": lambda: w.get_block_ids_with_load_errors(),
        "get_kv_connector_stats": lambda: w.get_kv_connector_stats(),
        "get_kv_connector_kv_cache_events": lambda: w.get_kv_connector_kv_cache_events(),
        "get_handshake_metadata": lambda: w.get_handshake_metadata(),
        "build_connector_worker_meta": lambda: w.build_connector_worker_meta(),
        "get_finished_count": lambda: w.get_finished_count(),
        "shutdown": lambda: w.shutdown(),
        "unregister_kv_caches": lambda: w.unregister_kv_caches(),
        "restore_kv_caches": lambda: w.restore_kv_caches(),
        "bind_gpu_block_pool": lambda: s.bind_gpu_block_pool(sched.kv_cache_manager.block_pool),
        "bind_kv_cache_manager": lambda: s.bind_kv_cache_manager(sched.kv_cache_manager),
        "on_new_request": lambda: s.on_new_request(req),
        "get_num_new_matched_tokens": lambda: s.get_num_new_matched_tokens(req, 0),
        "update_state_after_alloc": lambda: s.update_state_after_alloc(
            req, sched.kv_cache_manager.empty_kv_cache_blocks, 0
        ),
        "get_loaded_kv_cache_group_ids": lambda: s.get_loaded_kv_cache_group_ids(looked_up),
        "get_external_cache_hit_sources": lambda: s.get_external_cache_hit_sources(looked_up, 32),
        "build_connector_meta": lambda: s.build_connector_meta(SchedulerOutput.make_empty()),
        "update_connector_output": lambda: s.update_connector_output(KVConnectorOutput()),
        "request_finished": lambda: s.request_finished(req, []),
        "request_finished_all_groups": lambda: s.request_finished_all_groups(req, ([],)),
        "set_xfer_handshake_metadata_pp_aware": lambda: s.set_xfer_handshake_metadata_pp_aware(handshakes),
        "register_finished_partial_tail": lambda: s.register_finished_partial_tail(req, ([],), [(0, 0, 16)]),
        "has_pending_block_frees": lambda: s.has_pending_block_frees(),
        "has_pending_push_work": lambda: s.has_pending_push_work(),
        "reset_cache": lambda: s.reset_cache(),
        "take_events": lambda: s.take_events(),
    }


def _note_each_child(h: WorkerHarness, call: str) -> list[str]:
    """Patch ``call`` on every child of both roles to note the child's name and then answer as it
    would; the composites' tables are made again (a patch is the child's own answer, never
    skipped). Returns the names noted, in call order."""
    noted: list[str] = []
    for conn in (h.connector, h.scheduler.connector):
        for name in conn.names:
            child = inspector.child(conn, name)
            own = getattr(child, call, None)
            if own is None:
                continue

            def noting(*args: Any, _name: str = name, _own: Callable[..., Any] = own, **kwargs: Any) -> Any:
                noted.append(_name)
                return _own(*args, **kwargs)

            setattr(child, call, noting)
            inspector.call_again(conn, name)
    return noted


def test_the_calls_made_here_are_every_forwarded_call(kvcompose_worker: Factory) -> None:
    assert set(_as_vllm_calls(kvcompose_worker(PAIR))) == fault_calls()


def _forwarded_calls() -> Iterator[Any]:
    """Each forwarded call; one the composite takes with other arguments than vLLM passes fails here
    (``register_finished_partial_tail`` took ``(request)`` where vLLM passes three arguments)."""
    yield from sorted(fault_calls())


@pytest.mark.parametrize("bypassed", [None, "a"])
@pytest.mark.parametrize("name", list(_forwarded_calls()))
def test_each_forwarded_call_is_a_loop_in_the_composite_over_the_children_it_reaches(
    kvcompose_worker: Factory, name: str, bypassed: str | None
) -> None:
    """A plain function in the class body (no decorator, no descriptor) that calls each child the
    table names for the call, a bypassed one only where the call reaches every child."""
    fn = vars(KVComposeConnector)[name]
    assert inspect.isfunction(fn) and fn.__qualname__ == f"KVComposeConnector.{name}", name
    h = kvcompose_worker(PAIR)
    call = _as_vllm_calls(h)[name]
    noted = _note_each_child(h, name)
    if bypassed is not None:
        inspector.bypass(h.connector, bypassed)
        inspector.bypass(h.scheduler.connector, bypassed)
    call()
    reaches = REACHES.get(name, ("a", "b"))
    if name not in TO_EVERY_CHILD:
        reaches = tuple(n for n in reaches if n != bypassed)
    assert tuple(noted) == reaches


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
    seen: set[tuple[str, str]] = set()
    for t, cls in _connector_classes():
        check_empty_calls(type(t), cls)
        assert t.empty_calls <= MAY_BE_DECLARED_EMPTY, t.name  # a call whose None the composite drops
        seen.add((t.name, cls.__name__))
    assert seen == {
        ("nixl", "NixlConnector"),  # pull
        ("nixl", "NixlPushConnector"),
        ("cpu-offload", "SimpleCPUOffloadConnector"),
        ("native-offload", "OffloadingConnector"),
    }


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
