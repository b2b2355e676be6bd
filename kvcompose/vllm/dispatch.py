"""The composite's dispatch: per engine call, the callables of the children that get it.

Every call the composite forwards to a child goes through here, as the call table
(:mod:`kvcompose.vllm.calls`) declares it, so tracing (``KVCOMPOSE_TRACE``) and fault containment
(the ``faults`` rule) apply to all of them. The composite uses three idioms, one per kind of
combination (:data:`kvcompose.vllm.calls.Combine`):

- ``calls[m]``: ``{child index: callable}`` in call order, for the composite's own loop (each
  child its own argument, or its answer by index into a rule) and for a rule that asks the
  children by index;
- ``calls.per_layer[m]``: the callables alone, for vLLM's per-layer calls;
- ``calls.combined[m](*args)``: the children's answers combined as the table says.

Each is resolved once per call (``calls[m]`` on first use), and again when a contained child is
bypassed or, under a breaker, let back.
"""

from __future__ import annotations

import dis
import functools
import logging
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

from kvcompose.catalog import Plan
from kvcompose.merge import merge_values
from kvcompose.rules.contract import FaultMonitor, FaultsRule
from kvcompose.rules.faults import NEUTRAL
from kvcompose.vllm.calls import CALLS, COMBINED, IGNORES_NEUTRAL, PER_LAYER, Call, call
from kvcompose.vllm.surface import provides

log = logging.getLogger("kvcompose.vllm")
trace_log = logging.getLogger("kvcompose.trace")

Fn = Callable[..., Any]

#: The instructions of a function that does nothing and answers ``None`` (``pass``, ``...``, a
#: docstring alone or a bare ``return``), as CPython 3.11 and 3.12+ compile it.
_EMPTY_BODIES = ([("LOAD_CONST", None), ("RETURN_VALUE", None)], [("RETURN_CONST", None)])
_NOT_BODY = frozenset({"RESUME", "NOP", "CACHE"})


def has_empty_body(fn: Fn) -> bool:
    """Whether calling ``fn`` (a function or bound method) does nothing but answer ``None``."""
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    if code is None:  # a builtin, a partial, a mock: it may do something
        return False
    body = [(ins.opname, ins.argval) for ins in dis.get_instructions(code) if ins.opname not in _NOT_BODY]
    return body in _EMPTY_BODIES


class ChildFailed(RuntimeError):
    """A child connector raised; names the child and the engine call."""


