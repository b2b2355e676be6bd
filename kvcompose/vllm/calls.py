"""The composite's call table: per engine call, the callables of the children that get it.

Every call the composite forwards to a child goes through this table, so tracing
(``KVCOMPOSE_TRACE``) and fault containment (the ``faults`` rule) apply to all of them. The table
is built once per method on first use and rebuilt when a contained child is bypassed or, under a
breaker, let back.
"""

from __future__ import annotations

import dis
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

from kvcompose.catalog import Plan
from kvcompose.rules.contract import FaultMonitor, FaultsRule
from kvcompose.vllm.surface import provides

log = logging.getLogger("kvcompose.vllm")
trace_log = logging.getLogger("kvcompose.trace")

Entry = tuple[int, Callable[..., Any]]

#: What a child that failed (and was disabled) answers in place of a real answer: vLLM's
#: "nothing" for that call. Unlisted calls answer ``None``.
NEUTRAL: dict[str, Any] = {
    "get_num_new_matched_tokens": (0, False),
    "request_finished": (False, None),
    "request_finished_all_groups": (False, None),
    "get_finished": (None, None),
    "has_pending_block_frees": False,
    "has_pending_push_work": False,
    "register_finished_partial_tail": False,
    "take_events": (),
    "get_block_ids_with_load_errors": frozenset(),
    "get_external_cache_hit_sources": {},
}

#: Calls whose implementation in vLLM's base class answers a constant that the composite's
#: combination ignores (an empty set or tuple, ``False``). A child that inherits one unchanged is
#: not called (docs/performance.md: worker step, before/after).
CONSTANT_IN_BASE = frozenset(
    {
        "get_block_ids_with_load_errors",
        "take_events",
        "has_pending_block_frees",
        "register_finished_partial_tail",
    }
)

#: Calls whose ``None`` answer the composite's combination drops (or whose answer it ignores). A
#: child whose implementation of one has an empty body (vLLM's base class for most of them,
#: NixlConnector's and the CPU tier's per-layer hooks) does nothing and answers ``None``, so it
#: is not called (docs/performance.md: seventh round).
NONE_IS_NOTHING = frozenset(
    {
        "bind_connector_metadata",
        "bind_gpu_block_pool",
        "bind_kv_cache_manager",
        "build_connector_meta",
        "build_connector_worker_meta",
        "clear_connector_metadata",
        "finish_forward",
        "get_handshake_metadata",
        "get_kv_connector_kv_cache_events",
        "get_kv_connector_stats",
        "get_mem_pool_context",
        "handle_preemptions",
        "on_new_request",
        "register_kv_caches",
        "reset_capture_state",
        "save_kv_layer",
        "set_host_xfer_buffer_ops",
        "set_xfer_handshake_metadata_pp_aware",
        "start_load_kv",
        "update_connector_output",
        "update_state_after_alloc",
        "wait_for_layer_load",
        "wait_for_save",
    }
)

#: The instructions of a function that does nothing and answers ``None`` (``pass``, ``...``, a
#: docstring alone or a bare ``return``), as CPython 3.11 and 3.12+ compile it.
_EMPTY_BODIES = ([("LOAD_CONST", None), ("RETURN_VALUE", None)], [("RETURN_CONST", None)])
_NOT_BODY = frozenset({"RESUME", "NOP", "CACHE"})


def has_empty_body(fn: Callable[..., Any]) -> bool:
    """Whether calling ``fn`` (a function or bound method) does nothing but answer ``None``."""
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    if code is None:  # a builtin, a partial, a mock: it may do something
        return False
    body = [(ins.opname, ins.argval) for ins in dis.get_instructions(code) if ins.opname not in _NOT_BODY]
    return body in _EMPTY_BODIES


#: Calls vLLM makes once per layer per step.
PER_LAYER = ("wait_for_layer_load", "save_kv_layer")


class ChildFailed(RuntimeError):
    """A child connector raised; names the child and the engine call."""


