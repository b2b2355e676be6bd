"""Built-in cross-child checks (``kvcompose_check``)."""

from __future__ import annotations

from collections.abc import Mapping

from kvcompose import hookimpl
from kvcompose.catalog import Plan
from kvcompose.errors import Problem


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
    if plan.rules["params"].name == "owners":
        owner: dict[str, str] = {}
        for c in plan.children:
            for key in sorted(c.type.param_keys):
                if key in owner:
                    problems.append(
                        Problem(
                            f"kv_transfer_params key {key!r} is owned by both {owner[key]} and {c.name}",
                            ("connectors", c.index, "type"),
                            "compose at most one P/D transport, or use `params: strict` and distinct keys",
                        )
                    )
                    break
                owner[key] = c.name
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
