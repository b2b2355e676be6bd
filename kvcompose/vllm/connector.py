"""The composed connector that vLLM loads as its own.

vLLM looks for the literal name ``MultiConnector`` and its ``connectors`` list in about ten places
(HMA resolution, CPU-offload block alignment, the CPU platform's NIXL layout, ...), and
``kv_connector_module_path`` wins over vLLM's registry. So ``kvcompose vllm-args`` renders::

    {"kv_connector": "MultiConnector",
     "kv_connector_module_path": "kvcompose.vllm.connector",
     "kv_connector_extra_config": {"connectors": [child configs], "kvcompose": {composition}}}

and this module exports :class:`KVComposeConnector` under both names. The plan decides every
composition rule; this class only forwards vLLM's calls to the children along it.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
from vllm.config import VllmConfig
from vllm.config.kv_transfer import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    CopyBlocksOp,
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
    supports_hma,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.outputs import KVConnectorOutput

from kvcompose.compose import Plan, build
from kvcompose.config import from_builtins
from kvcompose.rules.completion import ChildResults
from kvcompose.rules.load import Selection
from kvcompose.rules.metadata import Merge
from kvcompose.vllm.loadstats import STATS_KEY, ChildLoadPromMetrics, ChildLoadStats
from kvcompose.vllm.metadata import (
    ComposedHandshakeMetadata,
    ComposedKVEvents,
    ComposedMetadata,
    ComposedStats,
    ComposedWorkerMetadata,
    _qualname,
)

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVCacheEvent, KVConnectorKVEvents
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
    from vllm.v1.request import Request

log = logging.getLogger("kvcompose.vllm")
trace_log = logging.getLogger("kvcompose.trace")

EXTRA_KEY = "kvcompose"

#: Hooks whose base-class implementation does nothing or returns a constant (``None``,
#: ``False``, an empty set or tuple) that the composite's combination of answers ignores. A
#: child that inherits one of them unchanged is not called: its answer is known, and these hooks
#: run on every step (worker) or for every request (scheduler). MultiConnector calls them all.
_CONSTANT_IN_BASE = frozenset({
    # worker, every step
    "get_kv_connector_stats", "get_kv_connector_kv_cache_events", "build_connector_worker_meta",
    "get_block_ids_with_load_errors", "finish_forward", "reset_capture_state",
    # scheduler, every step or request
    "on_new_request", "take_events", "has_pending_block_frees", "register_finished_partial_tail",
})


#: The empty ``load_owners`` / ``saves_owed`` of a step's metadata. Never written to: the
#: scheduler half adds to dicts of its own and ships this one only when those are empty.
_NOTHING: dict[str, Any] = {}


class ChildFailed(RuntimeError):
    """A child connector raised; names the child and the engine call."""


# ------------------------------------------------------------------ config helpers (no instance)


def plan_from_config(ktc: KVTransferConfig) -> Plan:
    """Rebuild the plan from the composition embedded in vLLM's ``kv_connector_extra_config``."""
    data = (ktc.kv_connector_extra_config or {}).get(EXTRA_KEY)
    if data is None:
        raise ValueError(
            "kv_connector_extra_config has no 'kvcompose' entry: start vLLM with the arguments "
            "that `kvcompose vllm-args FILE` prints"
        )
    return build(from_builtins(data["composition"], data.get("source", "<kv_connector_extra_config>")))


def child_configs(ktc: KVTransferConfig) -> list[KVTransferConfig]:
    """Each child's own ``KVTransferConfig``; a child may carry its own ``engine_id``.

    vLLM's MultiConnector passes ``engine_id`` twice when a child sets it (a TypeError); merging
    the dicts lets the child's value win.
    """
    entries = (ktc.kv_connector_extra_config or {}).get("connectors") or []
    return [KVTransferConfig(**{"engine_id": ktc.engine_id, **entry}) for entry in entries]


