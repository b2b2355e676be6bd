"""The children as vLLM sees them: the plan, their configs and classes, from a composite's
``KVTransferConfig`` (built once per process: :func:`composite_of`).

Also the class-level answers vLLM asks of a connector class before any instance exists
(KV layout, CUDA-graph mode, Prometheus metrics), each combined over the children's classes.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
from dataclasses import dataclass
from typing import Any

from vllm.config import VllmConfig
from vllm.config.kv_transfer import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.logger import init_logger
from vllm.v1.kv_cache_interface import KVCacheConfig

from kvcompose.catalog import Plan
from kvcompose.compose import build
from kvcompose.config import to_builtins
from kvcompose.contract import EngineFacts
from kvcompose.plugins import get_plugins, tracing_enabled
from kvcompose.rules.checks import layout_conflict
from kvcompose.vllm.args import listed_entries
from kvcompose.vllm.dropin import announce_dropin, is_dropin, refuse_mismatch, source
from kvcompose.vllm.health import STATS_KEY as HEALTH_KEY
from kvcompose.vllm.health import ChildStatePromMetrics
from kvcompose.vllm.loadstats import STATS_KEY as LOADS_KEY
from kvcompose.vllm.loadstats import ChildLoadPromMetrics
from kvcompose.vllm.metadata import ComposedStats
from kvcompose.vllm.surface import sleep_mode

#: Under vLLM's logger, whose handler and ``VLLM_LOGGING_LEVEL`` an engine's log already has.
vllm_log = init_logger("vllm.kvcompose")


@dataclass(frozen=True)
class Composite:
    """A composite's plan and its children's configs, read from its ``KVTransferConfig`` once per
    process (:func:`composite_of`): the instance and every class-level answer share it."""

    plan: Plan
    #: Each child's ``KVTransferConfig`` kwargs, in YAML order: as listed, or as a drop-in renders them.
    entries: tuple[dict[str, Any], ...]
    #: The composite's ``engine_id``, each child's unless the child sets its own.
    engine_id: str | None
    #: Started from vLLM's plain ``connectors`` list, without kvcompose's entry.
    dropin: bool

    @functools.cached_property
    def configs(self) -> tuple[KVTransferConfig, ...]:
        """Each child's own ``KVTransferConfig``. vLLM's MultiConnector passes ``engine_id`` twice
        when a child sets it (a TypeError); merging the dicts lets the child's value win."""
        return tuple(KVTransferConfig(**{"engine_id": self.engine_id, **entry}) for entry in self.entries)

    def announce(self) -> None:
        """Say, once per process, what a drop-in config was composed into (in vLLM's log)."""
        if self.dropin:
            announce_dropin(to_builtins(self.plan.composition), vllm_log)

    def child_classes(self, vllm_config: VllmConfig) -> list[tuple[type[KVConnectorBase_V1], VllmConfig]]:
        """Each child's connector class, with a copy of ``vllm_config`` holding the child's config.

        The child's config carries the engine's ``kv_load_failure_policy`` (the composition's
        ``load_failure``): vLLM's scheduler applies only the engine's, and a child that acts on
        it (the nixl type ends a refused request with an error under ``fail``) must see that one,
        not the default a child entry gets (vLLM's MultiConnector hands its children the default).
        """
        ktc = vllm_config.kv_transfer_config
        policy = ktc.kv_load_failure_policy if ktc is not None else None
        out = []
        for cktc in self.configs:
            cfg = copy.copy(vllm_config)
            if policy is not None and cktc.kv_load_failure_policy != policy:
                cktc = copy.copy(cktc)  # the cached configs are shared by every composite of this plan
                cktc.kv_load_failure_policy = policy
            cfg.kv_transfer_config = cktc
            out.append((KVConnectorFactory.get_connector_class(cktc), cfg))
        return out


#: The first composite of each plan (:func:`_plan_key`), and every composite by plan and engine id.
_plans: dict[tuple[Any, ...], Composite] = {}
_composites: dict[tuple[Any, ...], Composite] = {}


def _plan_key(extra: dict[str, Any], kv_role: str | None) -> tuple[Any, ...]:
    """What a plan depends on: the config, the composite's ``kv_role`` only for a drop-in (whose
    entries may leave theirs out; kvcompose's own entry carries every child's), the plugin set
    and ``KVCOMPOSE_TRACE``. Never the engine id: only the children's configs carry it."""
    role = kv_role if is_dropin(extra) else None
    return (json.dumps(extra, sort_keys=True, default=repr), role, get_plugins(), tracing_enabled())


def composite_of(
    extra_config: dict[str, Any] | None, kv_role: str | None = None, engine_id: str | None = None
) -> Composite:
    """The plan of the composition embedded in vLLM's ``kv_connector_extra_config`` (or made of a
    MultiConnector ``connectors`` list taken as it is), built on first use per process and plan
    (:func:`_plan_key`); a composite of another engine id shares it.

    The checks import the modules the children name: the engine imports them next anyway, and a
    module that fails to import is then a located error instead of vLLM's traceback. The listed
    entries must be those the composition renders (:func:`~kvcompose.vllm.dropin.refuse_mismatch`).
    """
    extra = extra_config or {}
    plan_key = _plan_key(extra, kv_role)
    found = _composites.get((plan_key, engine_id))
    if found is not None:
        return found
    first = _plans.get(plan_key)
    if first is not None:
        found = dataclasses.replace(first, engine_id=engine_id)
    else:
        dropin = is_dropin(extra)
        plan = build(source(extra, kv_role), import_modules=True)
        if dropin:
            entries = [c.vllm_config() for c in plan.children]
        else:
            entries = listed_entries(extra)
            refuse_mismatch(plan, entries)
        found = _plans[plan_key] = Composite(plan, tuple(entries), engine_id, dropin)
    _composites[(plan_key, engine_id)] = found
    return found


