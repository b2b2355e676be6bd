"""The composed connector that vLLM loads as its own.

vLLM looks for the literal name ``MultiConnector`` and its ``connectors`` list in about ten places
(HMA resolution, CPU-offload block alignment, the CPU platform's NIXL layout, ...), and
``kv_connector_module_path`` wins over vLLM's registry. So ``kvcompose vllm-args`` renders::

    {"kv_connector": "MultiConnector",
     "kv_connector_module_path": "kvcompose.vllm.connector",
     "kv_connector_extra_config": {"connectors": [child configs], "kvcompose": {composition}}}

and this module exports :class:`KVComposeConnector` under both names. The class is a forwarder:
each engine call goes to the children as the call table (:mod:`kvcompose.vllm.calls`) declares it,
through the dispatch (:mod:`kvcompose.vllm.dispatch`: ``calls[m]``, ``calls.per_layer[m]``,
``calls.combined[m]``), and to the plan's rules (:mod:`kvcompose.rules.contract`), which decide
everything.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
from vllm.config import VllmConfig
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
    KVConnectorStats,
)
from vllm.v1.outputs import KVConnectorOutput

from kvcompose.rules.contract import TransferResults
from kvcompose.rules.faults import settle
from kvcompose.versions import version_warnings
from kvcompose.vllm import children as vllm_children
from kvcompose.vllm import metadata as vllm_metadata
from kvcompose.vllm.children import ClassLevelAnswers
from kvcompose.vllm.dispatch import Dispatch
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
from kvcompose.vllm.surface import forward_unknown_calls

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

#: "No child sent any", shared by every step that has none (read, never written).
_NONE: dict[str, Any] = {}


@forward_unknown_calls
class KVComposeConnector(ClassLevelAnswers, KVConnectorBase_V1, SupportsHMA):
    """Children and rules from a kvcompose composition, behind vLLM's connector interface.

    The class is ``SupportsHMA`` (vLLM tests that on the class); effective HMA support is that of
    every child, which vLLM's config resolution computes from the ``connectors`` list. What vLLM
    asks of the class before any instance exists is combined over the children's classes
    (:class:`~kvcompose.vllm.children.ClassLevelAnswers`), sleep-mode support included. A call
    of a newer vLLM that the class does not define reaches every child by the generic rule of
    :mod:`kvcompose.vllm.surface`.
    """

    # ------------------------------------------------------------------ construction

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        assert ktc is not None
        # Told once per engine, by its scheduler: the engine's environment is the one that counts.
        self.plan = plan = vllm_children.plan_from_config(ktc, announce=role == KVConnectorRole.SCHEDULER)
        if role == KVConnectorRole.SCHEDULER:
            for warning in plan.warnings:
                log.warning("composition: %s", warning.render(plan.source.filename))
            for outside in version_warnings():  # runs anyway (docs/versions.md, the policy)
                log.warning("%s", outside)
        classes = vllm_children.child_classes(vllm_config)
        if len(classes) != len(plan.children):
            raise ValueError(
                f"kv_connector_extra_config lists {len(classes)} connectors but the composition has "
                f"{len(plan.children)}; regenerate the arguments with `kvcompose vllm-args`"
            )
        #: The children in YAML order. vLLM's workers look for ``_connectors`` by name.
        self._connectors: list[KVConnectorBase_V1] = [cls(cfg, role, kv_cache_config) for cls, cfg in classes]
        self.names: tuple[str, ...] = plan.names
        self._not_hma = [n for n, c in zip(self.names, self._connectors, strict=True) if not supports_hma(c)]
        self._instance = instance_name(role == KVConnectorRole.SCHEDULER)
        self.calls = Dispatch.for_plan(self._connectors, plan, on_fault=self._child_failed)
        self._per_layer = self.calls.per_layer
        #: How vLLM's transfer reports map to the rules' (and which fields are carried through).
        self._results = vllm_metadata.RESULTS
        self._completion = plan.completion.tracker()
        self._abandoned = False  # loads of a disabled child to settle as failed
        #: Reports withheld from vLLM (not from a loader, duplicate or late), for tests and logs.
        self.dropped_completions = 0
        self._loads = RequestLoads(  # scheduler side
            plan.load,
            self.names,
            vllm_children.engine_facts(vllm_config, kv_cache_config),
            block_bytes(kv_cache_config),
        )

    def _child_failed(self, child: int, method: str) -> None:
        """A contained child raised: the faults rule settles what it owed (:func:`settle`), and
        the next transfer report carries it."""
        settle(self.plan.faults, child, child in self.calls.disabled, self._completion, self._loads)
        self._abandoned = True

    @property
    def sub_connectors(self) -> list[KVConnectorBase_V1]:
        return list(self._connectors)

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        return self.calls.combined["supports_divergent_local_hybrid_hits"]()

    @property
    def requires_kv_delivery(self) -> bool:
        return self.calls.combined["requires_kv_delivery"]()

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        for fn in self.calls["register_kv_caches"].values():
            fn(kv_caches)

    def set_host_xfer_buffer_ops(self, copy_operation: CopyBlocksOp) -> None:
        for fn in self.calls["set_host_xfer_buffer_ops"].values():
            fn(copy_operation)

    def get_mem_pool_context(self) -> AbstractContextManager | None:
        return self.calls.combined["get_mem_pool_context"]()

    def _metas(self, metadata: KVConnectorMetadata) -> Sequence[Any]:
        if not isinstance(metadata, ComposedMetadata):
            raise TypeError(
                f"expected kvcompose metadata, got {type(metadata).__name__}; "
                "were the scheduler and workers started from different configs?"
            )
        return self.plan.metadata.unpack(metadata.children)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        metas = self._metas(connector_metadata)
        assert isinstance(connector_metadata, ComposedMetadata)
        if self.calls.monitor.watched:  # a child with failures: a bypassed one may come back now
            self.calls.step()
        m = connector_metadata
        if m.loads_awaited or m.loads_abandoned or m.saves_owed:  # most steps start and end nothing
            self._abandoned |= self._completion.told(
                m.loads_awaited, m.saves_owed, m.loads_abandoned, self.calls.disabled
            )
        for i, fn in self.calls["bind_connector_metadata"].items():
            fn(metas[i])
        self._connector_metadata = connector_metadata  # what the base class's bind does

    def clear_connector_metadata(self) -> None:
        for fn in self.calls["clear_connector_metadata"].values():
            fn()
        self._connector_metadata = None  # what the base class's clear does

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        metas = self._metas(kv_connector_metadata)
        for i, fn in self.calls["handle_preemptions"].items():
            fn(metas[i])

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        for fn in self.calls["start_load_kv"].values():
            fn(forward_context, **kwargs)

    # Per layer: plain callables, no ``**{}`` without keywords (docs/performance.md: worker step, before/after).
    def wait_for_layer_load(self, layer_name: str) -> None:
        for fn in self._per_layer["wait_for_layer_load"]:
            fn(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        if kwargs:
            for fn in self._per_layer["save_kv_layer"]:
                fn(layer_name, kv_layer, attn_metadata, **kwargs)
        else:
            for fn in self._per_layer["save_kv_layer"]:
                fn(layer_name, kv_layer, attn_metadata)

    def wait_for_save(self) -> None:
        for fn in self.calls["wait_for_save"].values():
            fn()

    def finish_forward(self) -> None:
        for fn in self.calls["finish_forward"].values():
            fn()

    def reset_capture_state(self) -> None:
        for fn in self.calls["reset_capture_state"].values():
            fn()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        res = self.get_transfer_results(finished_req_ids)
        return res.finished_sending or None, res.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        reports: list[TransferResults | None] = [None] * len(self._connectors)
        some, self._abandoned = self._abandoned, False
        codec = self._results
        if codec.carried:  # a newer vLLM's fields kvcompose does not know: merged by type
            raw: list[KVConnectorTransferResults | None] = []
            for i, fn in self.calls["get_transfer_results"].items():
                raw.append(fn(finished_req_ids))
                report = reports[i] = codec.read(raw[-1])
                some = some or report is not None
            carried = codec.merge_carried(raw)
            if not some:
                return codec.write(TransferResults(), carried)
            out, dropped = self._completion.settle(reports)
            self.dropped_completions += dropped
            return codec.write(out, carried)
        for i, fn in self.calls["get_transfer_results"].items():
            report = reports[i] = codec.read(fn(finished_req_ids))
            some = some or report is not None
        if not some:  # most steps: nothing finished anywhere
            return KVConnectorTransferResults()
        out, dropped = self._completion.settle(reports)
        self.dropped_completions += dropped
        return codec.write(out)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.calls.combined["get_block_ids_with_load_errors"]()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        data: dict[str, KVConnectorStats] = self.calls.combined["get_kv_connector_stats"]()
        loads = self._loads.take_stats()
        if loads is not None:
            data[STATS_KEY] = loads
        changes = self.calls.monitor.take_changes()
        if changes:
            data[HEALTH_KEY] = ChildStateStats.of(self._instance, {self.names[c]: s for c, s in changes.items()})
        return ComposedStats(data) if data else None

    def get_kv_connector_kv_cache_events(self) -> KVConnectorKVEvents | None:
        children = self.calls.combined["get_kv_connector_kv_cache_events"]()
        return ComposedKVEvents(children) if children else None

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        children = self.calls.combined["get_handshake_metadata"]()
        return ComposedHandshakeMetadata(children) if children else None

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        children = self.calls.combined["build_connector_worker_meta"]()
        return ComposedWorkerMetadata(children) if children else None

    def shutdown(self) -> None:
        self.calls.combined["shutdown"]()

    # Sleep mode (vLLM 0.33): bypassed children get it too, since they still hold registrations.
    def unregister_kv_caches(self) -> None:
        self.calls.combined["unregister_kv_caches"]()

    def restore_kv_caches(self) -> None:
        self.calls.combined["restore_kv_caches"]()

    # ------------------------------------------------------------------ scheduler side

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        self._kv_cache_manager = kv_cache_manager
        for fn in self.calls["bind_kv_cache_manager"].values():
            fn(kv_cache_manager)

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        for fn in self.calls["bind_gpu_block_pool"].values():
            fn(gpu_block_pool)

    def on_new_request(self, request: Request) -> None:
        for fn in self.calls["on_new_request"].values():
            fn(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        fns = self.calls["get_num_new_matched_tokens"]
        sel = self.plan.load.select(
            lambda i, n: fns[i](request, n), self.calls.active, num_computed_tokens, request.kv_transfer_params
        )
        if sel.tokens is not None:
            self._loads.selected(request.request_id, sel, num_computed_tokens)
        return sel.tokens, sel.is_async

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        # ``held``: children whose part of a mixed load waits for the request's next schedule
        # (LoadRule.deferred); vLLM's blocks then are the request's whole block list again.
        tokens, held = self._loads.allocate(request, blocks, num_external_tokens)
        for i, fn in self.calls["update_state_after_alloc"].items():
            if i not in held:
                fn(request, blocks, tokens.get(i, 0))

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        groups = self._loads.loaded_groups(request, self.calls["get_loaded_kv_cache_group_ids"])
        return super().get_loaded_kv_cache_group_ids(request) if groups is None else groups

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        fns = self.calls["get_external_cache_hit_sources"]
        sources = self._loads.hit_sources(request, num_external_tokens, fns)
        return super().get_external_cache_hit_sources(request, num_external_tokens) if sources is None else sources

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        if self.calls.monitor.watched:  # a child with failures: a bypassed one may come back now
            self.calls.step()
        loads = self._loads
        if loads.deferred or loads.sync_load_now:
            loads.start_step(scheduler_output, self._kv_cache_manager)
        metas: list[Any] = [None] * len(self._connectors)  # a bypassed child's slot stays None
        for i, fn in self.calls["build_connector_meta"].items():
            metas[i] = fn(scheduler_output)
        started, saves, abandoned = loads.take_announcements()
        return ComposedMetadata(self.plan.metadata.pack(metas), started, saves, abandoned)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        reported = connector_output.finished_recving
        if reported:
            connector_output.finished_recving = kept = self._loads.arrived(reported, self._completion)
            self.dropped_completions += len(reported) - len(kept)
        composed_meta = connector_output.kv_connector_worker_meta
        composed_events = connector_output.kv_cache_events
        metas = composed_meta.children if isinstance(composed_meta, ComposedWorkerMetadata) else _NONE
        events = composed_events.children if isinstance(composed_events, ComposedKVEvents) else _NONE
        try:  # each child sees only its own worker metadata and KV events
            for i, fn in self.calls["update_connector_output"].items():
                connector_output.kv_connector_worker_meta = metas.get(self.names[i])
                connector_output.kv_cache_events = events.get(self.names[i])
                fn(connector_output)
        finally:
            connector_output.kv_connector_worker_meta = composed_meta
            connector_output.kv_cache_events = composed_events

    def _finished(
        self, request: Request, calls: dict[int, Callable[..., Any]], block_ids: Any
    ) -> tuple[bool, dict[str, Any] | None]:
        results: list[dict[str, Any] | None] = [None] * len(self._connectors)
        delaying: list[int] = []
        for i, fn in calls.items():
            delay, results[i] = fn(request, block_ids)
            if delay:
                delaying.append(i)
        self._loads.finished(request.request_id, tuple(delaying) if delaying else ())
        return bool(delaying), self.plan.params.merge(results)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._finished(request, self.calls["request_finished"], block_ids)

    def request_finished_all_groups(
        self,
        request: Request,
        block_ids: tuple[list[int], ...],
    ) -> tuple[bool, dict[str, Any] | None]:
        if self._not_hma:
            if len(block_ids) != 1:
                raise ValueError(f"several KV cache groups need every child to support HMA; {self._not_hma} do not")
            return self.request_finished(request, block_ids[0])
        return self._finished(request, self.calls["request_finished_all_groups"], block_ids)

    def register_finished_partial_tail(
        self, request: Request, block_ids: tuple[list[int], ...], partial_tail_offloads: list[tuple[int, int, int]]
    ) -> bool:
        return self.calls.combined["register_finished_partial_tail"](request, block_ids, partial_tail_offloads)

    def take_events(self) -> Iterable[KVCacheEvent]:
        return self.calls.combined["take_events"]()

    def has_pending_block_frees(self) -> bool:
        return self.calls.combined["has_pending_block_frees"]()

    def has_pending_push_work(self) -> bool:
        return self.calls.combined["has_pending_push_work"]()

    def get_finished_count(self) -> int | None:
        return self.calls.combined["get_finished_count"]()

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        self.set_xfer_handshake_metadata_pp_aware({(0, tp): m for tp, m in metadata.items()})

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]
    ) -> None:
        for i, fn in self.calls["set_xfer_handshake_metadata_pp_aware"].items():
            mine = ComposedHandshakeMetadata.of_child(metadata, self.names[i])
            if mine:
                fn(mine)

    def reset_cache(self) -> bool | None:
        return self.calls.combined["reset_cache"]()


#: The name vLLM's config checks look for (``kv_connector: MultiConnector`` + module path).
MultiConnector = KVComposeConnector