class CallTable(dict[str, list[Entry]]):
    """``table[method]``: ``[(child index, callable), ...]`` in YAML order (one child first where
    ``first`` says so), for the active children that get ``method``.

    A dict filled on first use of each method (``__missing__``), so a forwarded call costs one
    dict subscription (docs/performance.md: worker step, before/after).

    :param only: per method, the children that get it (the store rule's targets for the save
        hooks, the host-buffer owner for ``set_host_xfer_buffer_ops``); every active child
        otherwise.
    :param on_fault: called with (child, method) when a contained child raised (after it was
        bypassed here, when the monitor says so); the composite settles what that child owed.
    :param monitor: the faults rule's monitor of this connector instance: it says when a child
        that raised is bypassed and when it is called again (:meth:`step`).
    :param first: per method, the child called before the others (YAML order otherwise).
    """

    def __init__(
        self,
        children: Sequence[KVConnectorBase_V1],
        names: Sequence[str],
        faults: FaultsRule,
        trace: bool,
        only: Mapping[str, Sequence[int]],
        on_fault: Callable[[int, str], None],
        monitor: FaultMonitor | None = None,
        first: Mapping[str, int] | None = None,
    ) -> None:
        super().__init__()
        self._first = dict(first or {})
        self.monitor = monitor if monitor is not None else faults.monitor()
        self._children = list(children)
        self._names = tuple(names)
        self._faults = faults
        self._trace = trace
        self._only = dict(only)
        self._on_fault = on_fault
        self.disabled: set[int] = set()
        self._by_child: dict[str, dict[int, Callable[..., Any]]] = {}
        #: The calls made per layer, as a plain dict of callables without their child index:
        #: CPython specialises subscription of an exact dict only (docs/performance.md: worker
        #: step, before/after).
        self.per_layer: dict[str, list[Callable[..., Any]]] = {}
        #: The active children, in YAML order.
        self.active: tuple[int, ...] = tuple(range(len(self._children)))
        self._fill_per_layer()

    @classmethod
    def for_plan(
        cls, children: Sequence[KVConnectorBase_V1], plan: Plan, on_fault: Callable[[int, str], None]
    ) -> CallTable:
        """The table of a composite over ``children``: the save hooks to the store rule's
        targets, vLLM's host-buffer copy op to the child that owns host-buffer copies, and the
        P/D transport's ``start_load_kv`` before the other children's: its reads are in flight
        while they copy, instead of waiting for their copies on the engine's thread."""
        host = plan.host_buffer_owner
        pd = plan.pd_transport
        return cls(
            children,
            plan.names,
            plan.faults,
            plan.trace,
            only={
                "save_kv_layer": plan.store.targets,
                "wait_for_save": plan.store.targets,
                "set_host_xfer_buffer_ops": () if host is None else (host,),
            },
            on_fault=on_fault,
            first={} if pd is None else {"start_load_kv": pd.index},
        )

    def __missing__(self, method: str) -> list[Entry]:
        entries = self[method] = self._resolve(method, self.active)
        return entries

    def by_child(self, method: str) -> dict[int, Callable[..., Any]]:
        """``method``'s callables keyed by child index (for rules that ask children by index)."""
        try:
            return self._by_child[method]
        except KeyError:
            fns = self._by_child[method] = dict(self[method])
            return fns

    def named(self, method: str, *args: Any) -> dict[str, Any]:
        """Call ``method`` on its children; their answers that are not ``None``, by child name."""
        out = {}
        for i, fn in self[method]:
            answer = fn(*args)
            if answer is not None:
                out[self._names[i]] = answer
        return out

    def agreed(self, method: str) -> Any:
        """The one answer the children give to ``method`` (``None`` when any answers ``None``,
        or none is asked); a ``ValueError`` naming each child's answer when they differ."""
        answers = {self._names[i]: fn() for i, fn in self[method]}
        values = set(answers.values())
        if len(values - {None}) > 1:
            raise ValueError(f"children answer {method} differently: {answers}")
        return None if None in values else next(iter(values), None)

    def every(self, method: str) -> list[Entry]:
        """``method`` on every child that has it, bypassed ones included, uncontained
        (``shutdown``, the sleep-mode calls: a child bypassed by the faults rule still gets them,
        and the caller reports every error)."""
        return [
            (i, self._bind(i, method, contain=False))
            for i in range(len(self._children))
            if provides(self._children[i], method)
        ]

    def call_every(self, method: str) -> None:
        """``method`` on every child (:meth:`every`); each child gets its call whatever the others
        raised, then one :class:`ChildFailed` names every child that raised."""
        errors: list[tuple[str, BaseException]] = []
        for i, fn in self.every(method):
            try:
                fn()
            except Exception as exc:
                log.exception("connector %s failed in %s", self._names[i], method)
                errors.append((self._names[i], exc))
        if errors:
            detail = ", ".join(f"{n} ({e!r})" for n, e in errors)
            raise ChildFailed(f"{method} failed in {detail}") from errors[0][1]

    def disable(self, child: int) -> None:
        """Stop calling ``child``: every method is resolved again without it."""
        self.disabled.add(child)
        self._rebuild()

    def enable(self, child: int) -> None:
        """Call ``child`` again: every method is resolved again with it, in YAML order."""
        self.disabled.discard(child)
        self._rebuild()

    def step(self) -> tuple[int, ...]:
        """A step starts: tell the monitor, and call again the children it lets back."""
        back = self.monitor.step()
        for child in back:
            self.enable(child)
        return back

    def _rebuild(self) -> None:
        self.active = tuple(i for i in range(len(self._children)) if i not in self.disabled)
        self.clear()
        self._by_child.clear()
        self._fill_per_layer()

    def _fill_per_layer(self) -> None:
        for method in PER_LAYER:
            self.per_layer[method] = [fn for _, fn in self._resolve(method, self.active)]

    def _resolve(self, method: str, among: Sequence[int]) -> list[Entry]:
        only = self._only.get(method)
        first = self._first.get(method)
        if first is not None and first in among:
            among = [first, *(i for i in among if i != first)]
        return [
            (i, self._bind(i, method))
            for i in among
            if (only is None or i in only) and provides(self._children[i], method) and not self._does_nothing(i, method)
        ]

    def _does_nothing(self, i: int, method: str) -> bool:
        """Whether ``child i``'s ``method`` is known to do nothing the composite would use."""
        if self._trace:  # tracing logs every child call
            return False
        fn = getattr(self._children[i], method)  # an instance attribute (a test's patch) is the child's own
        if method in NONE_IS_NOTHING:
            return has_empty_body(fn)
        return method in CONSTANT_IN_BASE and getattr(fn, "__func__", None) is getattr(KVConnectorBase_V1, method)

    def _bind(self, i: int, method: str, contain: bool = True) -> Callable[..., Any]:
        fn: Callable[..., Any] = getattr(self._children[i], method)
        if self._trace:
            fn = _traced(self._names[i], method, fn)
        if contain and self._faults.contains(i):
            fn = self._contained(i, method, fn)
        return fn

    def _contained(self, i: int, method: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        neutral = NEUTRAL.get(method)
        monitor = self.monitor

        def contained(*args: Any, **kwargs: Any) -> Any:
            if i in self.disabled:  # an entry captured before the child was bypassed
                return neutral
            try:
                answer = fn(*args, **kwargs)
            except Exception:
                bypass = monitor.failed(i)
                log.warning(
                    "connector %s failed in %s%s",
                    self._names[i],
                    method,
                    "; it is bypassed" if bypass else "; contained",
                    exc_info=True,
                )
                if bypass:
                    self.disable(i)
                self._on_fault(i, method)
                return neutral
            if i in monitor.watched:  # on probation: the monitor counts calls that succeeded
                monitor.succeeded(i)
            return answer

        return contained


def _traced(name: str, method: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def traced(*args: Any, **kwargs: Any) -> Any:
        result = fn(*args, **kwargs)
        trace_log.info("%s.%s -> %r", name, method, result)
        return result

    return traced
