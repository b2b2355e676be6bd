"""Child-index helpers for rules that name children: a rule resolves names to indices once, in its
``build``, and works with indices per request (exported through :mod:`kvcompose.api`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec

from kvcompose.errors import CompositionError, Path, Problem, did_you_mean

if TYPE_CHECKING:
    from kvcompose.catalog import Child


class ChildrenParams(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A rule's parameters that name a subset of the children (``{use: only, children: [a, b]}``)."""

    children: list[str]


def index(children: Sequence[Child], name: str, path: Path = ()) -> int:
    """The index of the child named ``name``; an unknown name is a problem at ``path`` (relative
    to the rule: kvcompose prefixes ``rules.<kind>`` and adds the line)."""
    for c in children:
        if c.name == name:
            return c.index
    hint = did_you_mean(name, [c.name for c in children])
    raise CompositionError([Problem(f"no connector is named {name!r}", path, hint)])


def indices(children: Sequence[Child], names: list[str]) -> tuple[int, ...]:
    """Child indices for ``names``, sorted; unknown names are problems located at ``children[i]``."""
    by_name = {c.name: c.index for c in children}
    problems = [
        Problem(f"no connector is named {n!r}", ("children", i), did_you_mean(n, by_name))
        for i, n in enumerate(names)
        if n not in by_name
    ]
    if problems:
        raise CompositionError(problems)
    return tuple(sorted(by_name[n] for n in names))
