"""The call table: one declaration per member of vLLM's connector API (``KVConnectorBase_V1``).

Each :class:`Call` says which side of the engine makes it, how the composite combines the
children's answers, what shape the answer has (whose neutral answer, for a contained child, the
faults rule says: :data:`kvcompose.rules.faults.NEUTRAL`), whether vLLM makes it per layer, and
which children get it. The composite's forwarding (:mod:`kvcompose.vllm.dispatch`), its fault
containment and the test kit's fault injection (:data:`kvcompose.testing.types.FAULT_CALLS`) are
driven by it; ``tests/adapter/test_vllm_surface.py`` checks that it, the composite's members and
vLLM's ``KVConnectorBase_V1`` (the installed one, and the next one through
:mod:`kvcompose.vllm.surface`) name the same calls.

Written without vLLM, like :mod:`kvcompose.vllm.args`: the test kit's connector types read it
where vLLM is not installed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvcompose.rules.faults import Answer

#: Who asks: the scheduler's connector, a worker's, or vLLM before any instance exists (a
#: classmethod, combined over the children's classes by :mod:`kvcompose.vllm.children`).
Side = Literal["scheduler", "worker", "class"]

#: How the composite combines the children's answers, and so which dispatch idiom it uses
#: (:class:`kvcompose.vllm.dispatch.Dispatch`):
#:
#: - ``each``: the composite's own loop over ``calls[m]`` (each child its own argument, or its
#:   answer put by child index into a rule's decision); ``rule``: the same table, from which a
#:   rule asks the children it chooses, by index (so no child is left out of it);
#: - ``per-layer``: ``calls.per_layer[m]``, the callables alone, in vLLM's per-layer hot loop;
#: - the rest: ``calls.combined[m](*args)``: ``any`` / ``all`` (no child answers ``False``),
#:   ``union`` (of sets), ``concat`` (of iterables), ``named`` (the answers that are not
#:   ``None``, by child name), ``one`` (``named``, at most one child answering), ``agreed`` (the
#:   one answer every child gives), ``every`` (every child that has the call, bypassed ones
#:   included, uncontained; then one error naming every child that raised), ``merge`` (a call
#:   this table does not know: answers merged by type, :func:`kvcompose.merge.merge_values`).
#:
#: Not forwarded to a child's same call: ``via`` (the composite answers from another call of
#: the table, named by :attr:`Call.via`) and ``classes`` (classmethods).
Combine = Literal[
    "each",
    "rule",
    "per-layer",
    "any",
    "all",
    "union",
    "concat",
    "named",
    "one",
    "agreed",
    "every",
    "merge",
    "via",
    "classes",
]

#: Which children get the call: every active child in YAML order, the store rule's targets, the
#: child that owns host-buffer copies, or every active child with the P/D transport first (its
#: reads are in flight while the others copy).
To = Literal["all", "store-targets", "host-buffer-owner", "pd-first"]

Kind = Literal["method", "classmethod", "property"]

#: The combinations that drop a child's neutral answer: a child whose implementation answers
#: only that (and does nothing) need not be called.
IGNORES_NEUTRAL: frozenset[Combine] = frozenset({"each", "per-layer", "any", "union", "concat", "named", "one"})


@dataclass(frozen=True)
class Call:
    """One member of vLLM's connector API, as the composite forwards it."""

    side: Side
    combine: Combine
    #: The shape of a child's answer; its neutral answer is what a contained child answers.
    answer: Answer = "none"
    to: To = "all"
    kind: Kind = "method"
    #: vLLM's base class answers the neutral answer: a child that inherits it is not called.
    base_neutral: bool = False
    #: For ``combine="via"``: the call of this table the composite answers from.
    via: str | None = None

    @property
    def per_layer(self) -> bool:
        """vLLM makes the call once per layer per step."""
        return self.combine == "per-layer"

    @property
    def forwarded(self) -> bool:
        """Each child's own implementation of the call is called (and may raise)."""
        return self.combine not in ("via", "classes")


S, W = "scheduler", "worker"

