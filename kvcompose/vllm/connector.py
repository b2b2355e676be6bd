"""The composed connector that vLLM loads as its own.

vLLM looks for the literal name ``MultiConnector`` and its ``connectors`` list in about ten places
(HMA resolution, CPU-offload block alignment, the CPU platform's NIXL layout, ...), and
``kv_connector_module_path`` wins over vLLM's registry. So ``kvcompose vllm-args`` renders::

    {"kv_connector": "MultiConnector",
     "kv_connector_module_path": "kvcompose.vllm.connector",
     "kv_connector_extra_config": {"connectors": [child configs], "kvcompose": {composition}}}

and this module exports :class:`KVComposeConnector` under both names. Each call of vLLM's
connector API is written out below as a loop over the children that get it
(``self._calls.<call>``: :mod:`kvcompose.vllm.calls`); a call that needs a decision asks the
plan's rules (:mod:`kvcompose.contract`), and a request's load is kept in
:mod:`kvcompose.vllm.loads`. A child that raises is handled in one place, :meth:`_contained`.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
    supports_hma,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.outputs import KVConnectorOutput

from kvcompose.contract import FaultMonitor, TransferResults
from kvcompose.merge import merge_values
from kvcompose.versions import version_warnings
from kvcompose.vllm import children as vllm_children
from kvcompose.vllm import metadata as vllm_metadata
from kvcompose.vllm.calls import Calls, Pairs
from kvcompose.vllm.children import ClassLevelAnswers
from kvcompose.vllm.events import PER_DEVICE_BLOCK, EventAnchors
from kvcompose.vllm.health import STATS_KEY as HEALTH_KEY
from kvcompose.vllm.health import ChildStateStats, instance_name
from kvcompose.vllm.loads import RequestLoads, Transfers, block_bytes
from kvcompose.vllm.loadstats import CHILD_COUNTERS, STATS_KEY
from kvcompose.vllm.metadata import (
    ComposedHandshakeMetadata,
    ComposedKVEvents,
    ComposedMetadata,
    ComposedStats,
    ComposedWorkerMetadata,
)
from kvcompose.vllm.surface import base_calls, unknown_calls, warn_generic

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
    from vllm.v1.request import Request

log = logging.getLogger("kvcompose.vllm")

#: "No child sent any", shared by every step that has none (read, never written).
_NONE: dict[str, Any] = {}


class ChildFailed(RuntimeError):
    """A child connector raised in a call that reaches every child; names each one and the call."""


class KVComposeConnector(ClassLevelAnswers, KVConnectorBase_V1, SupportsHMA):
    """Children and rules from a kvcompose composition, behind vLLM's connector interface.

    The class is ``SupportsHMA`` (vLLM tests that on the class); effective HMA support is that of
    every child, which vLLM's config resolution computes from the ``connectors`` list. What vLLM
    asks of the class before any instance exists is combined over the children's classes
    (:class:`~kvcompose.vllm.children.ClassLevelAnswers`), sleep-mode support included. A call
    of a newer vLLM that the class does not define reaches every child, the answers merged by
    type (:func:`forward_unknown_calls`).
    """

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        composite = vllm_children.composite_of_config(vllm_config)  # built once per process
        self.plan = plan = composite.plan
        if role == KVConnectorRole.SCHEDULER:  # told once per engine: its environment is the one that counts
            composite.announce()
            for warning in plan.warnings:
                log.warning("composition: %s", warning.render(plan.source.filename))
            for outside in version_warnings():  # runs anyway (docs/versions.md, the policy)
                log.warning("%s", outside)
        #: The children in YAML order. vLLM's workers look for ``_connectors`` by name.
        self._connectors: list[KVConnectorBase_V1] = [
            cls(cfg, role, kv_cache_config) for cls, cfg in composite.child_classes(vllm_config)
        ]
        self.names: tuple[str, ...] = plan.names
        #: The children's own counters (loadstats.py ``CHILD_COUNTERS``): (child, attribute, its
        #: counts, what was reported of them); a child only adds to its counts.
        self._child_counts: list[tuple[str, str, Mapping[str, int], Counter[str]]] = [
            (n, counter.attribute, getattr(c, counter.attribute), Counter())
            for n, c in zip(self.names, self._connectors, strict=True)
            for counter in CHILD_COUNTERS
            if isinstance(getattr(c, counter.attribute, None), Mapping)
        ]
        self._not_hma = [n for n, c in zip(self.names, self._connectors, strict=True) if not supports_hma(c)]
        self._instance = instance_name(role == KVConnectorRole.SCHEDULER)
        #: The faults rule's view of this instance's children: when one is bypassed and let back.
        self.monitor: FaultMonitor = plan.faults.monitor()
        #: Children not called now, after a contained failure.
        self.bypassed: set[int] = set()
        #: Which children each call reaches (made again when a child is bypassed or let back).
        self._calls = Calls(self._connectors, plan, self.bypassed)
        #: How vLLM's transfer reports map to the rules' (and which fields are carried through).
        self.results_codec = vllm_metadata.RESULTS_CODEC
        #: Each request's load on the scheduler, and the load counters on both sides (:mod:`kvcompose.vllm.loads`).
        self.loads = RequestLoads(
            plan.load,
            self.names,
            vllm_children.engine_facts(vllm_config, kv_cache_config),
            block_bytes(kv_cache_config),
        )
        #: Each request's load and free on a worker: whose transfer reports it waits for.
        self.transfers = Transfers(plan.completion, self.names)
        #: Where the engine publishes KV events: each request's blocks, to complete the children's
        #: stores that lack token ids or a parent (:mod:`kvcompose.vllm.events`).
        self._anchors = _event_anchors(vllm_config, kv_cache_config) if role == KVConnectorRole.SCHEDULER else None

    @property
    def sub_connectors(self) -> list[KVConnectorBase_V1]:
        """The children (vLLM's MultiConnector has this too)."""
        return list(self._connectors)

    # ------------------------------------------------------------------ a child's failure

    def _contained(self, child: int, call: str) -> bool:
        """``child`` raised in ``call`` (the exception being handled): whether the faults rule
        contains it. A contained failure is logged; the child is bypassed when the rule's monitor
        says so; and what it owed is reported failed in the next transfer report, whether or not
        it is bypassed now (a failed call may have lost a load): on a worker the loads it still
        owes, on the scheduler the loads it was given that the workers have not been told of. A
        bypassed child's delayed frees are released, so that its blocks are not held until it
        comes back. The caller goes on as if the child had answered nothing."""
        if not self.plan.faults.contains(child):
            return False
        bypass = self.monitor.failed(child)
        log.warning(
            "connector %s failed in %s%s",
            self.names[child],
            call,
            "; it is bypassed" if bypass else "; contained",
            exc_info=True,
        )
        if bypass:
            self._bypass(child)
        self.transfers.failed(child, child in self.bypassed)
        self.loads.abandon(child)
        return True

    def _bypass(self, child: int) -> None:
        """Stop calling ``child`` (the faults rule's decision, or a test's)."""
        self.bypassed.add(child)
        self._calls = Calls(self._connectors, self.plan, self.bypassed)

    def _call_again(self, children: tuple[int, ...]) -> None:
        """Call ``children`` again, from the next call on."""
        self.bypassed.difference_update(children)
        self._calls = Calls(self._connectors, self.plan, self.bypassed)

    def _step_starts(self) -> None:
        """A step starts while the monitor watches children: tell it which of them were called in
        the last step without failing (every active child gets the step's first call), and call
        again those it lets back."""
        monitor = self.monitor
        for child in tuple(monitor.watched):
            if child not in self.bypassed:
                monitor.succeeded(child)
        back = monitor.step()
        if back:
            self._call_again(back)

    # ------------------------------------------------------------------ loops a reader opens once

    def _each(self, pairs: Pairs, call: str, *args: Any) -> None:
        """Each child of ``pairs`` is called with ``args``."""
        for i, child in pairs:
            try:
                getattr(child, call)(*args)
            except Exception:
                if not self._contained(i, call):
                    raise

    def _answers(self, pairs: Pairs, call: str, *args: Any) -> list[tuple[int, Any]]:
        """Each child's answer that is not ``None``, with its index (a contained failure answers nothing)."""
        out = []
        for i, child in pairs:
            try:
                answer = getattr(child, call)(*args)
            except Exception:
                if not self._contained(i, call):
                    raise
                continue
            if answer is not None:
                out.append((i, answer))
        return out

    def _named(self, pairs: Pairs, call: str, *args: Any) -> dict[str, Any]:
        """The children's answers that are not ``None``, by child name."""
        return {self.names[i]: answer for i, answer in self._answers(pairs, call, *args)}

    def _any(self, pairs: Pairs, call: str, *args: Any) -> bool:
        """Whether any child answers true; every child is asked, as vLLM's MultiConnector asks them."""
        return any([bool(answer) for _, answer in self._answers(pairs, call, *args)])

    def _to_every_child(self, call: str, *args: Any) -> None:
        """``call`` on every child that has it, bypassed ones included; each child gets it whatever
        the others raised, then one :class:`ChildFailed` names every child that raised."""
        errors: list[tuple[str, BaseException]] = []
        for i, child in enumerate(self._connectors):
            fn = getattr(child, call, None)
            if not callable(fn):  # a class written for an older vLLM lacks the sleep-mode calls
                continue
            try:
                fn(*args)
            except Exception as exc:
                log.exception("connector %s failed in %s", self.names[i], call)
                errors.append((self.names[i], exc))
        if errors:
            detail = ", ".join(f"{n} ({e!r})" for n, e in errors)
            raise ChildFailed(f"{call} failed in {detail}") from errors[0][1]

    def _forward_unknown(self, call: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A call of a newer vLLM that this class does not define: every active child that has
        it is called, and the answers merged by type (:func:`kvcompose.merge.merge_values`)."""
        warn_generic(call)
        answers = []
        for i in self._calls.active:
            fn = getattr(self._connectors[i], call, None)
            if not callable(fn):
                continue
            try:
                answers.append(fn(*args, **kwargs))
            except Exception:
                if not self._contained(i, call):
                    raise
        return merge_values(answers)

    # ------------------------------------------------------------------ properties

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        return all(
            getattr(self._connectors[i], "supports_divergent_local_hybrid_hits", True) is not False
            for i in self._calls.active
        )

    @property
    def requires_kv_delivery(self) -> bool:
        return any(getattr(self._connectors[i], "requires_kv_delivery", False) for i in self._calls.active)

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._each(self._calls.register_kv_caches, "register_kv_caches", kv_caches)

    def set_host_xfer_buffer_ops(self, copy_operation: Any) -> None:
        self._each(self._calls.set_host_xfer_buffer_ops, "set_host_xfer_buffer_ops", copy_operation)

    def get_mem_pool_context(self) -> Any:
        found = self._named(self._calls.get_mem_pool_context, "get_mem_pool_context")
        if len(found) > 1:
            raise ValueError(f"children {list(found)} each answer get_mem_pool_context; at most one may")
        return next(iter(found.values()), None)

    def _metas(self, metadata: KVConnectorMetadata) -> Sequence[Any]:
        if not isinstance(metadata, ComposedMetadata):
            raise TypeError(
                f"expected kvcompose metadata, got {type(metadata).__name__}; "
                "were the scheduler and workers started from different configs?"
            )
        return self.plan.metadata.unpack(metadata.children)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        metas = self._metas(connector_metadata)
        m = cast(ComposedMetadata, connector_metadata)
        if self.monitor.watched:  # a step starts: a bypassed child may be let back
            self._step_starts()
        if m.loads_awaited or m.loads_abandoned or m.saves_owed:  # most steps start and end nothing
            self.transfers.told(m.loads_awaited, m.saves_owed, m.loads_abandoned, self.bypassed)
        for i, child in self._calls.bind_connector_metadata:
            try:
                child.bind_connector_metadata(metas[i])
            except Exception:
                if not self._contained(i, "bind_connector_metadata"):
                    raise
        self._connector_metadata = connector_metadata  # what the base class's bind does

    def clear_connector_metadata(self) -> None:
        self._each(self._calls.clear_connector_metadata, "clear_connector_metadata")
        self._connector_metadata = None  # what the base class's clear does

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        metas = self._metas(kv_connector_metadata)
        for i, child in self._calls.handle_preemptions:
            try:
                child.handle_preemptions(metas[i])
            except Exception:
                if not self._contained(i, "handle_preemptions"):
                    raise

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        for i, child in self._calls.start_load_kv:  # the P/D transport first: its reads fly while the others copy
            try:
                child.start_load_kv(forward_context, **kwargs)
            except Exception:
                if not self._contained(i, "start_load_kv"):
                    raise

    # vLLM makes these two once per layer per step: the loop itself, no helper (docs/performance.md: worker step).
    def wait_for_layer_load(self, layer_name: str) -> None:
        for i, child in self._calls.wait_for_layer_load:
            try:
                child.wait_for_layer_load(layer_name)
            except Exception:
                if not self._contained(i, "wait_for_layer_load"):
                    raise

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        for i, child in self._calls.save_kv_layer:  # the store rule's targets
            try:
                if kwargs:  # no ``**{}`` without keywords: vLLM passes none (docs/performance.md: worker step)
                    child.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)
                else:
                    child.save_kv_layer(layer_name, kv_layer, attn_metadata)
            except Exception:
                if not self._contained(i, "save_kv_layer"):
                    raise

    def wait_for_save(self) -> None:
        self._each(self._calls.wait_for_save, "wait_for_save")

    def finish_forward(self) -> None:
        self._each(self._calls.finish_forward, "finish_forward")

    def reset_capture_state(self) -> None:
        self._each(self._calls.reset_capture_state, "reset_capture_state")

    def get_block_ids_with_load_errors(self) -> set[int]:
        out: set[int] = set()
        for _, blocks in self._answers(self._calls.get_block_ids_with_load_errors, "get_block_ids_with_load_errors"):
            out |= blocks
        return out

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        res = self.get_transfer_results(finished_req_ids)
        return res.finished_sending or None, res.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        reports: list[TransferResults | None] = [None] * len(self._connectors)
        raw: list[KVConnectorTransferResults] = []
        codec = self.results_codec
        some = False
        for i, answer in self._answers(self._calls.get_transfer_results, "get_transfer_results", finished_req_ids):
            if codec.carried:
                raw.append(answer)
            report = reports[i] = codec.read(answer)
            some = some or report is not None
        some = some or self.transfers.pending  # what failed children owed, frees released from them
        carried = codec.merge_carried(raw) if codec.carried else None  # a newer vLLM's fields: merged by type
        if not some:  # most steps: nothing finished anywhere
            return codec.write(TransferResults(), carried) if codec.carried else KVConnectorTransferResults()
        out, withheld = self.transfers.settle(reports)
        if withheld:  # not from a loader, a duplicate or late: vllm:kvcompose_withheld_reports
            self.loads.counts().withheld(withheld)
        return codec.write(out, carried) if codec.carried else codec.write(out)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        data: dict[str, Any] = self._named(self._calls.get_kv_connector_stats, "get_kv_connector_stats")
        for name, attribute, counts, reported in self._child_counts:
            gained = {value: n - reported[value] for value, n in counts.items() if n > reported[value]}
            if gained:
                self.loads.counts().child_counts(attribute, name, gained)
                reported.update(gained)
        loads = self.loads.take_stats()
        if loads is not None:
            data[STATS_KEY] = loads
        changes = self.monitor.take_changes()
        if changes:
            data[HEALTH_KEY] = ChildStateStats.of(self._instance, {self.names[c]: s for c, s in changes.items()})
        return ComposedStats(data) if data else None

    def get_kv_connector_kv_cache_events(self) -> ComposedKVEvents | None:
        answers = self._named(self._calls.get_kv_connector_kv_cache_events, "get_kv_connector_kv_cache_events")
        return ComposedKVEvents(answers) if answers else None

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        answers = self._named(self._calls.get_handshake_metadata, "get_handshake_metadata")
        return ComposedHandshakeMetadata(answers) if answers else None

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        answers = self._named(self._calls.build_connector_worker_meta, "build_connector_worker_meta")
        return ComposedWorkerMetadata(answers) if answers else None

    # Sleep mode (vLLM 0.33) and shutdown reach bypassed children too: they still hold registrations.
    def shutdown(self) -> None:
        self._to_every_child("shutdown")

    def unregister_kv_caches(self) -> None:
        self._to_every_child("unregister_kv_caches")

    def restore_kv_caches(self) -> None:
        self._to_every_child("restore_kv_caches")

    # ------------------------------------------------------------------ scheduler side

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        self._each(self._calls.bind_gpu_block_pool, "bind_gpu_block_pool", gpu_block_pool)

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        self._kv_cache_manager = kv_cache_manager
        self._each(self._calls.bind_kv_cache_manager, "bind_kv_cache_manager", kv_cache_manager)

    def on_new_request(self, request: Request) -> None:
        self._each(self._calls.on_new_request, "on_new_request", request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        children = self._calls.get_num_new_matched_tokens

        def ask(i: int, n: int) -> tuple[int | None, bool]:
            try:
                return children[i].get_num_new_matched_tokens(request, n)
            except Exception:
                if not self._contained(i, "get_num_new_matched_tokens"):
                    raise
                return 0, False

        sel = self.plan.load.select(ask, tuple(children), num_computed_tokens, request.kv_transfer_params)
        if sel.tokens is not None:
            self.loads.selected(request.request_id, sel, num_computed_tokens)
        return sel.tokens, sel.is_async

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if self._anchors is not None:  # the request's blocks, for the children's KV events
            self._anchors.record(request)
        # ``deferred``: children whose part of a mixed load waits for the request's next schedule
        # (LoadRule.deferred); vLLM's blocks then are the request's whole block list again.
        tokens, deferred = self.loads.after_alloc(request, blocks, num_external_tokens)
        for i, child in self._calls.update_state_after_alloc:
            if i in deferred:
                continue
            try:
                child.update_state_after_alloc(request, blocks, tokens.get(i, 0))
            except Exception:
                if not self._contained(i, "update_state_after_alloc"):
                    raise

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        """The KV cache groups the request's loaders load, sorted (vLLM's default when none loads it)."""
        contributions = self.loads.contributions(request.request_id)
        if not contributions:
            return super().get_loaded_kv_cache_group_ids(request)
        children = self._calls.get_loaded_kv_cache_group_ids
        groups: set[int] = set()
        for c in contributions:
            if c.child not in children:
                continue
            try:
                groups.update(children[c.child].get_loaded_kv_cache_group_ids(request))
            except Exception:
                if not self._contained(c.child, "get_loaded_kv_cache_group_ids"):
                    raise
        return tuple(sorted(groups))

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        """Where the request's external tokens come from: each loader's answer for its own part,
        summed by source (vLLM's default when none loads it)."""
        contributions = self.loads.contributions(request.request_id, num_external_tokens)
        if not contributions:
            return super().get_external_cache_hit_sources(request, num_external_tokens)
        children = self._calls.get_external_cache_hit_sources
        sources: dict[CacheHitSource, int] = {}
        for c in contributions:
            if c.child not in children:
                continue
            try:
                answer = children[c.child].get_external_cache_hit_sources(request, c.tokens)
            except Exception:
                if not self._contained(c.child, "get_external_cache_hit_sources"):
                    raise
                continue
            if len(contributions) == 1:  # one loader, the usual case: its own answer, not a copy
                return answer
            for source, n in answer.items():
                sources[source] = sources.get(source, 0) + n
        return sources

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        if self.monitor.watched:  # a step starts: a bypassed child may be let back
            self._step_starts()
        loads = self.loads
        if loads.deferring or loads.sync_load_now:
            loads.start_step(scheduler_output, self._kv_cache_manager)
        metas: list[Any] = [None] * len(self._connectors)  # a bypassed child's slot stays None
        for i, child in self._calls.build_connector_meta:
            try:
                metas[i] = child.build_connector_meta(scheduler_output)
            except Exception:
                if not self._contained(i, "build_connector_meta"):
                    raise
        started, saves, abandoned = loads.take_announcements()
        return ComposedMetadata(self.plan.metadata.pack(metas), started, saves, abandoned)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        reported = connector_output.finished_recving
        if reported:  # the reports vLLM no longer waits for are withheld (and counted)
            connector_output.finished_recving = self.loads.arrived(reported)
        composed_meta = connector_output.kv_connector_worker_meta
        composed_events = connector_output.kv_cache_events
        metas = composed_meta.children if isinstance(composed_meta, ComposedWorkerMetadata) else _NONE
        events = composed_events.children if isinstance(composed_events, ComposedKVEvents) else _NONE
        try:  # each child sees only its own worker metadata and KV events
            for i, child in self._calls.update_connector_output:
                connector_output.kv_connector_worker_meta = metas.get(self.names[i])
                connector_output.kv_cache_events = events.get(self.names[i])
                try:
                    child.update_connector_output(connector_output)
                except Exception:
                    if not self._contained(i, "update_connector_output"):
                        raise
        finally:
            connector_output.kv_connector_worker_meta = composed_meta
            connector_output.kv_cache_events = composed_events

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._finished(request, self._calls.request_finished, "request_finished", block_ids)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        if self._not_hma:
            if len(block_ids) != 1:
                raise ValueError(f"several KV cache groups need every child to support HMA; {self._not_hma} do not")
            return self.request_finished(request, block_ids[0])
        return self._finished(
            request, self._calls.request_finished_all_groups, "request_finished_all_groups", block_ids
        )

    def _finished(
        self, request: Request, pairs: Pairs, call: str, block_ids: Any
    ) -> tuple[bool, dict[str, Any] | None]:
        """The request finished: each child says whether it delays the free and what params it
        returns; the params rule merges those, and the frees wait for every delaying child."""
        if self._anchors is not None:  # the blocks a host tier may store once the device frees them
            self._anchors.record(request)
        results: list[dict[str, Any] | None] = [None] * len(self._connectors)
        delaying: list[int] = []
        for i, child in pairs:
            try:
                delay, results[i] = getattr(child, call)(request, block_ids)
            except Exception:
                if not self._contained(i, call):
                    raise
                continue
            if delay:
                delaying.append(i)
        self.loads.finished(request.request_id, tuple(delaying) if delaying else ())
        return bool(delaying), self.plan.params.merge(results)

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        self.set_xfer_handshake_metadata_pp_aware({(0, tp): m for tp, m in metadata.items()})

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]
    ) -> None:
        for i, child in self._calls.set_xfer_handshake_metadata_pp_aware:
            mine = ComposedHandshakeMetadata.of_child(metadata, self.names[i])  # each child gets its own
            if not mine:
                continue
            try:
                child.set_xfer_handshake_metadata_pp_aware(mine)
            except Exception:
                if not self._contained(i, "set_xfer_handshake_metadata_pp_aware"):
                    raise

    def register_finished_partial_tail(
        self, request: Request, block_ids: tuple[list[int], ...], partial_tail_offloads: list[tuple[int, int, int]]
    ) -> bool:
        return self._any(
            self._calls.register_finished_partial_tail,
            "register_finished_partial_tail",
            request,
            block_ids,
            partial_tail_offloads,
        )

    def has_pending_block_frees(self) -> bool:
        return self._any(self._calls.has_pending_block_frees, "has_pending_block_frees")

    def has_pending_push_work(self) -> bool:
        return self._any(self._calls.has_pending_push_work, "has_pending_push_work")

    def get_finished_count(self) -> int | None:
        """The one count every child that answers gives (``None`` when one answers none)."""
        answers: dict[str, int | None] = {}
        for i, child in self._calls.get_finished_count:
            try:
                answers[self.names[i]] = child.get_finished_count()
            except Exception:
                if not self._contained(i, "get_finished_count"):
                    raise
                answers[self.names[i]] = None
        values = set(answers.values())
        if len(values - {None}) > 1:
            raise ValueError(f"children answer get_finished_count differently: {answers}")
        return None if None in values else next(iter(values), None)

    def reset_cache(self) -> bool:
        """True unless a child answers False."""
        return all([answer is not False for _, answer in self._answers(self._calls.reset_cache, "reset_cache")])

    def take_events(self) -> Iterable[KVCacheEvent]:
        """The children's KV events, each store with its block's token ids and after its parent's
        (:mod:`kvcompose.vllm.events`) where the engine publishes them."""
        events: list[KVCacheEvent] = []
        for _, answer in self._answers(self._calls.take_events, "take_events"):
            events.extend(answer)
        anchors = self._anchors
        return anchors.complete(events) if anchors is not None and events else events


