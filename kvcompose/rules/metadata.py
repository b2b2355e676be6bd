"""Metadata rules: how per-child connector metadata travels between scheduler and workers."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvcompose import hookimpl
from kvcompose.catalog import Rule
from kvcompose.contract import MetadataRule


class MetadataMismatch(RuntimeError):
    """Scheduler and worker disagree on the children (a stale or foreign metadata object)."""


class Merge(MetadataRule):
    """One entry per child, keyed by the child's name; a missing or extra name is an error.

    vLLM's MultiConnector ships a positional tuple and ``zip``s it, so a length mismatch
    silently drops children. Names make the mismatch visible.
    """

    def __init__(self, names: Sequence[str]) -> None:
        self.names = tuple(names)

    def pack(self, metas: Sequence[Any]) -> dict[str, Any]:
        if len(metas) != len(self.names):
            raise MetadataMismatch(f"{len(metas)} metadata entries for {len(self.names)} children {self.names}")
        return dict(zip(self.names, metas))

    def unpack(self, payload: Mapping[str, Any]) -> list[Any]:
        if tuple(payload) != self.names:
            missing = [n for n in self.names if n not in payload]
            extra = [n for n in payload if n not in self.names]
            raise MetadataMismatch(
                f"connector metadata names {tuple(payload)} do not match this composition's children "
                f"{self.names} (missing: {missing or 'none'}, unexpected: {extra or 'none'}); "
                "were the scheduler and the workers started from different compositions?"
            )
        return list(payload.values())


@hookimpl
def kvcompose_rules() -> list[Rule[Any]]:
    return [
        Rule(
            "metadata",
            "merge",
            "one named metadata entry per child, checked on arrival",
            lambda children, params: Merge([c.name for c in children]),
            explain=lambda ch, p: (
                "metadata: one entry per child by name ("
                + ", ".join(c.name for c in ch)
                + "), checked by name on every worker"
            ),
        ),
    ]
