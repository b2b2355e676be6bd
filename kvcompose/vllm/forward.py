"""How the composite forwards an engine call to its children: the declarations and their binding.

The composed connector (:class:`kvcompose.vllm.connector.KVComposeConnector`) declares each call
of vLLM's connector API once, in its class body, as a :class:`Call`:

- ``each()``: every child that gets the call is called with vLLM's arguments; the answer is
  ``None``.
- ``combined(how, neutral)``: every child that gets the call is asked and the answers combined
  by ``how`` (:data:`How`); ``"every"`` also reaches bypassed children, uncontained.
- ``read(how)``: a property of vLLM's, read from every child and combined.
- ``@by_child(...)`` or ``@combined(...)`` on a method: the composite's own method decides (a
  rule, a child's own argument, a wrapper around the answers). It gets, right after ``self``,
  ``{child index: the child's callable}`` (``by_child``) or the combined callable (``combined``).

``to`` says which children get a call (:data:`To`); ``neutral`` is what a contained child that
raised answers in its place: vLLM's "nothing" for the call's answer, which the combination drops.

A declaration is resolved per composite instance on first use into plain callables kept in the
instance (a non-data descriptor: later calls cost one attribute lookup), and again when a
contained child is bypassed or let back (:meth:`Fanout.rebuild`). Tracing (``KVCOMPOSE_TRACE``)
and fault containment (the ``faults`` rule) wrap each child's callable here.
"""

from __future__ import annotations

import dataclasses
import dis
import functools
import logging
import operator
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

from kvcompose.catalog import Plan
from kvcompose.contract import FaultMonitor, FaultsRule
from kvcompose.merge import merge_values
from kvcompose.vllm.surface import base_calls, provides, unknown_calls, warn_generic

log = logging.getLogger("kvcompose.vllm")
trace_log = logging.getLogger("kvcompose.trace")

Fn = Callable[..., Any]
#: ``{child index: callable}``, in call order: what a ``by_child`` method gets.
ByChild = Mapping[int, Fn]

#: How the children's answers combine: ``each`` (no answer), ``by-child`` (the composite's
#: method combines them), ``any`` / ``all`` (no child answers ``False``), ``union`` (of sets),
#: ``concat`` (of iterables), ``named`` (the answers that are not ``None``, by child name), ``one``
#: (``named``, at most one child answering), ``agreed`` (the one answer every child gives),
#: ``every`` (every child that has the call, bypassed ones included, uncontained; then one error
#: naming every child that raised), ``merge`` (a call of a newer vLLM: answers merged by type,
#: :func:`kvcompose.merge.merge_values`).
How = Literal["each", "by-child", "any", "all", "union", "concat", "named", "one", "agreed", "every", "merge"]

#: Which children get the call: every active child in YAML order, the store rule's targets, the
#: child that owns host-buffer copies, or every active child with the P/D transport first (its
#: reads are in flight while the others copy).
To = Literal["all", "store-targets", "host-buffer-owner", "pd-first"]

#: The combinations that drop a child's neutral answer: a child whose implementation answers
#: only that (and does nothing) need not be called.
_DROPS_NEUTRAL: frozenset[How] = frozenset({"each", "by-child", "any", "union", "concat", "named", "one"})


@dataclass(frozen=True, eq=False)
class Call:
    """One call of vLLM's connector API, as the composite forwards it (see the module's text)."""

    how: How
    #: What a contained child that raised answers instead.
    neutral: Any = None
    to: To = "all"
    #: vLLM's base class answers ``neutral``: a child that inherits it is not called.
    base_neutral: bool = False
    #: A rule asks the children it chooses, by index: every child that has the call is in the map.
    ruled: bool = False
    #: The composite's own method, given the children's callables after ``self``.
    method: Fn | None = None
    kind: Literal["method", "property"] = "method"
    name: str = field(default="", init=False)

    def __set_name__(self, owner: type, name: str) -> None:
        object.__setattr__(self, "name", name)

    def __call__(self, method: Fn) -> Call:
        """Used as a decorator: the composite's own method for this call."""
        return dataclasses.replace(self, method=method)

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        value = obj.fanout.resolve(self)
        bound = value if self.method is None else functools.partial(self.method, obj, value)
        obj.__dict__[self.name] = bound  # the next call finds it in the instance
        return bound


