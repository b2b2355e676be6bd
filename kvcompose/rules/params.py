"""Params rules: merging the ``kv_transfer_params`` that children return from ``request_finished``."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from kvcompose import hookimpl
from kvcompose.catalog import Child, Plan, Rule
from kvcompose.contract import ParamsRule
from kvcompose.errors import Problem
from kvcompose.rules.checks import ChecksPlan

log = logging.getLogger("kvcompose.rules.params")


class ParamsClash(RuntimeError):
    """Two children returned the same ``kv_transfer_params`` key (``strict`` rule only)."""


class Owners(ParamsRule, ChecksPlan):
    """Each key goes to the child whose type declares it; undeclared keys: first child wins.

    A child returning a key that another child owns has it dropped (logged once per key), so a
    CPU tier can never overwrite the P/D transport's ``remote_block_ids``.
    """

    def __init__(self, children: Sequence[Child]) -> None:
        self.names = [c.name for c in children]
        self.owner: dict[str, int] = {}
        for c in children:
            for key in c.type.param_keys:
                self.owner.setdefault(key, c.index)
        self._warned: set[tuple[int, str]] = set()

    def check(self, plan: Plan) -> list[Problem]:
        """A key two children declare has no owner: refused at the second child."""
        problems: list[Problem] = []
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
        return problems

    def merge(self, results: Sequence[Mapping[str, Any] | None]) -> dict[str, Any] | None:
        if not any(results):  # most finished requests: no child returned params
            return None
        merged: dict[str, Any] = {}
        source: dict[str, int] = {}
        for i, params in enumerate(results):
            if not params:
                continue
            for key, value in params.items():
                owner = self.owner.get(key)
                if owner is not None and owner != i:
                    self._warn(i, key, f"key {key!r} belongs to {self.names[owner]}")
                elif key in merged and owner is None:
                    self._warn(i, key, f"key {key!r} was already returned by {self.names[source[key]]}")
                else:
                    merged[key] = value
                    source[key] = i
        return merged or None

    def _warn(self, child: int, key: str, why: str) -> None:
        if (child, key) not in self._warned:
            self._warned.add((child, key))
            log.warning("kv_transfer_params from %s: dropped, %s", self.names[child], why)


class Strict(ParamsRule):
    """vLLM MultiConnector's behaviour: any key returned by two children is an error."""

    def __init__(self, children: Sequence[Child]) -> None:
        self.names = [c.name for c in children]

    def merge(self, results: Sequence[Mapping[str, Any] | None]) -> dict[str, Any] | None:
        if not any(results):  # most finished requests: no child returned params
            return None
        merged: dict[str, Any] = {}
        source: dict[str, int] = {}
        for i, params in enumerate(results):
            for key, value in (params or {}).items():
                if key in merged:
                    raise ParamsClash(
                        f"kv_transfer_params key {key!r} returned by both {self.names[source[key]]} and {self.names[i]}"
                    )
                merged[key] = value
                source[key] = i
        return merged or None


def _explain_owners(children: tuple[Child, ...], _: Any) -> str:
    owners = [
        f"{c.name} owns {'the P/D params' if c.type.pd_transport else 'its params'} ({len(c.type.param_keys)} keys)"
        for c in children
        if c.type.param_keys
    ]
    text = "params: kv_transfer_params merged by declared owner; " + ("; ".join(owners) or "no child declares keys")
    undeclared = [c.name for c in children if not c.type.param_keys]
    if undeclared:
        verb = "declares" if len(undeclared) == 1 else "declare"
        text += (
            f"; {', '.join(undeclared)} {verb} no keys: a key no child declares goes to the first child "
            "in YAML order that returns it"
        )
    return text


def _brief_owners(children: tuple[Child, ...], _: Any) -> str:
    owners = [
        f"{c.name} owns {'the P/D params' if c.type.pd_transport else 'its params'} ({len(c.type.param_keys)} keys)"
        for c in children
        if c.type.param_keys
    ]
    undeclared = [c.name for c in children if not c.type.param_keys]
    if undeclared:
        owners.append(f"{', '.join(undeclared)} {'declares' if len(undeclared) == 1 else 'declare'} none")
    return "params: by owner; " + ("; ".join(owners) or "no child declares keys")


@hookimpl
def kvcompose_rules() -> list[Rule[Any]]:
    return [
        Rule(
            "params",
            "owners",
            "each kv_transfer_params key comes from the child that declares it",
            lambda children, params: Owners(children),
            explain=_explain_owners,
            brief=_brief_owners,
        ),
        Rule(
            "params",
            "strict",
            "a key returned by two children is an error (MultiConnector's rule)",
            lambda children, params: Strict(children),
            explain=lambda ch, p: "params: kv_transfer_params merged; a key returned twice is an error",
        ),
    ]