def composite_of_extra(extra_config: dict[str, Any] | None) -> Composite:
    """For a class-level question vLLM asks with ``kv_connector_extra_config`` alone: a composite
    this process already built for that config, whatever its role and engine id, else
    :func:`composite_of` without them. A drop-in's plan depends on the role only for its
    children's roles, which no class-level question reads."""
    extra = extra_config or {}
    config, _, *rest = _plan_key(extra, None)
    for (key_config, _, *key_rest), found in _plans.items():
        if key_config == config and key_rest == rest:
            return found
    return composite_of(extra)


def composite_of_config(vllm_config: VllmConfig) -> Composite:
    """:func:`composite_of` the composite's ``KVTransferConfig`` in ``vllm_config``."""
    assert vllm_config.kv_transfer_config is not None
    return composite_of_transfer(vllm_config.kv_transfer_config)


def composite_of_transfer(ktc: KVTransferConfig) -> Composite:
    """:func:`composite_of` a composite's ``KVTransferConfig``."""
    return composite_of(ktc.kv_connector_extra_config, ktc.kv_role, ktc.engine_id)


def engine_facts(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> EngineFacts:
    """What the load rule learns of the engine it serves (:meth:`LoadRule.bind`)."""
    groups = len(kv_cache_config.kv_cache_groups) if kv_cache_config is not None else 1
    parallel = vllm_config.parallel_config
    return EngineFacts(
        vllm_config.cache_config.block_size,
        max(groups, 1),
        parallel.decode_context_parallel_size * parallel.prefill_context_parallel_size,
    )


class ClassLevelAnswers:
    """The connector classmethods vLLM calls before any instance exists, each combined over the
    children's classes (the composite inherits them)."""

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        return required_kvcache_layout(vllm_config)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return requires_piecewise_for_cudagraph(extra_config)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: KVTransferConfig) -> bool:
        """Sleep mode (vLLM 0.33) when every child supports it, as vLLM's MultiConnector decides."""
        answers = sleep_mode_support(kv_transfer_config)
        return bool(answers) and all(answers.values())

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
        return ComposedPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


def sleep_mode_support(ktc: KVTransferConfig) -> dict[str, bool]:
    """Per child name, whether its connector class supports sleep mode (vLLM 0.33's
    ``supports_sleep_mode``, asked with the child's own config; no such classmethod: no)."""
    composite = composite_of_transfer(ktc)
    return {
        name: sleep_mode(KVConnectorFactory.get_connector_class(cktc), cktc)
        for name, cktc in zip(composite.plan.names, composite.configs, strict=True)
    }


def required_kvcache_layout(vllm_config: VllmConfig) -> str | None:
    """The one layout the children need (None: any); raises when they disagree."""
    composite = composite_of_config(vllm_config)
    layouts = {
        name: cls.get_required_kvcache_layout(cfg)
        for name, (cls, cfg) in zip(composite.plan.names, composite.child_classes(vllm_config), strict=True)
    }
    conflict = layout_conflict(layouts)
    if conflict:
        raise ValueError(conflict)
    return next((layout for layout in layouts.values() if layout), None)


def requires_piecewise_for_cudagraph(extra_config: dict[str, Any]) -> bool:
    """Whether any child needs piecewise CUDA graphs, each asked with its own extra config."""
    for cktc in composite_of_extra(extra_config).configs:
        child_cls = KVConnectorFactory.get_connector_class(cktc)
        if child_cls.requires_piecewise_for_cudagraph(cktc.kv_connector_extra_config):
            return True
    return False


class ComposedPromMetrics(KVConnectorPromMetrics):
    """Dispatches each child's stats, found by the child's name, to the Prometheus metrics of
    its class (one metric family per class: two children of one class share it)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        by_class: dict[type[KVConnectorBase_V1], KVConnectorPromMetrics | None] = {}
        self._by_name: dict[str, KVConnectorPromMetrics] = {}
        composite = composite_of_config(vllm_config)
        for name, (child_cls, cfg) in zip(composite.plan.names, composite.child_classes(vllm_config), strict=True):
            if child_cls not in by_class:  # a second registration of one family would clash
                by_class[child_cls] = child_cls.build_prom_metrics(
                    cfg, metric_types, labelnames, per_engine_labelvalues
                )
            prom = by_class[child_cls]
            if prom is not None:
                self._by_name[name] = prom
        for key, prom_cls in ((LOADS_KEY, ChildLoadPromMetrics), (HEALTH_KEY, ChildStatePromMetrics)):
            self._by_name[key] = prom_cls(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, entry in transfer_stats_data.items():
            prom = self._by_name.get(name)
            if prom is not None and isinstance(entry, dict):
                prom.observe(entry["data"], engine_idx)
