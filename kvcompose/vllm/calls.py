"""Which children each engine call reaches: the composite's table of bound methods.

The composed connector (:class:`kvcompose.vllm.connector.KVComposeConnector`) writes each call of
vLLM's connector API out as a loop over ``self._calls.<call>``: ``(child index, child)`` pairs in
call order. :class:`Calls` is that table, made when the composite starts and
made again when a child is bypassed or let back (the faults rule). A child is left out of a call:

- while it is bypassed;
- when it lacks the call (a class written for an older vLLM lacks the sleep-mode calls);
- when the call goes to some children only: the save hooks to the store rule's targets, the
  host-buffer copy op to the one child that owns it;
- when it is known to do nothing there, so that its answer is one the loop drops: it inherits
  vLLM's default for a call in :data:`INHERITED_DEFAULT_DOES_NOTHING`, or its plugin declares the
  call in ``ConnectorType.empty_calls`` (one of :data:`MAY_BE_DECLARED_EMPTY`: the per-layer
  hooks, 32 calls a step on a 32-layer model, and the per-step hooks a connector leaves empty;
  docs/performance.md, worker step). Under ``KVCOMPOSE_TRACE`` every child gets every call,
  each traced.

``start_load_kv`` reaches the P/D transport first: its reads are in flight while the others copy.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Collection, Sequence
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

from kvcompose.catalog import Plan
from kvcompose.vllm.surface import provides

trace_log = logging.getLogger("kvcompose.trace")

#: ``(child index, the child)``, in call order: the loop calls the child's method by its name,
#: as vLLM's MultiConnector does (a patched instance is called as patched).
Pairs = tuple[tuple[int, Any], ...]

#: The calls whose vLLM default (``KVConnectorBase_V1``'s) does nothing and answers what the
#: composite's loop drops (``None``, an empty set, ``False``, ``()``): a child that inherits the
#: default is not called. ``tests/adapter/test_calls.py`` pins each default.
INHERITED_DEFAULT_DOES_NOTHING = frozenset(
    {
        "set_host_xfer_buffer_ops",
        "get_mem_pool_context",
        "finish_forward",
        "reset_capture_state",
        "handle_preemptions",
        "get_block_ids_with_load_errors",
        "get_kv_connector_stats",
        "get_kv_connector_kv_cache_events",
        "get_handshake_metadata",
        "build_connector_worker_meta",
        "bind_gpu_block_pool",
        "on_new_request",
        "register_finished_partial_tail",
        "has_pending_block_frees",
        "has_pending_push_work",
        "take_events",
        "update_connector_output",
    }
)

#: The calls a plugin may declare empty (``ConnectorType.empty_calls``): those whose ``None`` the
#: composite's loop drops (not ``get_finished_count``, whose children must agree).
MAY_BE_DECLARED_EMPTY = INHERITED_DEFAULT_DOES_NOTHING | {"wait_for_layer_load", "save_kv_layer"}

#: The calls that reach every child that has them, bypassed ones included (they still hold
#: registrations and threads), each whatever the others raised.
TO_EVERY_CHILD = ("shutdown", "unregister_kv_caches", "restore_kv_caches")


class Calls:
    """Each engine call's children, as ``(index, child)`` pairs (see the module's text).

    ``get_num_new_matched_tokens``, ``get_loaded_kv_cache_group_ids`` and
    ``get_external_cache_hit_sources`` are ``{index: child}`` maps: the load rule picks
    whom to ask, and every active child that has the call is in the map.
    """

    #: The children called now, in YAML order.
    active: tuple[int, ...]
    register_kv_caches: Pairs
    set_host_xfer_buffer_ops: Pairs
    get_mem_pool_context: Pairs
    bind_connector_metadata: Pairs
    clear_connector_metadata: Pairs
    handle_preemptions: Pairs
    start_load_kv: Pairs
    wait_for_layer_load: Pairs
    save_kv_layer: Pairs
    wait_for_save: Pairs
    finish_forward: Pairs
    reset_capture_state: Pairs
    get_transfer_results: Pairs
    get_block_ids_with_load_errors: Pairs
    get_kv_connector_stats: Pairs
    get_kv_connector_kv_cache_events: Pairs
    get_handshake_metadata: Pairs
    build_connector_worker_meta: Pairs
    bind_gpu_block_pool: Pairs
    bind_kv_cache_manager: Pairs
    on_new_request: Pairs
    get_num_new_matched_tokens: dict[int, Any]
    update_state_after_alloc: Pairs
    get_loaded_kv_cache_group_ids: dict[int, Any]
    get_external_cache_hit_sources: dict[int, Any]
    build_connector_meta: Pairs
    update_connector_output: Pairs
    request_finished: Pairs
    request_finished_all_groups: Pairs
    set_xfer_handshake_metadata_pp_aware: Pairs
    register_finished_partial_tail: Pairs
    has_pending_block_frees: Pairs
    has_pending_push_work: Pairs
    get_finished_count: Pairs
    reset_cache: Pairs
    take_events: Pairs

    def __init__(self, children: Sequence[KVConnectorBase_V1], plan: Plan, bypassed: Collection[int]) -> None:
        trace = plan.trace
        self.active = tuple(i for i in range(len(children)) if i not in bypassed)
        targets = frozenset(plan.store.targets)
        owner = plan.host_buffer_owner
        transport = plan.pd_transport
        pd_first = self.active
        if transport is not None and transport.index in self.active:
            pd_first = (transport.index, *(i for i in self.active if i != transport.index))

        def to(call: str, among: Collection[int] | None = None, order: Sequence[int] = self.active) -> Pairs:
            out = []
            for i in order:
                child = children[i]
                if among is not None and i not in among or not provides(child, call):
                    continue
                if not trace and _does_nothing(child, call, plan.children[i].type.empty_calls):
                    continue
                out.append((i, Traced(plan.names[i], child) if trace else child))
            return tuple(out)

        # ---- worker side
        self.register_kv_caches = to("register_kv_caches")
        self.set_host_xfer_buffer_ops = to("set_host_xfer_buffer_ops", () if owner is None else (owner,))
        self.get_mem_pool_context = to("get_mem_pool_context")
        self.bind_connector_metadata = to("bind_connector_metadata")
        self.clear_connector_metadata = to("clear_connector_metadata")
        self.handle_preemptions = to("handle_preemptions")
        self.start_load_kv = to("start_load_kv", order=pd_first)
        self.wait_for_layer_load = to("wait_for_layer_load")
        self.save_kv_layer = to("save_kv_layer", targets)
        self.wait_for_save = to("wait_for_save", targets)
        self.finish_forward = to("finish_forward")
        self.reset_capture_state = to("reset_capture_state")
        self.get_transfer_results = to("get_transfer_results")
        self.get_block_ids_with_load_errors = to("get_block_ids_with_load_errors")
        self.get_kv_connector_stats = to("get_kv_connector_stats")
        self.get_kv_connector_kv_cache_events = to("get_kv_connector_kv_cache_events")
        self.get_handshake_metadata = to("get_handshake_metadata")
        self.build_connector_worker_meta = to("build_connector_worker_meta")
        # ---- scheduler side
        self.bind_gpu_block_pool = to("bind_gpu_block_pool")
        self.bind_kv_cache_manager = to("bind_kv_cache_manager")
        self.on_new_request = to("on_new_request")
        self.get_num_new_matched_tokens = dict(to("get_num_new_matched_tokens"))
        self.update_state_after_alloc = to("update_state_after_alloc")
        self.get_loaded_kv_cache_group_ids = dict(to("get_loaded_kv_cache_group_ids"))
        self.get_external_cache_hit_sources = dict(to("get_external_cache_hit_sources"))
        self.build_connector_meta = to("build_connector_meta")
        self.update_connector_output = to("update_connector_output")
        self.request_finished = to("request_finished")
        self.request_finished_all_groups = to("request_finished_all_groups")
        self.set_xfer_handshake_metadata_pp_aware = to("set_xfer_handshake_metadata_pp_aware")
        self.register_finished_partial_tail = to("register_finished_partial_tail")
        self.has_pending_block_frees = to("has_pending_block_frees")
        self.has_pending_push_work = to("has_pending_push_work")
        self.get_finished_count = to("get_finished_count")
        self.reset_cache = to("reset_cache")
        self.take_events = to("take_events")


def _does_nothing(child: KVConnectorBase_V1, call: str, empty_calls: Collection[str]) -> bool:
    """Whether ``child`` is known to do nothing in ``call`` (see the module's text). An instance
    attribute (a test's patch) is the child's own answer."""
    if call in vars(child):
        return False
    if call in empty_calls and call in MAY_BE_DECLARED_EMPTY:
        return True
    default = getattr(KVConnectorBase_V1, call, None)  # a vLLM whose base class lacks the call: no default
    return call in INHERITED_DEFAULT_DOES_NOTHING and default is not None and getattr(type(child), call) is default


class Traced:
    """A child under ``KVCOMPOSE_TRACE``: each call it gets is logged with its answer."""

    def __init__(self, name: str, child: KVConnectorBase_V1) -> None:
        self._name = name
        self._child = child

    def __getattr__(self, call: str) -> Any:
        fn = getattr(self._child, call)
        if not callable(fn):
            return fn

        @functools.wraps(fn)
        def traced(*args: Any, **kwargs: Any) -> Any:
            result = fn(*args, **kwargs)
            trace_log.info("%s.%s -> %r", self._name, call, result)
            return result

        return traced
