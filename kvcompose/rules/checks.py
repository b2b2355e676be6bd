"""Built-in cross-child checks (``kvcompose_check``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvcompose import hookimpl
from kvcompose.errors import Problem

if TYPE_CHECKING:
    from kvcompose.compose import Plan


@hookimpl
def kvcompose_check(plan: "Plan") -> list[Problem]:
    problems: list[Problem] = []
    hosts = [c for c in plan.children if c.type.owns_host_buffer_ops]
    for c in hosts[1:]:
        problems.append(Problem(
            f"{c.name} and {hosts[0].name} both want vLLM's host-buffer copy op; only one child can own it",
            ("connectors", c.index, "type"), "keep one host-buffer transport per composition"))
    if plan.rule_names["params"] == "owners":
        owner: dict[str, str] = {}
        for c in plan.children:
            for key in sorted(c.type.param_keys):
                if key in owner:
                    problems.append(Problem(
                        f"kv_transfer_params key {key!r} is owned by both {owner[key]} and {c.name}",
                        ("connectors", c.index, "type"),
                        "compose at most one P/D transport, or use `params: strict` and distinct keys"))
                    break
                owner[key] = c.name
    layouts = {c.name: c.type.kv_layout(c) for c in plan.children}
    known = {n: l for n, l in layouts.items() if l}
    if len(set(known.values())) > 1:
        idx = next(c.index for c in plan.children if c.name == list(known)[1])
        problems.append(Problem(
            "children need different KV cache layouts: " + ", ".join(f"{n}={l}" for n, l in known.items()),
            ("connectors", idx, "type")))
    return problems