class Read(Call):
    """A property of vLLM's connector API, read from every child on each access."""

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        return obj.fanout.reader(self)()

    def __set__(self, obj: Any, value: Any) -> None:
        raise AttributeError(f"{self.name} is read from the children")


def each(to: To = "all") -> Call:
    """Every child that gets the call is called with vLLM's arguments; the answer is ``None``."""
    return Call("each", to=to)


def combined(how: How, neutral: Any = None, base_neutral: bool = False) -> Call:
    """The children's answers, combined by ``how``."""
    return Call(how, neutral, base_neutral=base_neutral)


def by_child(neutral: Any = None, ruled: bool = False) -> Call:
    """Decorates the composite's own method, which gets ``{child index: callable}``."""
    return Call("by-child", neutral, ruled=ruled)


def read(how: Literal["any", "all"]) -> Read:
    """A property, combined by ``how`` over the children."""
    return Read(how, False, kind="property")


def declared(cls: type) -> dict[str, Call]:
    """Every call ``cls`` declares (its bases' included), by name."""
    out: dict[str, Call] = {}
    for klass in reversed(cls.__mro__):
        out.update({name: c for name, c in vars(klass).items() if isinstance(c, Call)})
    return out


def forward_unknown_calls(cls: type, base: type = KVConnectorBase_V1) -> type:
    """Class decorator: each instance method of vLLM's base class (or ``base``) that the
    composite does not declare is forwarded to every child that has it, the answers merged by
    type (a :class:`Call` of ``merge``). Class methods and properties it does not declare keep
    vLLM's default (the surface tests name them), since no child instance exists to ask."""
    kinds = base_calls(base)
    generic = tuple(name for name in unknown_calls(cls, base) if kinds[name] == "method")
    for name in generic:
        call = Call("merge")
        call.__set_name__(cls, name)
        setattr(cls, name, call)
    return cls


class ChildFailed(RuntimeError):
    """A child connector raised; names the child and the engine call."""