#: Every public member of ``KVConnectorBase_V1`` (vLLM 0.32 and 0.33) but the two whose base
#: implementation is right for the composite too (:data:`kvcompose.vllm.surface.NOT_FORWARDED`).
CALLS: dict[str, Call] = {
    # ---- scheduler side
    "get_num_new_matched_tokens": Call(S, "rule", "hit"),
    "update_state_after_alloc": Call(S, "each"),
    "get_loaded_kv_cache_group_ids": Call(S, "rule"),
    "get_external_cache_hit_sources": Call(S, "rule", "sources"),
    "build_connector_meta": Call(S, "each"),
    "update_connector_output": Call(S, "each"),
    "request_finished": Call(S, "each", "finished"),
    "request_finished_all_groups": Call(S, "each", "finished"),
    "register_finished_partial_tail": Call(S, "any", "flag", base_neutral=True),
    "on_new_request": Call(S, "each"),
    "bind_kv_cache_manager": Call(S, "each"),
    "bind_gpu_block_pool": Call(S, "each"),
    "take_events": Call(S, "concat", "events", base_neutral=True),
    "has_pending_block_frees": Call(S, "any", "flag", base_neutral=True),
    "has_pending_push_work": Call(S, "any", "flag", base_neutral=True),
    "get_finished_count": Call(S, "agreed"),
    "reset_cache": Call(S, "all"),
    "set_xfer_handshake_metadata_pp_aware": Call(S, "each"),
    "set_xfer_handshake_metadata": Call(S, "via", via="set_xfer_handshake_metadata_pp_aware"),
    "supports_divergent_local_hybrid_hits": Call(S, "all", "flag", kind="property"),
    "requires_kv_delivery": Call(S, "any", "flag", kind="property"),
    # ---- worker side
    "register_kv_caches": Call(W, "each"),
    "set_host_xfer_buffer_ops": Call(W, "each", to="host-buffer-owner"),
    "get_mem_pool_context": Call(W, "one"),
    "bind_connector_metadata": Call(W, "each"),
    "handle_preemptions": Call(W, "each"),
    "start_load_kv": Call(W, "each", to="pd-first"),
    "wait_for_layer_load": Call(W, "per-layer"),
    "save_kv_layer": Call(W, "per-layer", to="store-targets"),
    "wait_for_save": Call(W, "each", to="store-targets"),
    "finish_forward": Call(W, "each"),
    "reset_capture_state": Call(W, "each"),
    "clear_connector_metadata": Call(W, "each"),
    "get_transfer_results": Call(W, "each"),
    "get_finished": Call(W, "via", via="get_transfer_results"),
    "get_block_ids_with_load_errors": Call(W, "union", "block-ids", base_neutral=True),
    "get_kv_connector_stats": Call(W, "named"),
    "get_kv_connector_kv_cache_events": Call(W, "named"),
    "get_handshake_metadata": Call(W, "named"),
    "build_connector_worker_meta": Call(W, "named"),
    "shutdown": Call(W, "every"),
    # sleep mode (vLLM 0.33; kvcompose.vllm.surface.SLEEP_MODE_CALLS)
    "unregister_kv_caches": Call(W, "every"),
    "restore_kv_caches": Call(W, "every"),
    # ---- asked of the class before any instance exists (kvcompose.vllm.children.ClassLevelAnswers)
    "get_required_kvcache_layout": Call("class", "classes", kind="classmethod"),
    "requires_piecewise_for_cudagraph": Call("class", "classes", kind="classmethod"),
    "supports_sleep_mode": Call("class", "classes", kind="classmethod"),
    "build_kv_connector_stats": Call("class", "classes", kind="classmethod"),
    "build_prom_metrics": Call("class", "classes", kind="classmethod"),
}

#: A call of a newer vLLM that this table does not know (:func:`kvcompose.vllm.surface.forward_unknown_calls`).
UNKNOWN = Call(W, "merge")

#: The calls whose child implementation the composite calls on a child instance: what a test
#: double can fail on (the kit's fault injection).
FORWARDED: frozenset[str] = frozenset(name for name, c in CALLS.items() if c.forwarded and c.kind == "method")

#: The calls whose children's answers the dispatch combines (``calls.combined[m]``).
COMBINED: tuple[str, ...] = tuple(
    name for name, c in CALLS.items() if c.forwarded and c.combine not in ("each", "rule", "per-layer")
)

#: The calls vLLM makes once per layer per step.
PER_LAYER: tuple[str, ...] = tuple(name for name, c in CALLS.items() if c.per_layer)


def call(name: str) -> Call:
    """The declaration of ``name`` (:data:`UNKNOWN` for a call of a newer vLLM)."""
    return CALLS.get(name, UNKNOWN)