def _child_vllm_configs(vllm_config: VllmConfig) -> list[tuple[type[KVConnectorBase_V1], VllmConfig]]:
    assert vllm_config.kv_transfer_config is not None
    out = []
    for cktc in child_configs(vllm_config.kv_transfer_config):
        cfg = copy.copy(vllm_config)
        cfg.kv_transfer_config = cktc
        out.append((KVConnectorFactory.get_connector_class(cktc), cfg))
    return out


class _Resolved(dict):  # type: ignore[type-arg]
    """method name -> ``[(child index, callable), ...]``, resolved on first use.

    A plain subscription on the hot path (no method call); the resolver runs only on a miss.
    Lazy rather than at construction so that a child patched before its first call (tests do
    this) is seen.
    """

    def __init__(self, resolve: Callable[[str], list[tuple[int, Callable[..., Any]]]]) -> None:
        super().__init__()
        self._resolve = resolve

    def __missing__(self, method: str) -> list[tuple[int, Callable[..., Any]]]:
        fns = self[method] = self._resolve(method)
        return fns


class KVComposeConnector(KVConnectorBase_V1, SupportsHMA):
    """Children and rules from a kvcompose composition, behind vLLM's connector interface.

    The class is ``SupportsHMA`` (vLLM tests that on the class); effective HMA support is that of
    every child, which vLLM's config resolution computes from the ``connectors`` list.
    """

    # ------------------------------------------------------------------ construction

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: "KVCacheConfig") -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        assert ktc is not None
        self.plan = plan_from_config(ktc)
        classes = _child_vllm_configs(vllm_config)
        if len(classes) != len(self.plan.children):
            raise ValueError(
                f"kv_connector_extra_config lists {len(classes)} connectors but the composition has "
                f"{len(self.plan.children)}; regenerate the arguments with `kvcompose vllm-args`"
            )
        #: The children in YAML order. vLLM's workers look for ``_connectors`` by name.
        self._connectors: list[KVConnectorBase_V1] = [cls(cfg, role, kv_cache_config) for cls, cfg in classes]
        self.names: tuple[str, ...] = self.plan.names
        self._all_hma = all(supports_hma(c) for c in self._connectors)
        self._qualnames = {n: _qualname(type(c)) for n, c in zip(self.names, self._connectors)}
        self._pack = self.plan.metadata.pack
        self._unpack_children = self.plan.metadata.unpack
        self._tracker = self.plan.completion()
        self._disabled: set[int] = set()
        self._orphaned: set[str] = set()  # loads owed by a disabled child, to report failed
        # Scheduler side.
        # (child, is_async) decided by the load rule, kept until the request ends.
        self._load_owner: dict[str, tuple[int, bool]] = {}
        self._pending_loads: dict[str, int] = {}  # async loads vLLM waits for
        self._new_owners: dict[str, int] = {}  # to ship in the next metadata
        self._new_saves: dict[str, tuple[int, ...]] = {}
        self._worker_events: dict[str, list[KVCacheEvent]] = {}
        self.dropped_completions = 0
        # Which child served each load, reported with the stats (kvcompose.vllm.loadstats).
        self._load_stats = ChildLoadStats()
        self._loads_counted = False  # anything in _load_stats since the last report (a flag: asked every step)
        self._looked_up: set[str] = set()
        self._rebind()

    def _rebind(self) -> None:
        """Resolve per-step call lists once (and again when a best-effort child is disabled)."""
        active = [i for i in range(len(self._connectors)) if i not in self._disabled]
        self._active = active
        self._stores = [i for i in self.plan.store_targets if i not in self._disabled]
        self._save_layer = [self._call(i, "save_kv_layer") for i in self._stores]
        self._wait_save = [self._call(i, "wait_for_save") for i in self._stores]
        self._wait_layer = [self._call(i, "wait_for_layer_load") for i in active]
        self._start_load = [self._call(i, "start_load_kv") for i in active]
        #: Per method, the active children's callables (see :meth:`_resolve`).
        self._bound = _Resolved(self._resolve)
        # Per step, on every child (None where disabled): the metadata keeps one slot per child.
        self._build_meta = [(name, None if i in self._disabled else c.build_connector_meta)
                            for i, (name, c) in enumerate(zip(self.names, self._connectors))]
        # The built-in merge rule's pack is dict(zip(names, metas)) after a length check that
        # holds by construction here: build that dict in place (no list, zip or call per step).
        metadata_rule = self.plan.metadata
        self._merge_in_place = type(metadata_rule) is Merge and metadata_rule.names == self.names

    def _call(self, i: int, method: str) -> Callable[..., Any]:
        """Child ``i``'s bound method, wrapped only when tracing or fault isolation asks for it."""
        fn = getattr(self._connectors[i], method)
        if self.plan.trace:
            inner, name = fn, self.names[i]

            def fn(*a: Any, **kw: Any) -> Any:
                result = inner(*a, **kw)
                trace_log.info("%s.%s -> %r", name, method, result)
                return result

        if i in self.plan.best_effort:
            return self._guarded(i, method, fn)
        return fn

    def _guarded(self, i: int, method: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def guarded(*a: Any, **kw: Any) -> Any:
            if i in self._disabled:
                return None
            try:
                return fn(*a, **kw)
            except Exception:
                log.exception("best-effort connector %s failed in %s; it is disabled from now on",
                              self.names[i], method)
                self._disable(i)
                return None

        return guarded

    def _disable(self, i: int) -> None:
        self._disabled.add(i)
        # Loads it owed will never complete: report them failed so vLLM recomputes.
        self._orphaned |= {r for r, o in self._tracker.load_owner.items() if o == i}
        self._rebind()

    def _resolve(self, method: str) -> list[tuple[int, Callable[..., Any]]]:
        """``(child index, callable)`` for ``method`` on every active child that needs the call.

        Filled into ``self._bound`` once per method: resolving (getattr, the trace and fault
        wrappers) per call instead would cost more than vLLM's MultiConnector spends per
        request (see docs/performance.md).
        """
        return [(i, self._call(i, method)) for i in self._active if not self._inherits_constant(i, method)]

    def _inherits_constant(self, i: int, method: str) -> bool:
        """Whether child ``i`` answers ``method`` with the base class's constant (so needs no call).

        Not while tracing, which logs every child call.
        """
        if method not in _CONSTANT_IN_BASE or self.plan.trace:
            return False
        # The bound method's function, so that an instance attribute (a test's patch) counts as
        # the child's own. Not ``vars(child)``: materialising an instance's ``__dict__`` makes
        # every later attribute read on it ~3x slower (CPython 3.11+ inline values).
        fn = getattr(self._connectors[i], method)
        return getattr(fn, "__func__", None) is getattr(KVConnectorBase_V1, method)

    def _each(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``method`` on every active child, in YAML order."""
        return [fn(*args, **kwargs) for _, fn in self._bound[method]]

    @property
    def sub_connectors(self) -> list[KVConnectorBase_V1]:
        return list(self._connectors)

    def child(self, name: str) -> KVConnectorBase_V1:
        """The child connector instance for a composition name."""
        return self._connectors[self.names.index(name)]

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        return all(c.supports_divergent_local_hybrid_hits for c in self._connectors)

    @property
    def requires_kv_delivery(self) -> bool:
        return any(c.requires_kv_delivery for c in self._connectors)

    # ------------------------------------------------------------------ class-level answers

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        layouts: dict[str, str] = {}
        assert vllm_config.kv_transfer_config is not None
        names = [c["name"] for c in (vllm_config.kv_transfer_config.kv_connector_extra_config or {})
                 .get(EXTRA_KEY, {}).get("composition", {}).get("connectors", [])]
        for i, (child_cls, cfg) in enumerate(_child_vllm_configs(vllm_config)):
            layout = child_cls.get_required_kvcache_layout(cfg)
            if layout is not None:
                layouts[names[i] if i < len(names) else child_cls.__name__] = layout
        if len(set(layouts.values())) > 1:
            raise ValueError("children need different KV cache layouts: "
                             + ", ".join(f"{n}={l}" for n, l in layouts.items()))
        return next(iter(layouts.values()), None)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        for entry in extra_config.get("connectors", []):
            child_cls = KVConnectorFactory.get_connector_class(KVTransferConfig(**entry))
            if child_cls.requires_piecewise_for_cudagraph(entry.get("kv_connector_extra_config", {})):
                return True
        return False

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return ComposedStats() if data is None else ComposedStats.from_dict(data)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        by_class: dict[str, KVConnectorPromMetrics] = {}
        for child_cls, cfg in _child_vllm_configs(vllm_config):
            key = _qualname(child_cls)
            if key in by_class:
                continue  # one metric family per class: a second registration would clash
            prom = child_cls.build_prom_metrics(cfg, metric_types, labelnames, per_engine_labelvalues)
            if prom is not None:
                by_class[key] = prom
        by_class[_qualname(ChildLoadStats)] = ChildLoadPromMetrics(vllm_config, metric_types, labelnames,
                                                                   per_engine_labelvalues)
        return ComposedPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues, by_class)

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._each("register_kv_caches", kv_caches)

    def set_host_xfer_buffer_ops(self, copy_operation: CopyBlocksOp) -> None:
        owner = self.plan.host_buffer_owner
        if owner is not None and owner not in self._disabled:
            self._call(owner, "set_host_xfer_buffer_ops")(copy_operation)

    def get_mem_pool_context(self) -> AbstractContextManager | None:
        found = [(self.names[i], ctx) for i in self._active
                 if (ctx := self._connectors[i].get_mem_pool_context()) is not None]
        if len(found) > 1:
            raise ValueError(f"children {[n for n, _ in found]} each provide a KV cache memory pool; "
                             "the KV cache lives in one pool, so at most one child may")
        return found[0][1] if found else None

    def _unpack(self, metadata: KVConnectorMetadata) -> list[KVConnectorMetadata]:
        if not isinstance(metadata, ComposedMetadata):
            raise TypeError(f"expected kvcompose metadata, got {type(metadata).__name__}; "
                            "were the scheduler and workers started from different configs?")
        return self.plan.metadata.unpack(metadata.children)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        if not isinstance(connector_metadata, ComposedMetadata):
            self._unpack(connector_metadata)  # raises the explanatory TypeError
        assert isinstance(connector_metadata, ComposedMetadata)
        metas = self._unpack_children(connector_metadata.children)
        if connector_metadata.load_owners:  # most steps start no load and end no request
            for req, child in connector_metadata.load_owners.items():
                self._tracker.expect_load(req, child)
        if connector_metadata.saves_owed:
            for req, children in connector_metadata.saves_owed.items():
                self._tracker.expect_saves(req, children)
        for i, fn in self._bound["bind_connector_metadata"]:
            fn(metas[i])
        self._connector_metadata = connector_metadata  # what the base class's bind does

    def clear_connector_metadata(self) -> None:
        for _, fn in self._bound["clear_connector_metadata"]:
            fn()
        self._connector_metadata = None  # what the base class's clear does

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        metas = self._unpack(kv_connector_metadata)
        for i in self._active:
            self._call(i, "handle_preemptions")(metas[i])

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        if kwargs:
            for fn in self._start_load:
                fn(forward_context, **kwargs)
        else:  # vLLM passes none: a call without ``**{}`` is cheaper, and this runs every step
            for fn in self._start_load:
                fn(forward_context)

    def wait_for_layer_load(self, layer_name: str) -> None:
        for fn in self._wait_layer:
            fn(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: "AttentionMetadata",
                      **kwargs: Any) -> None:
        if kwargs:
            for fn in self._save_layer:
                fn(layer_name, kv_layer, attn_metadata, **kwargs)
        else:  # per layer per step: a call without ``**{}`` is cheaper
            for fn in self._save_layer:
                fn(layer_name, kv_layer, attn_metadata)

    def wait_for_save(self) -> None:
        for fn in self._wait_save:
            fn()

    def finish_forward(self) -> None:
        self._each("finish_forward")

    def reset_capture_state(self) -> None:
        self._each("reset_capture_state")

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        res = self.get_transfer_results(finished_req_ids)
        return res.finished_sending or None, res.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        per_child: list[ChildResults] | None = None  # built on the first report: most steps have none
        for i, fn in self._bound["get_transfer_results"]:
            r = fn(finished_req_ids)
            if r is not None and (r.finished_sending or r.finished_recving or r.failed_recving):
                if per_child is None:
                    per_child = [ChildResults() for _ in self._connectors]
                per_child[i] = ChildResults(set(r.finished_sending), set(r.finished_recving), set(r.failed_recving))
        if per_child is None:
            if not self._orphaned:
                return KVConnectorTransferResults()  # nothing to settle
            per_child = [ChildResults() for _ in self._connectors]
        if self._orphaned:
            for req in self._orphaned:
                owner = self._tracker.load_owner.get(req)
                if owner is not None:
                    per_child[owner].finished_recving.add(req)
                    per_child[owner].failed_recving.add(req)
            self._orphaned = set()
        out = self._tracker.settle(per_child)
        self.dropped_completions += out.dropped
        return KVConnectorTransferResults(out.finished_sending, out.finished_recving, out.failed_recving)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors: set[int] = set()
        for _, fn in self._bound["get_block_ids_with_load_errors"]:
            r = fn()
            if r:
                errors |= r
        return errors

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        data: dict[str, KVConnectorStats] = {}
        classes: dict[str, str] = {}  # filled in the same loop: no second pass per step
        names, qualnames = self.names, self._qualnames
        for i, fn in self._bound["get_kv_connector_stats"]:
            stats = fn()
            if stats is not None:
                name = names[i]
                data[name], classes[name] = stats, qualnames[name]
        loads = self._load_stats if self._loads_counted else None
        if not data and loads is None:
            return None
        if loads is not None:
            data[STATS_KEY], classes[STATS_KEY] = loads, _qualname(ChildLoadStats)
            self._load_stats, self._loads_counted = ChildLoadStats(), False
        return ComposedStats(data=data, connector_classes=classes)

    def get_kv_connector_kv_cache_events(self) -> "KVConnectorKVEvents | None":
        fns = self._bound["get_kv_connector_kv_cache_events"]
        if not fns:  # no child has its own (the usual case: vLLM's base answers None)
            return None
        children = {}
        for i, fn in fns:
            events = fn()
            if events is not None:
                children[self.names[i]] = events
        return ComposedKVEvents(children) if children else None

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        children = {}
        for i in self._active:
            meta = self._call(i, "get_handshake_metadata")()
            if meta is not None:
                children[self.names[i]] = meta
        return ComposedHandshakeMetadata(children) if children else None

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        names = self.names
        children: dict[str, KVConnectorWorkerMetadata | None] = {}
        some = False  # a plain loop: a comprehension and all() cost a frame each, every step
        for i, fn in self._bound["build_connector_worker_meta"]:
            meta = children[names[i]] = fn()
            if meta is not None:
                some = True
        return ComposedWorkerMetadata(children) if some else None

    def shutdown(self) -> None:
        errors: list[tuple[str, BaseException]] = []
        for name, c in zip(self.names, self._connectors):
            try:
                c.shutdown()
            except Exception as exc:  # every child gets its shutdown, then all errors are reported
                log.exception("connector %s failed to shut down", name)
                errors.append((name, exc))
        if errors:
            raise ChildFailed("shutdown failed in " + ", ".join(f"{n} ({e!r})" for n, e in errors)) from errors[0][1]

    # ------------------------------------------------------------------ scheduler side

    def bind_kv_cache_manager(self, kv_cache_manager: "KVCacheManager") -> None:
        self._kv_cache_manager = kv_cache_manager
        self._each("bind_kv_cache_manager", kv_cache_manager)

    def bind_gpu_block_pool(self, gpu_block_pool: "BlockPool") -> None:
        self._each("bind_gpu_block_pool", gpu_block_pool)

    def on_new_request(self, request: "Request") -> None:
        for _, fn in self._bound["on_new_request"]:
            fn(request)

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        fns = self._bound["get_num_new_matched_tokens"]

        def ask(k: int) -> tuple[int | None, bool]:
            i, fn = fns[k]
            answer = fn(request, num_computed_tokens)
            return (0, False) if answer is None and i in self._disabled else answer

        sel: Selection = self.plan.load.select(ask, len(fns))
        if sel.tokens is None:
            return None, False
        if request.request_id not in self._looked_up:
            self._looked_up.add(request.request_id)
            self._load_stats.lookup()
            self._loads_counted = True
        if sel.winner is None:
            # A re-lookup that finds nothing must not leave an older winner behind.
            self._load_owner.pop(request.request_id, None)
            return 0, False
        self._load_owner[request.request_id] = (fns[sel.winner][0], sel.is_async)
        return sel.tokens, sel.is_async

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        owner = self._load_owner.get(request.request_id) if num_external_tokens > 0 else None
        winner = owner[0] if owner else None
        for i, fn in self._bound["update_state_after_alloc"]:
            fn(request, blocks, num_external_tokens if i == winner else 0)
        if winner is not None:
            self._load_stats.load(self.names[winner], num_external_tokens)
            self._loads_counted = True
        if owner is not None and owner[1]:  # an async load: vLLM now waits for its completion
            self._pending_loads[request.request_id] = owner[0]
            self._new_owners[request.request_id] = owner[0]

    def get_loaded_kv_cache_group_ids(self, request: "Request") -> tuple[int, ...]:
        owner = self._load_owner.get(request.request_id)
        if owner is None:
            return super().get_loaded_kv_cache_group_ids(request)
        return self._connectors[owner[0]].get_loaded_kv_cache_group_ids(request)

    def get_external_cache_hit_sources(self, request: "Request", num_external_tokens: int) -> "dict[CacheHitSource, int]":
        owner = self._load_owner.get(request.request_id)
        if owner is None:
            return super().get_external_cache_hit_sources(request, num_external_tokens)
        return self._connectors[owner[0]].get_external_cache_hit_sources(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        if self._merge_in_place:
            children: dict[str, Any] = {}  # a plain loop: a comprehension costs a frame every step
            for name, fn in self._build_meta:
                children[name] = None if fn is None else fn(scheduler_output)
        else:
            children = self._pack([None if fn is None else fn(scheduler_output) for _, fn in self._build_meta])
        # Most steps start no async load and announce no delayed free: ship the shared empty
        # dict then (workers only read it) instead of allocating two dicts per step.
        owners, saves = self._new_owners, self._new_saves
        if owners:
            self._new_owners = {}
        else:
            owners = _NOTHING
        if saves:
            self._new_saves = {}
        else:
            saves = _NOTHING
        return ComposedMetadata(children, owners, saves)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        composed_meta = connector_output.kv_connector_worker_meta
        composed_events = connector_output.kv_cache_events
        # vLLM asserts on a finished_recving it did not wait for; the worker side already keeps
        # only the loading child's report, and this keeps each id to once, across workers and steps.
        if connector_output.finished_recving:
            kept = {r for r in connector_output.finished_recving if self._pending_loads.pop(r, None) is not None}
            self.dropped_completions += len(connector_output.finished_recving) - len(kept)
            connector_output.finished_recving = kept
        if composed_meta is None and composed_events is None:  # nothing per child to hand out
            for _, fn in self._bound["update_connector_output"]:
                fn(connector_output)
            return
        try:
            metas = composed_meta.children if isinstance(composed_meta, ComposedWorkerMetadata) else _NOTHING
            names = self.names
            if composed_events is None:  # the usual case: worker metadata only, no per-child events
                for i, fn in self._bound["update_connector_output"]:
                    connector_output.kv_connector_worker_meta = metas.get(names[i])
                    connector_output.kv_cache_events = None
                    fn(connector_output)
                return
            events = composed_events.children if isinstance(composed_events, ComposedKVEvents) else _NOTHING
            for i, fn in self._bound["update_connector_output"]:
                connector_output.kv_connector_worker_meta = metas.get(names[i])
                connector_output.kv_cache_events = events.get(names[i])
                fn(connector_output)
        finally:
            connector_output.kv_connector_worker_meta = composed_meta
            connector_output.kv_cache_events = composed_events

    def _finished(self, request: "Request", method: str, *args: Any) -> tuple[bool, dict[str, Any] | None]:
        results: list[dict[str, Any] | None] = [None] * len(self._connectors)
        delaying: list[int] = []
        some = False
        for i, fn in self._bound[method]:
            answer = fn(request, *args)
            if answer is not None:
                delay, params = answer
                if params is not None:
                    results[i], some = params, True
                if delay:
                    delaying.append(i)
        self._load_owner.pop(request.request_id, None)
        self._looked_up.discard(request.request_id)
        if delaying:
            self._new_saves[request.request_id] = tuple(delaying)
        # No child returned params (most requests on a decode instance): nothing to merge.
        return bool(delaying), (self.plan.params.merge(results) if some else None)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._finished(request, "request_finished", block_ids)

    def request_finished_all_groups(self, request: "Request", block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        if not self._all_hma:
            if len(block_ids) != 1:
                raise ValueError("several KV cache groups need every child to support HMA; "
                                 f"{[n for n, c in zip(self.names, self._connectors) if not supports_hma(c)]} do not")
            return self.request_finished(request, block_ids[0])
        return self._finished(request, "request_finished_all_groups", block_ids)

    def register_finished_partial_tail(self, request: "Request", block_ids: tuple[list[int], ...],
                                       partial_tail_offloads: list[tuple[int, int, int]]) -> bool:
        return any(self._each("register_finished_partial_tail", request, block_ids, partial_tail_offloads))

    def take_events(self) -> Iterable["KVCacheEvent"]:
        for _, fn in self._bound["take_events"]:
            yield from fn()

    def has_pending_block_frees(self) -> bool:
        return any(self._each("has_pending_block_frees"))

    def has_pending_push_work(self) -> bool:
        return any(self._each("has_pending_push_work"))

    def get_finished_count(self) -> int | None:
        counts = {self.names[i]: self._connectors[i].get_finished_count() for i in self._active}
        values = {v for v in counts.values() if v is not None}
        if len(values) > 1:
            raise ValueError(f"children expect different numbers of finished reports per request: {counts}")
        if any(v is None for v in counts.values()):
            return None
        return next(iter(values), None)

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        self.set_xfer_handshake_metadata_pp_aware({(0, tp): m for tp, m in metadata.items()})

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]) -> None:
        for i in self._active:
            name = self.names[i]
            mine = {rank: m.children[name] for rank, m in metadata.items()
                    if isinstance(m, ComposedHandshakeMetadata) and name in m.children}
            if mine:
                self._call(i, "set_xfer_handshake_metadata_pp_aware")(mine)

    def reset_cache(self) -> bool | None:
        return all(r is not False for r in self._each("reset_cache"))


class ComposedPromMetrics(KVConnectorPromMetrics):
    """Dispatches each child's stats to the Prometheus metrics of its class."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[type[PromMetric], type[PromMetricT]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]],
                 by_class: dict[str, KVConnectorPromMetrics]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._by_class = by_class

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for entry in transfer_stats_data.values():
            prom = self._by_class.get(entry.get("connector", "")) if isinstance(entry, dict) else None
            if prom is not None:
                prom.observe(entry["data"], engine_idx)


#: The name vLLM's config checks look for (``kv_connector: MultiConnector`` + module path).
MultiConnector = KVComposeConnector