class Fanout:
    """One composite instance's children, as its declared calls reach them.

    Keeps which children are active (a contained child that raised is bypassed while the faults
    rule's monitor says so) and resolves each :class:`Call` into callables over them.

    :param owner: the composite instance whose calls are resolved (cleared on :meth:`rebuild`).
    :param on_fault: called with (child, call name) when a contained child raised (after it was
        bypassed here, when the monitor says so); the composite settles what that child owed.
    """

    def __init__(
        self, owner: object, children: Sequence[KVConnectorBase_V1], plan: Plan, on_fault: Callable[[int, str], None]
    ) -> None:
        self._owner = owner
        self._children = list(children)
        self.names = plan.names
        self._faults: FaultsRule = plan.faults
        self._trace = plan.trace
        self._on_fault = on_fault
        host = plan.host_buffer_owner
        self._only: dict[To, tuple[int, ...]] = {
            "store-targets": tuple(plan.store.targets),
            "host-buffer-owner": () if host is None else (host,),
        }
        self._first = plan.pd_transport.index if plan.pd_transport is not None else None
        #: The faults rule's monitor of this instance: when a child is bypassed and let back.
        self.monitor: FaultMonitor = self._faults.monitor()
        self.disabled: set[int] = set()
        #: The active children, in YAML order.
        self.active: tuple[int, ...] = tuple(range(len(self._children)))
        self._readers: dict[str, Fn] = {}

    # ------------------------------------------------------------------ the children's state

    def disable(self, child: int) -> None:
        """Stop calling ``child``: every call is resolved again without it."""
        self.disabled.add(child)
        self.rebuild()

    def enable(self, child: int) -> None:
        """Call ``child`` again: every call is resolved again with it, in YAML order."""
        self.disabled.discard(child)
        self.rebuild()

    def step(self) -> tuple[int, ...]:
        """A step starts: tell the monitor, and call again the children it lets back."""
        back = self.monitor.step()
        for child in back:
            self.enable(child)
        return back

    def rebuild(self) -> None:
        """Forget every resolved call: each is resolved again at its next use."""
        self.active = tuple(i for i in range(len(self._children)) if i not in self.disabled)
        self._readers.clear()
        resolved = vars(self._owner)
        for name in declared(type(self._owner)):
            resolved.pop(name, None)

    # ------------------------------------------------------------------ resolving a call

    def resolve(self, call: Call) -> Any:
        """What the composite calls for ``call``: ``{index: callable}`` for ``by-child``, else
        one callable that asks the children and combines their answers."""
        if call.how == "merge":
            warn_generic(call.name)
        if call.how == "every":
            return functools.partial(_call_every, self, call.name)
        entries = self.entries(call)
        if call.how == "by-child":
            return entries
        return self._combined(call, entries)

    def reader(self, call: Read) -> Fn:
        """The combined reader of a property (kept until :meth:`rebuild`)."""
        fn = self._readers.get(call.name)
        if fn is None:
            fn = self._readers[call.name] = self._make_reader(call)
        return fn

    def _make_reader(self, call: Read) -> Fn:
        entries = self.entries(call)
        if self._trace or any(self._faults.contains(i) for i in entries):
            return self._combined(call, entries)
        return _read(call.how, call.name, tuple(self._children[i] for i in entries))

    def _combined(self, call: Call, entries: Mapping[int, Fn]) -> Fn:
        """One callable that asks ``entries`` and combines their answers by ``call.how``."""
        return _COMBINE[call.how](tuple(entries.values()), tuple(self.names[i] for i in entries), call.name)

    def at_step(self, call: Call, children: ByChild) -> ByChild:
        """A step starts (``call`` is its first call): while a child has failures, tell the
        monitor; the children of ``call`` again when it lets a bypassed child back."""
        if self.monitor.watched and self.step():
            return self.resolve(call)
        return children

    def entries(self, call: Call) -> dict[int, Fn]:
        """The active children that get ``call``, each bound to its callable, in call order."""
        among: Sequence[int] = self.active
        if call.to == "pd-first" and self._first in among:
            among = [self._first, *(i for i in among if i != self._first)]
        only = self._only.get(call.to)
        has = hasattr if call.kind == "property" else provides
        return {
            i: self._bind(i, call)
            for i in among
            if (only is None or i in only) and has(self._children[i], call.name) and not self._idle(i, call)
        }

    def every(self, name: str) -> Iterator[tuple[int, Fn]]:
        """``name`` on every child that has it, bypassed ones included, uncontained."""
        for i, child in enumerate(self._children):
            if provides(child, name):
                fn = getattr(child, name)
                yield i, (_traced(self.names[i], name, fn) if self._trace else fn)

    def _idle(self, i: int, call: Call) -> bool:
        """Whether child ``i``'s implementation is known to answer only the neutral answer,
        which the call's combination drops (docs/performance.md: worker step, before/after)."""
        if self._trace or call.ruled or call.how not in _DROPS_NEUTRAL or call.kind != "method":
            return False  # tracing logs every child call
        fn = getattr(self._children[i], call.name)  # an instance attribute (a test's patch) is the child's own
        if call.base_neutral and getattr(fn, "__func__", None) is getattr(KVConnectorBase_V1, call.name, None):
            return True
        return call.neutral is None and has_empty_body(fn)

    def _bind(self, i: int, call: Call) -> Fn:
        child = self._children[i]
        fn: Fn = functools.partial(getattr, child, call.name) if call.kind == "property" else getattr(child, call.name)
        if self._trace:
            fn = _traced(self.names[i], call.name, fn)
        if self._faults.contains(i):
            fn = self._contained(i, call, fn)
        return fn

    def _contained(self, i: int, call: Call, fn: Fn) -> Fn:
        neutral = call.neutral
        method = call.name
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


# ------------------------------------------------------------------ the combinations


