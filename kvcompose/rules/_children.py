"""Shared parameter struct for rules that name a subset of the children."""

from __future__ import annotations

from typing import Any

import msgspec

from kvcompose.errors import CompositionError, Problem, did_you_mean


class ChildrenParams(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    children: list[str]


def indices(children: tuple[Any, ...], names: list[str]) -> tuple[int, ...]:
    """Child indices for ``names``; unknown names are problems located at ``children[i]``."""
    by_name = {c.name: c.index for c in children}
    problems = [
        Problem(f"no connector is named {n!r}", ("children", i), did_you_mean(n, by_name))
        for i, n in enumerate(names)
        if n not in by_name
    ]
    if problems:
        raise CompositionError(problems)
    return tuple(sorted(by_name[n] for n in names))
