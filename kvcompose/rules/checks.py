"""Built-in cross-child checks (``kvcompose_check``), and each rule's own check of the plan
(:class:`ChecksPlan`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol, runtime_checkable

from kvcompose import hookimpl
from kvcompose.catalog import Listener, Plan
from kvcompose.contract import RULE_KINDS
from kvcompose.errors import Problem


@runtime_checkable
class ChecksPlan(Protocol):
    """Optional, for a rule object of any kind: the rule checks the plan it was built into.

    After every rule was built, kvcompose's own ``kvcompose_check`` calls :meth:`check` on each
    of the plan's rule objects that has one, in ``RULE_KINDS`` order, so a rule states what it
    needs of the children itself (``params: owners``: no key owned by two children) and no check
    asks which rule was chosen. Not part of the kinds' Protocols: a rule object that implements
    its kind's Protocol without subclassing it stays valid without a ``check``.
    """

    def check(self, plan: Plan) -> Iterable[Problem]:
        """Problems of the plan for this rule, each located by its path in the composition
        document (from the top, e.g. ``("connectors", 1, "type")``); nothing when all is well.
        A problem with ``warning=True`` is told and the composition still runs."""
        ...


def layout_conflict(layouts: Mapping[str, str | None]) -> str | None:
    """The complaint when children (by name) need different KV cache layouts; None if they agree.

    Used here on what types know without vLLM, and by the vLLM adapter at engine start on what
    the vLLM classes answer for the real model.
    """
    known = {name: layout for name, layout in layouts.items() if layout}
    if len(set(known.values())) > 1:
        return "children need different KV cache layouts: " + ", ".join(f"{n}={lay}" for n, lay in known.items())
    return None


@hookimpl
def kvcompose_check(plan: Plan) -> list[Problem]:
    problems: list[Problem] = []
    for attr, what, fix in (
        (
            "owns_host_buffer_ops",
            "want vLLM's host-buffer copy op; only one child can own it",
            "keep one host-buffer transport per composition",
        ),
        ("pd_transport", "are P/D transports; an instance has one", "compose at most one P/D transport"),
    ):
        claimants = [c for c in plan.children if getattr(c.type, attr)]
        for c in claimants[1:]:
            problems.append(
                Problem(f"{c.name} and {claimants[0].name} both {what}", ("connectors", c.index, "type"), fix)
            )
    problems.extend(_port_clashes(plan))
    for kind in RULE_KINDS:  # each rule checks what it needs itself
        rule = getattr(plan, kind)
        if isinstance(rule, ChecksPlan):
            problems.extend(rule.check(plan))
    for c in plan.children:
        needed = c.type.save_hooks_needed(c)
        if needed and c.index not in plan.store.targets:
            problems.append(
                Problem(
                    f"the store rule leaves {c.name} out of the save hooks, but it {needed}",
                    ("rules", "store"),
                    f"list {c.name} in store.children, or use `store: all`",
                )
            )
        if needed and plan.faults.contains(c.index):
            # A bypassed child gets no save hook either, from its first failure on.
            problems.append(
                Problem(
                    f"the faults rule can bypass {c.name}, which then gets no save hooks, but it {needed}",
                    ("rules", "faults"),
                    f"leave {c.name} out of faults.children; an error of it then stops the engine",
                )
            )
    layouts = {c.name: c.type.kv_layout(c) for c in plan.children}
    conflict = layout_conflict(layouts)
    if conflict:
        # Located at the first child whose layout differs from the first known one.
        known = [c for c in plan.children if layouts[c.name]]
        odd = next(c for c in known if layouts[c.name] != layouts[known[0].name])
        problems.append(Problem(conflict, ("connectors", odd.index, "type")))
    return problems


#: Names of this machine's loopback, and the wildcards that bind every address.
_LOOPBACK = frozenset({"localhost", "127.0.0.1", "::1"})
_WILDCARD = frozenset({"0.0.0.0", "::", "*", ""})


def _same_address(a: str, b: str) -> bool:
    """Whether binding both ``a`` and ``b`` on one port of one machine collides."""
    return a == b or bool({a, b} & _WILDCARD) or {a, b} <= _LOOPBACK


def _port_clashes(plan: Plan) -> Iterable[Problem]:
    """Two listeners of the engine on one port: the second fails to bind when the engine starts."""
    seen: list[tuple[str, Listener]] = []
    for c in plan.children:
        for mine in c.type.listeners(c):
            for owner, theirs in seen:
                if mine.port == theirs.port and _same_address(mine.host, theirs.host):
                    yield Problem(
                        f"{mine.what} port {mine.port} ({mine.set_by}) is also the port of {owner}'s "
                        f"{theirs.what}: the engine cannot bind both",
                        mine.path,
                        f"give the {mine.what} a port of its own",
                    )
            seen.append((c.name, mine))
