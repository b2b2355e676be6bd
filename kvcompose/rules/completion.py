"""Completion rules: whose transfer reports end a request's load, and free its blocks.

vLLM's scheduler asserts on a ``finished_recving`` it did not expect and frees a request's blocks
on its first ``finished_sending``. MultiConnector forwards the union of every child's reports, so
a child that did not load a request can crash the engine or free blocks another child still reads
(vllm#51786, #53049). The adapter keeps, per request, who reported
(:class:`kvcompose.vllm.loads.Transfers`); the rule answers whether a report counts and whether
the load, or the free, is done.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from kvcompose import hookimpl
from kvcompose.catalog import Child, Rule
from kvcompose.contract import CompletionRule


@dataclass(frozen=True)
class Owner(CompletionRule):
    """Only the children a load awaits report it, each once; a load, or a delayed free, is done
    when every child it waits for reported."""

    def counts(self, child: int, awaited: tuple[int, ...]) -> bool:
        return child in awaited

    def done(self, owed: tuple[int, ...], reported: Collection[int]) -> bool:
        for child in owed:
            if child not in reported:
                return False
        return True


def _owner(children: tuple[Child, ...], params: None) -> Owner:
    return Owner()


@hookimpl
def kvcompose_rules() -> list[Rule[Any]]:
    return [
        Rule(
            "completion",
            "owner",
            "only the loading children's finished_recving is forwarded, once, when the last of them reported; "
            "a delayed free ends when every saving child reported",
            _owner,
            explain=lambda ch, p: (
                "completion: a load's completion is taken only from the children that load it, each once; "
                "blocks held by several children are freed when the last one is done"
            ),
        ),
    ]