def _each(fns: tuple[Fn, ...], names: tuple[str, ...], method: str) -> Fn:
    if len(fns) == 1:  # one child: its own callable, no loop of ours around it
        return fns[0]

    # No ``**{}`` without keywords: vLLM's per-layer calls pass none (docs/performance.md: worker step).
    def each_(*args: Any, **kwargs: Any) -> None:
        if kwargs:
            for fn in fns:
                fn(*args, **kwargs)
        else:
            for fn in fns:
                fn(*args)

    return each_


def _any(fns: tuple[Fn, ...], names: tuple[str, ...], method: str) -> Fn:
    def any_(*args: Any) -> bool:
        found = False
        for fn in fns:  # every child is asked, as vLLM's MultiConnector asks them
            if fn(*args):
                found = True
        return found

    return any_


def _all(fns: tuple[Fn, ...], names: tuple[str, ...], method: str) -> Fn:
    def all_(*args: Any) -> bool:
        ok = True
        for fn in fns:
            if fn(*args) is False:
                ok = False
        return ok

    return all_


def _union(fns: tuple[Fn, ...], names: tuple[str, ...], method: str) -> Fn:
    def union(*args: Any) -> set[Any]:
        out: set[Any] = set()
        for fn in fns:
            out |= fn(*args)
        return out

    return union


def _concat(fns: tuple[Fn, ...], names: tuple[str, ...], method: str) -> Fn:
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


def _named(fns: tuple[Fn, ...], names: tuple[str, ...], method: str) -> Fn:
    entries = tuple(zip(names, fns, strict=True))

    def named(*args: Any) -> dict[str, Any]:
        out = {}
        for name, fn in entries:
            answer = fn(*args)
            if answer is not None:
                out[name] = answer
        return out

    return named


def _one(fns: tuple[Fn, ...], names: tuple[str, ...], method: str) -> Fn:
    named = _named(fns, names, method)

    def one(*args: Any) -> Any:
        found = named(*args)
        if len(found) > 1:
            raise ValueError(f"children {list(found)} each answer {method}; at most one may")
        return next(iter(found.values()), None)

    return one


def _agreed(fns: tuple[Fn, ...], names: tuple[str, ...], method: str) -> Fn:
    entries = tuple(zip(names, fns, strict=True))

    def agreed(*args: Any) -> Any:
        answers = {name: fn(*args) for name, fn in entries}
        values = set(answers.values())
        if len(values - {None}) > 1:
            raise ValueError(f"children answer {method} differently: {answers}")
        return None if None in values else next(iter(values), None)

    return agreed


def _merge(fns: tuple[Fn, ...], names: tuple[str, ...], method: str) -> Fn:
    return lambda *args, **kwargs: merge_values([fn(*args, **kwargs) for fn in fns])


_COMBINE: dict[str, Callable[[tuple[Fn, ...], tuple[str, ...], str], Fn]] = {
    "each": _each,
    "any": _any,
    "all": _all,
    "union": _union,
    "concat": _concat,
    "named": _named,
    "one": _one,
    "agreed": _agreed,
    "merge": _merge,
}


def _read(how: str, name: str, children: tuple[Any, ...]) -> Fn:
    """A property of children neither traced nor contained, combined by ``any`` or ``all``: read
    in the loop itself, since vLLM asks per lookup."""
    get = operator.attrgetter(name)
    if how == "all":

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


def _call_every(fanout: Fanout, method: str, *args: Any) -> None:
    """``method`` on every child (:meth:`Fanout.every`); each child gets its call whatever the
    others raised, then one :class:`ChildFailed` names every child that raised."""
    errors: list[tuple[str, BaseException]] = []
    for i, fn in fanout.every(method):
        try:
            fn(*args)
        except Exception as exc:
            log.exception("connector %s failed in %s", fanout.names[i], method)
            errors.append((fanout.names[i], exc))
    if errors:
        detail = ", ".join(f"{n} ({e!r})" for n, e in errors)
        raise ChildFailed(f"{method} failed in {detail}") from errors[0][1]


def _traced(name: str, method: str, fn: Fn) -> Fn:
    def traced(*args: Any, **kwargs: Any) -> Any:
        result = fn(*args, **kwargs)
        trace_log.info("%s.%s -> %r", name, method, result)
        return result

    return traced


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
