"""The composed connector that vLLM loads as its own.

vLLM looks for the literal name ``MultiConnector`` and its ``connectors`` list in about ten places
(HMA resolution, CPU-offload block alignment, the CPU platform's NIXL layout, ...), and
``kv_connector_module_path`` wins over vLLM's registry. So ``kvcompose vllm-args`` renders::

    {"kv_connector": "MultiConnector",
     "kv_connector_module_path": "kvcompose.vllm.connector",
     "kv_connector_extra_config": {"connectors": [child configs], "kvcompose": {composition}}}

and this module exports :class:`KVComposeConnector` under both names. The class is a forwarder:
each call of vLLM's connector API is declared once below, with how the children's answers
combine, which children get it and what a contained child answers (:mod:`kvcompose.vllm.forward`);
the calls that need a decision hand it to the plan's rules (:mod:`kvcompose.contract`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

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

from kvcompose.contract import TransferResults
from kvcompose.versions import version_warnings
from kvcompose.vllm import children as vllm_children
from kvcompose.vllm import metadata as vllm_metadata
from kvcompose.vllm.children import ClassLevelAnswers
from kvcompose.vllm.events import PER_DEVICE_BLOCK, EventAnchors
from kvcompose.vllm.forward import ByChild, Fanout, Fn, by_child, combined, each, forward_unknown_calls, read
from kvcompose.vllm.health import STATS_KEY as HEALTH_KEY
from kvcompose.vllm.health import ChildStateStats, instance_name
from kvcompose.vllm.loads import RequestLoads, block_bytes
from kvcompose.vllm.loadstats import STATS_KEY
from kvcompose.vllm.metadata import (
    ComposedHandshakeMetadata,
    ComposedKVEvents,
    ComposedMetadata,
    ComposedStats,
    ComposedWorkerMetadata,
)

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


@forward_unknown_calls
class KVComposeConnector(ClassLevelAnswers, KVConnectorBase_V1, SupportsHMA):
    """Children and rules from a kvcompose composition, behind vLLM's connector interface.

    The class is ``SupportsHMA`` (vLLM tests that on the class); effective HMA support is that of
    every child, which vLLM's config resolution computes from the ``connectors`` list. What vLLM
    asks of the class before any instance exists is combined over the children's classes
    (:class:`~kvcompose.vllm.children.ClassLevelAnswers`), sleep-mode support included. A call
    of a newer vLLM that the class does not declare reaches every child, the answers merged by
    type (:func:`~kvcompose.vllm.forward.forward_unknown_calls`).
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
        #: The counts of children that check the kv_transfer_params they are handed (loadstats.py).
        self._refusals: list[tuple[str, dict[str, int]]] = [
            (n, c.refused_params)
            for n, c in zip(self.names, self._connectors, strict=True)
            if hasattr(c, "refused_params")
        ]
        self._not_hma = [n for n, c in zip(self.names, self._connectors, strict=True) if not supports_hma(c)]
        self._instance = instance_name(role == KVConnectorRole.SCHEDULER)
        #: How the declared calls reach the children, and which children are bypassed.
        self.fanout = Fanout(self, self._connectors, plan, on_fault=self._child_failed)
        #: How vLLM's transfer reports map to the rules' (and which fields are carried through).
        self.results_codec = vllm_metadata.RESULTS_CODEC
        self._completion = plan.completion.tracker()
        self._abandoned = False  # loads of a disabled child to settle as failed
        #: A request's load on the scheduler, and the load counters on both sides (:mod:`kvcompose.vllm.loads`).
        self.loads = RequestLoads(
            plan.load,
            self.names,
            vllm_children.engine_facts(vllm_config, kv_cache_config),
            block_bytes(kv_cache_config),
        )
        #: Where the engine publishes KV events: each request's blocks, to complete the children's
        #: stores that lack token ids or a parent (:mod:`kvcompose.vllm.events`).
        self._anchors = _event_anchors(vllm_config, kv_cache_config) if role == KVConnectorRole.SCHEDULER else None

    def _child_failed(self, child: int, method: str) -> None:
        """A contained child raised: what it owed is reported failed, whether or not it is bypassed
        now (a failed call may have lost a load), in the next transfer report. On a worker: the
        loads it still owes; on the scheduler: the loads it was given that the workers have not
        been told of. A bypassed child's delayed frees are released, so that its blocks are not
        held until it comes back."""
        self._completion.abandon(child, self._completion.owed_by(child))
        if child in self.fanout.disabled:
            self._completion.release(child)
        self.loads.abandon(child)
        self._abandoned = True

    @property
    def sub_connectors(self) -> list[KVConnectorBase_V1]:
        """The children (vLLM's MultiConnector has this too)."""
        return list(self._connectors)

    # Each call of vLLM's connector API, declared once (kvcompose/vllm/forward.py): ``each()`` calls
    # every child that gets it with vLLM's arguments; ``combined(how, neutral)`` combines their
    # answers (``neutral``: what a contained child that raised answers); a method marked
    # ``@by_child`` / ``@combined`` decides itself, given the children's callables after ``self``.

    supports_divergent_local_hybrid_hits = read("all")
    requires_kv_delivery = read("any")

    # ------------------------------------------------------------------ worker side

    register_kv_caches = each()
    set_host_xfer_buffer_ops = each(to="host-buffer-owner")
    get_mem_pool_context = combined("one")
    start_load_kv = each(to="pd-first")
    # vLLM makes these two once per layer per step: plain forwards, a lone child's own callable.
    wait_for_layer_load = each()
    save_kv_layer = each(to="store-targets")
    wait_for_save = each(to="store-targets")
    finish_forward = each()
    reset_capture_state = each()
    get_block_ids_with_load_errors = combined("union", frozenset(), base_neutral=True)
    shutdown = combined("every")
    # Sleep mode (vLLM 0.33): bypassed children get it too, since they still hold registrations.
    unregister_kv_caches = combined("every")
    restore_kv_caches = combined("every")

    def _metas(self, metadata: KVConnectorMetadata) -> Sequence[Any]:
        if not isinstance(metadata, ComposedMetadata):
            raise TypeError(
                f"expected kvcompose metadata, got {type(metadata).__name__}; "
                "were the scheduler and workers started from different configs?"
            )
        return self.plan.metadata.unpack(metadata.children)

    @by_child()
    def bind_connector_metadata(self, children: ByChild, connector_metadata: KVConnectorMetadata) -> None:
        metas = self._metas(connector_metadata)
        assert isinstance(connector_metadata, ComposedMetadata)
        children = self.fanout.at_step(KVComposeConnector.bind_connector_metadata, children)
        m = connector_metadata
        if m.loads_awaited or m.loads_abandoned or m.saves_owed:  # most steps start and end nothing
            self._abandoned |= self._completion.told(
                m.loads_awaited, m.saves_owed, m.loads_abandoned, self.fanout.disabled
            )
        for i, fn in children.items():
            fn(metas[i])
        self._connector_metadata = connector_metadata  # what the base class's bind does

    @by_child()
    def clear_connector_metadata(self, children: ByChild) -> None:
        for fn in children.values():
            fn()
        self._connector_metadata = None  # what the base class's clear does

    @by_child()
    def handle_preemptions(self, children: ByChild, kv_connector_metadata: KVConnectorMetadata) -> None:
        metas = self._metas(kv_connector_metadata)
        for i, fn in children.items():
            fn(metas[i])

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        res = self.get_transfer_results(finished_req_ids)
        return res.finished_sending or None, res.finished_recving or None

    @by_child()
    def get_transfer_results(self, children: ByChild, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        reports: list[TransferResults | None] = [None] * len(self._connectors)
        some, self._abandoned = self._abandoned, False
        codec = self.results_codec
        if codec.carried:  # a newer vLLM's fields kvcompose does not know: merged by type
            raw: list[KVConnectorTransferResults | None] = []
            for i, fn in children.items():
                raw.append(fn(finished_req_ids))
                report = reports[i] = codec.read(raw[-1])
                some = some or report is not None
            carried = codec.merge_carried(raw)
            if not some:
                return codec.write(TransferResults(), carried)
            out, withheld = self._completion.settle(reports)
            if withheld:  # not from a loader, a duplicate or late: vllm:kvcompose_withheld_reports
                self.loads.counts().withheld(withheld)
            return codec.write(out, carried)
        for i, fn in children.items():
            report = reports[i] = codec.read(fn(finished_req_ids))
            some = some or report is not None
        if not some:  # most steps: nothing finished anywhere
            return KVConnectorTransferResults()
        out, withheld = self._completion.settle(reports)
        if withheld:
            self.loads.counts().withheld(withheld)
        return codec.write(out)

    @combined("named")
    def get_kv_connector_stats(self, children: Fn) -> KVConnectorStats | None:
        data: dict[str, KVConnectorStats] = children()
        for name, refused in self._refusals:
            if refused:
                self.loads.counts().refused(name, dict(refused))
                refused.clear()
        loads = self.loads.take_stats()
        if loads is not None:
            data[STATS_KEY] = loads
        changes = self.fanout.monitor.take_changes()
        if changes:
            data[HEALTH_KEY] = ChildStateStats.of(self._instance, {self.names[c]: s for c, s in changes.items()})
        return ComposedStats(data) if data else None

    @combined("named")
    def get_kv_connector_kv_cache_events(self, children: Fn) -> ComposedKVEvents | None:
        answers = children()
        return ComposedKVEvents(answers) if answers else None

    @combined("named")
    def get_handshake_metadata(self, children: Fn) -> KVConnectorHandshakeMetadata | None:
        answers = children()
        return ComposedHandshakeMetadata(answers) if answers else None

    @combined("named")
    def build_connector_worker_meta(self, children: Fn) -> KVConnectorWorkerMetadata | None:
        answers = children()
        return ComposedWorkerMetadata(answers) if answers else None

    # ------------------------------------------------------------------ scheduler side

    bind_gpu_block_pool = each()
    on_new_request = each()
    register_finished_partial_tail = combined("any", False, base_neutral=True)
    has_pending_block_frees = combined("any", False, base_neutral=True)
    has_pending_push_work = combined("any", False, base_neutral=True)
    get_finished_count = combined("agreed")
    reset_cache = combined("all")

    @combined("concat", (), base_neutral=True)
    def take_events(self, children: Fn) -> Iterable[KVCacheEvent]:
        """The children's KV events, each store with its block's token ids and after its parent's
        (:mod:`kvcompose.vllm.events`) where the engine publishes them."""
        events = children()
        anchors = self._anchors
        return anchors.complete(events) if anchors is not None and events else events

    @by_child()
    def bind_kv_cache_manager(self, children: ByChild, kv_cache_manager: KVCacheManager) -> None:
        self._kv_cache_manager = kv_cache_manager
        for fn in children.values():
            fn(kv_cache_manager)

    @by_child(neutral=(0, False), ruled=True)
    def get_num_new_matched_tokens(
        self, children: ByChild, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        sel = self.plan.load.select(
            lambda i, n: children[i](request, n), self.fanout.active, num_computed_tokens, request.kv_transfer_params
        )
        if sel.tokens is not None:
            self.loads.selected(request.request_id, sel, num_computed_tokens)
        return sel.tokens, sel.is_async

    @by_child()
    def update_state_after_alloc(
        self, children: ByChild, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if self._anchors is not None:  # the request's blocks, for the children's KV events
            self._anchors.record(request)
        # ``held``: children whose part of a mixed load waits for the request's next schedule
        # (LoadRule.deferred); vLLM's blocks then are the request's whole block list again.
        tokens, held = self.loads.after_alloc(request, blocks, num_external_tokens)
        for i, fn in children.items():
            if i not in held:
                fn(request, blocks, tokens.get(i, 0))

    @by_child(ruled=True)
    def get_loaded_kv_cache_group_ids(self, children: ByChild, request: Request) -> tuple[int, ...]:
        groups = self.loads.loaded_groups(request, children)
        return super().get_loaded_kv_cache_group_ids(request) if groups is None else groups

    @by_child(neutral={}, ruled=True)
    def get_external_cache_hit_sources(
        self, children: ByChild, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        sources = self.loads.hit_sources(request, num_external_tokens, children)
        return super().get_external_cache_hit_sources(request, num_external_tokens) if sources is None else sources

    @by_child()
    def build_connector_meta(self, children: ByChild, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        children = self.fanout.at_step(KVComposeConnector.build_connector_meta, children)
        loads = self.loads
        if loads.held or loads.sync_load_now:
            loads.start_step(scheduler_output, self._kv_cache_manager)
        metas: list[Any] = [None] * len(self._connectors)  # a bypassed child's slot stays None
        for i, fn in children.items():
            metas[i] = fn(scheduler_output)
        started, saves, abandoned = loads.take_announcements()
        return ComposedMetadata(self.plan.metadata.pack(metas), started, saves, abandoned)

    @by_child()
    def update_connector_output(self, children: ByChild, connector_output: KVConnectorOutput) -> None:
        reported = connector_output.finished_recving
        if reported:  # the reports vLLM no longer waits for are withheld (and counted)
            connector_output.finished_recving = self.loads.arrived(reported, self._completion)
        composed_meta = connector_output.kv_connector_worker_meta
        composed_events = connector_output.kv_cache_events
        metas = composed_meta.children if isinstance(composed_meta, ComposedWorkerMetadata) else _NONE
        events = composed_events.children if isinstance(composed_events, ComposedKVEvents) else _NONE
        try:  # each child sees only its own worker metadata and KV events
            for i, fn in children.items():
                connector_output.kv_connector_worker_meta = metas.get(self.names[i])
                connector_output.kv_cache_events = events.get(self.names[i])
                fn(connector_output)
        finally:
            connector_output.kv_connector_worker_meta = composed_meta
            connector_output.kv_cache_events = composed_events

    def _finished(self, request: Request, children: ByChild, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        if self._anchors is not None:  # the blocks a host tier may store once the device frees them
            self._anchors.record(request)
        results: list[dict[str, Any] | None] = [None] * len(self._connectors)
        delaying: list[int] = []
        for i, fn in children.items():
            delay, results[i] = fn(request, block_ids)
            if delay:
                delaying.append(i)
        self.loads.finished(request.request_id, tuple(delaying) if delaying else ())
        return bool(delaying), self.plan.params.merge(results)

    @by_child(neutral=(False, None))
    def request_finished(
        self, children: ByChild, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._finished(request, children, block_ids)

    @by_child(neutral=(False, None))
    def request_finished_all_groups(
        self, children: ByChild, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        if self._not_hma:
            if len(block_ids) != 1:
                raise ValueError(f"several KV cache groups need every child to support HMA; {self._not_hma} do not")
            return self.request_finished(request, block_ids[0])
        return self._finished(request, children, block_ids)

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        self.set_xfer_handshake_metadata_pp_aware({(0, tp): m for tp, m in metadata.items()})

    @by_child()
    def set_xfer_handshake_metadata_pp_aware(
        self, children: ByChild, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]
    ) -> None:
        for i, fn in children.items():
            mine = ComposedHandshakeMetadata.of_child(metadata, self.names[i])
            if mine:
                fn(mine)


def _event_anchors(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> EventAnchors | None:
    """The anchors of the scheduler's composite where the engine publishes KV events, else None."""
    events = vllm_config.kv_events_config
    if events is None or not events.enable_kv_cache_events:
        return None
    block_size = getattr(kv_cache_config, "hash_block_size", None) or vllm_config.cache_config.block_size
    return EventAnchors(block_size, PER_DEVICE_BLOCK * max(getattr(kv_cache_config, "num_blocks", 0), 1024))


#: The name vLLM's config checks look for (``kv_connector: MultiConnector`` + module path).
MultiConnector = KVComposeConnector