class Dispatch(dict[str, dict[int, Fn]]):
    """``calls[method]``: ``{child index: callable}`` in call order (YAML order, one child first
    where the table says so), for the active children that get ``method``.

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
        self.names = tuple(names)
        self._faults = faults
        self._trace = trace
        self._only = dict(only)
        self._on_fault = on_fault
        self.disabled: set[int] = set()
        #: The per-layer calls' callables without their child index, in an exact dict: CPython
        #: specialises subscription of an exact dict only (docs/performance.md: worker step, before/after).
        self.per_layer: dict[str, list[Fn]] = {}
        #: Per combined call, one callable that asks the children and combines their answers (an
        #: exact dict, as :attr:`per_layer`; each resolved on first use).
        self.combined: dict[str, Fn] = {}
        #: The active children, in YAML order.
        self.active: tuple[int, ...] = tuple(range(len(self._children)))
        self._fill()

    @classmethod
    def for_plan(
        cls, children: Sequence[KVConnectorBase_V1], plan: Plan, on_fault: Callable[[int, str], None]
    ) -> Dispatch:
        """The dispatch of a composite over ``children``, routed as the call table's ``to`` says:
        the save hooks to the store rule's targets, vLLM's host-buffer copy op to the child that
        owns host-buffer copies, and the P/D transport first where the table says ``pd-first``."""
        host = plan.host_buffer_owner
        pd = plan.pd_transport
        routes: dict[str, Sequence[int]] = {
            "store-targets": plan.store.targets,
            "host-buffer-owner": () if host is None else (host,),
        }
        only: dict[str, Sequence[int]] = {}
        first: dict[str, int] = {}
        for name, c in CALLS.items():
            if c.to in routes:
                only[name] = routes[c.to]
            elif c.to == "pd-first" and pd is not None:
                first[name] = pd.index
        return cls(children, plan.names, plan.faults, plan.trace, only=only, on_fault=on_fault, first=first)

    def __missing__(self, method: str) -> dict[int, Fn]:
        entries = self[method] = self._resolve(method, self.active)
        return entries

    def every(self, method: str) -> list[tuple[int, Fn]]:
        """``method`` on every child that has it, bypassed ones included, uncontained
        (``shutdown``, the sleep-mode calls: a child bypassed by the faults rule still gets them,
        and the caller reports every error)."""
        return [
            (i, self._bind(i, method, contain=False))
            for i in range(len(self._children))
            if provides(self._children[i], method)
        ]

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
        self.combined.clear()
        self._fill()

    def _fill(self) -> None:
        for method in PER_LAYER:
            self.per_layer[method] = list(self._resolve(method, self.active).values())
        for method in COMBINED:
            self.combined[method] = self._on_first_use(method)

    def _on_first_use(self, method: str) -> Fn:
        """A stand-in for ``combined[method]`` that resolves it when first called: a test may
        patch a child instance between construction and the first call."""

        def first(*args: Any, **kwargs: Any) -> Any:
            fn = self.combined[method] = _combiner(self, method)
            return fn(*args, **kwargs)

        return first

    def combiner(self, method: str) -> Fn:
        """``combined[method]``, made on first use for a call the table does not know (a newer
        vLLM's, answers merged by type)."""
        fn = self.combined.get(method)
        if fn is None:
            fn = self.combined[method] = _combiner(self, method)
        return fn

    def _resolve(self, method: str, among: Sequence[int]) -> dict[int, Fn]:
        only = self._only.get(method)
        first = self._first.get(method)
        if first is not None and first in among:
            among = [first, *(i for i in among if i != first)]
        c = call(method)
        has = hasattr if c.kind == "property" else provides
        return {
            i: self._bind(i, method)
            for i in among
            if (only is None or i in only) and has(self._children[i], method) and not self._does_nothing(i, c, method)
        }

    def _does_nothing(self, i: int, c: Call, method: str) -> bool:
        """Whether child ``i``'s ``method`` is known to answer only the neutral answer, which
        the call's combination drops (docs/performance.md: worker step, before/after)."""
        if self._trace or c.combine not in IGNORES_NEUTRAL or c.kind != "method":  # tracing logs every child call
            return False
        fn = getattr(self._children[i], method)  # an instance attribute (a test's patch) is the child's own
        if c.base_neutral and getattr(fn, "__func__", None) is getattr(KVConnectorBase_V1, method, None):
            return True
        return NEUTRAL[c.answer] is None and has_empty_body(fn)

    def _bind(self, i: int, method: str, contain: bool = True) -> Fn:
        child = self._children[i]
        fn: Fn = (
            functools.partial(getattr, child, method) if call(method).kind == "property" else getattr(child, method)
        )
        if self._trace:
            fn = _traced(self.names[i], method, fn)
        if contain and self._faults.contains(i):
            fn = self._contained(i, method, fn)
        return fn

    def _contained(self, i: int, method: str, fn: Fn) -> Fn:
        neutral = NEUTRAL[call(method).answer]
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
                    self.names[i],
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


def _combiner(table: Dispatch, method: str) -> Fn:
    combine = call(method).combine
    names = table.names
    if combine == "every":
        return functools.partial(_call_every, table, method)
    entries = tuple(table[method].items())
    fns = tuple(fn for _, fn in entries)
    if call(method).kind == "property" and all(type(fn) is functools.partial for fn in fns):
        return _read(combine, method, tuple(fn.args[0] for fn in fns))
    if combine == "any":

        def any_(*args: Any) -> bool:
            found = False
            for fn in fns:  # every child is asked, as vLLM's MultiConnector asks them
                if fn(*args):
                    found = True
            return found

        return any_
    if combine == "all":

        def all_(*args: Any) -> bool:
            ok = True
            for fn in fns:
                if fn(*args) is False:
                    ok = False
            return ok

        return all_
    if combine == "union":

        def union(*args: Any) -> set[Any]:
            out: set[Any] = set()
            for fn in fns:
                out |= fn(*args)
            return out

        return union
    if combine == "concat":
        if not fns:
            return lambda *args: ()
        if len(fns) == 1:  # one child: its own iterable, no list of ours around it
            return fns[0]

        def concat(*args: Any) -> list[Any]:
            out: list[Any] = []
            for fn in fns:
                out.extend(fn(*args))
            return out

        return concat
    if combine in ("named", "one"):
        named_entries = tuple((names[i], fn) for i, fn in entries)

        def named(*args: Any) -> dict[str, Any]:
            out = {}
            for name, fn in named_entries:
                answer = fn(*args)
                if answer is not None:
                    out[name] = answer
            return out

        if combine == "named":
            return named

        def one(*args: Any) -> Any:
            found = named(*args)
            if len(found) > 1:
                raise ValueError(f"children {list(found)} each answer {method}; at most one may")
            return next(iter(found.values()), None)

        return one
    if combine == "agreed":

        def agreed(*args: Any) -> Any:
            answers = {names[i]: fn(*args) for i, fn in entries}
            values = set(answers.values())
            if len(values - {None}) > 1:
                raise ValueError(f"children answer {method} differently: {answers}")
            return None if None in values else next(iter(values), None)

        return agreed
    if combine == "merge":
        return lambda *args, **kwargs: merge_values([fn(*args, **kwargs) for fn in fns])
    raise TypeError(f"{method} is combined by the composite's own loop ({combine!r}): use calls[{method!r}]")


def _read(combine: str, name: str, children: tuple[Any, ...]) -> Fn:
    """A property of children neither traced nor contained, combined by ``any`` or ``all``: read
    in the loop itself, since vLLM asks per lookup."""
    get = operator.attrgetter(name)
    if combine == "all":

        def all_read() -> bool:
            for child in children:
                if get(child) is False:
                    return False
            return True

        return all_read

    def any_read() -> bool:
        for child in children:
            if get(child):
                return True
        return False

    return any_read


def _call_every(table: Dispatch, method: str, *args: Any) -> None:
    """``method`` on every child (:meth:`Dispatch.every`); each child gets its call whatever the
    others raised, then one :class:`ChildFailed` names every child that raised."""
    errors: list[tuple[str, BaseException]] = []
    for i, fn in table.every(method):
        try:
            fn(*args)
        except Exception as exc:
            log.exception("connector %s failed in %s", table.names[i], method)
            errors.append((table.names[i], exc))
    if errors:
        detail = ", ".join(f"{n} ({e!r})" for n, e in errors)
        raise ChildFailed(f"{method} failed in {detail}") from errors[0][1]


def _traced(name: str, method: str, fn: Fn) -> Fn:
    def traced(*args: Any, **kwargs: Any) -> Any:
        result = fn(*args, **kwargs)
        trace_log.info("%s.%s -> %r", name, method, result)
        return result

    return traced