def forward_unknown_calls(cls: type[KVComposeConnector], base: type = KVConnectorBase_V1) -> type[KVComposeConnector]:
    """Each instance method of vLLM's base class (or ``base``) that the composite does not define is forwarded
    to every active child that has it, the answers merged by type
    (:meth:`KVComposeConnector._forward_unknown`). Class methods and properties it does not
    define keep vLLM's default (the surface tests name them), since no child instance exists to ask."""
    kinds = base_calls(base)
    for name in unknown_calls(cls, base):
        if kinds[name] == "method":
            setattr(cls, name, forwarder(name))
    return cls


def forwarder(call: str) -> Callable[..., Any]:
    """The composite's method for an unknown ``call`` (every one shares this code)."""

    def forwarded(self: KVComposeConnector, *args: Any, **kwargs: Any) -> Any:
        return self._forward_unknown(call, args, kwargs)

    forwarded.__name__ = forwarded.__qualname__ = call
    return forwarded


forward_unknown_calls(KVComposeConnector)


def _event_anchors(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> EventAnchors | None:
    """The anchors of the scheduler's composite where the engine publishes KV events, else None."""
    events = vllm_config.kv_events_config
    if events is None or not events.enable_kv_cache_events:
        return None
    block_size = getattr(kv_cache_config, "hash_block_size", None) or vllm_config.cache_config.block_size
    return EventAnchors(block_size, PER_DEVICE_BLOCK * max(getattr(kv_cache_config, "num_blocks", 0), 1024))


#: The name vLLM's config checks look for (``kv_connector: MultiConnector`` + module path).
MultiConnector = KVComposeConnector
