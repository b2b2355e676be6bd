"""One rule for combining the children's answers where kvcompose has no rule of its own.

Two things use it: a field of vLLM's transfer results that kvcompose does not know (a newer vLLM
added it; the composite carries it through instead of dropping it), and the answer to an engine
call that kvcompose does not know (a newer vLLM added the call; the composite forwards it to
every child). The rule goes by the type of the answers (docs/versions.md, "Results fields and
calls kvcompose does not know"):

============================  ===============================================================
the children answer            the composite answers
============================  ===============================================================
``None`` (all of them)         ``None`` (for a results field: the field's own default)
``bool``                       ``True`` when any child answers ``True``
``int`` / ``float``            the sum
``set`` / ``frozenset``        the union
``list`` / ``tuple``           the concatenation, in YAML order
``dict`` (any ``Mapping``)     the union of the keys; a key several children give is merged
                               by this same rule
anything else, or mixed types  the first answer that is not ``None``, in YAML order
============================  ===============================================================

``None`` answers are skipped first: a child that says nothing does not change the others' answer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def merge_values(values: Sequence[Any]) -> Any:
    """The children's answers (in YAML order) combined by the type rule of this module."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    if len(present) == 1:
        return present[0]
    first = present[0]
    # bool before int: bool is an int subclass, and True + True is not an answer.
    if all(isinstance(v, bool) for v in present):
        return any(present)
    if all(isinstance(v, int | float) and not isinstance(v, bool) for v in present):
        return sum(present)
    if all(isinstance(v, set | frozenset) for v in present):
        return type(first)().union(*present)
    if all(isinstance(v, list) for v in present) or all(isinstance(v, tuple) for v in present):
        return type(first)(item for v in present for item in v)
    if all(isinstance(v, Mapping) for v in present):
        return _merge_mappings(present)
    return first


def _merge_mappings(mappings: list[Mapping[Any, Any]]) -> dict[Any, Any]:
    by_key: dict[Any, list[Any]] = {}
    for m in mappings:
        for key, value in m.items():
            by_key.setdefault(key, []).append(value)
    return {key: merge_values(vs) for key, vs in by_key.items()}
