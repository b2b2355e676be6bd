"""The composition engine: a validated composition and the plugins' rules -> a call plan.

No vLLM types here. The vLLM adapter (``kvcompose.vllm``) walks the plan for every engine call.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from kvcompose.catalog import RULE_KINDS, VLLM_ROLES, ConnectorType, Options, Role, Rule
from kvcompose.config import Composition, Source, dec_hook, load_file, load_text, msgspec_problem
from kvcompose.errors import CompositionError, Problem, did_you_mean
from kvcompose.plugins import Plugins, get_plugins, tracing_enabled


@dataclass(frozen=True)
class Child:
    """One resolved child of a composition: its place, name, type and validated options."""

    index: int  # position in the YAML list = load priority under first-wins
    name: str
    type: ConnectorType
    role: Role
    options: Options

    @property
    def vllm_role(self) -> str:
        return VLLM_ROLES[self.role]

    def vllm_config(self) -> dict[str, Any]:
        """The child's full ``KVTransferConfig`` kwargs (the type's, plus the role)."""
        cfg = dict(self.type.vllm_config(self))
        cfg["kv_role"] = self.vllm_role
        return cfg



class _RuleParams(msgspec.Struct, forbid_unknown_fields=True):
    use: str


@dataclass(frozen=True)
class Plan:
    """A composition resolved against the installed plugins: what the vLLM adapter executes.

    Every field is plain data or a plain callable, so the per-request path is a loop over
    children and attribute look-ups, never a pluggy dispatch.
    """

    source: Source
    children: tuple[Child, ...]
    rule_names: dict[str, str]
    rule_params: dict[str, Any]
    rules: dict[str, Rule]
    load: Any  # .select(ask, n)
    store_targets: tuple[int, ...]
    metadata: Any  # .pack / .unpack
    params: Any  # .merge
    completion: Any  # () -> tracker
    best_effort: frozenset[int]
    handshake_children: tuple[int, ...]
    host_buffer_owner: int | None
    trace: bool

    @property
    def composition(self) -> Composition:
        return self.source.composition

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.children)

    def child(self, name: str) -> Child:
        for c in self.children:
            if c.name == name:
                return c
        raise KeyError(name)

    def explain(self) -> list[str]:
        """The plan in plain words: who loads first, who stores, who owns what."""
        lines = ["children, in load priority order:"]
        for c in self.children:
            lines.append(f"  {c.index + 1}. {c.name} ({c.type.name}, {c.role}): {c.type.describe(c)}")
        for kind in RULE_KINDS:
            rule = self.rules[kind]
            text = rule.explain(self.children, self.rule_params[kind]) if rule.explain else f"{kind}: {rule.name}"
            lines.append(text)
        owners = [self.children[i].name for i in self.handshake_children]
        lines.append("handshake: " + (", ".join(owners) + " exchange their own handshake metadata, kept apart per child"
                                      if owners else "no child uses a handshake"))
        pd = [c.name for c in self.children if c.type.param_keys]
        lines.append("P/D kv_transfer_params: " + (" and ".join(pd) if pd else "none (no P/D transport)"))
        lines.append("host-buffer copies: " + (self.children[self.host_buffer_owner].name
                                               if self.host_buffer_owner is not None else "no child"))
        lines.append("a failed load: " + _LOAD_FAILURE[self.composition.load_failure])
        return lines


_LOAD_FAILURE = {
    None: "vLLM's default (fail): the request ends with an error",
    "fail": "the request ends with an error (vLLM's kv_load_failure_policy=fail)",
    "recompute": "the prompt is computed locally (vLLM's kv_load_failure_policy=recompute)",
}


def _rule_choice(kind: str, value: Any) -> tuple[str, dict[str, Any]]:
    if isinstance(value, str):
        return value, {}
    rest = dict(value)
    name = rest.pop("use", None)
    if not isinstance(name, str):
        raise CompositionError([Problem("a rule with parameters needs `use: <rule name>`", (),
                                        f"for example `{kind}: {{use: <name>, ...}}`")])
    return name, rest


def build(source: Source, plugins: Plugins | None = None) -> Plan:
    """Resolve types, options and rules; run every check. Raises a located CompositionError."""
    plugins = plugins or get_plugins()
    comp = source.composition
    problems: list[Problem] = []
    types = plugins.connector_types
    children: list[Child] = []
    for i, spec in enumerate(comp.connectors):
        ctype = types.get(spec.type)
        if ctype is None:
            problems.append(Problem(f"unknown connector type {spec.type!r}", ("connectors", i, "type"),
                                    did_you_mean(spec.type, types)))
            continue
        try:
            options = msgspec.convert(spec.options, type=ctype.options, dec_hook=dec_hook)
        except msgspec.ValidationError as exc:
            problems.append(msgspec_problem(exc, ("connectors", i, "options"), ctype.options))
            continue
        children.append(Child(i, spec.name, ctype, spec.role, options))
    chosen: dict[str, Rule] = {}
    params: dict[str, Any] = {}
    built: dict[str, Any] = {}
    if not problems:
        for kind in RULE_KINDS:
            try:
                name, raw = _rule_choice(kind, getattr(comp.rules, kind))
                rule = plugins.rules.get((kind, name))
                if rule is None:
                    names = [n for k, n in plugins.rules if k == kind]
                    problems.append(Problem(f"unknown {kind} rule {name!r}", ("rules", kind), did_you_mean(name, names)))
                    continue
                if rule.params is None:
                    if raw:
                        problems.append(Problem(f"{kind} rule {name!r} takes no parameters", ("rules", kind, next(iter(raw)))))
                        continue
                    p = None
                else:
                    try:
                        p = msgspec.convert(raw, type=rule.params, dec_hook=dec_hook)
                    except msgspec.ValidationError as exc:
                        problems.append(msgspec_problem(exc, ("rules", kind), rule.params))
                        continue
                chosen[kind], params[kind] = rule, p
                built[kind] = rule.build(tuple(children), p)
            except CompositionError as exc:
                problems.extend(Problem(q.message, ("rules", kind) + q.path, q.hint) for q in exc.problems)
    if problems:
        raise source.error(problems)
    hosts = [c.index for c in children if c.type.owns_host_buffer_ops]
    plan = Plan(
        source=source,
        children=tuple(children),
        rule_names={k: r.name for k, r in chosen.items()},
        rule_params=params,
        rules=chosen,
        load=built["load"],
        store_targets=tuple(built["store"]),
        metadata=built["metadata"],
        params=built["params"],
        completion=built["completion"],
        best_effort=frozenset(built["faults"]),
        handshake_children=tuple(c.index for c in children if c.type.owns_handshake),
        host_buffer_owner=hosts[0] if hosts else None,
        trace=tracing_enabled(),
    )
    for c in children:
        problems.extend(c.type.check(c, plan))
    problems.extend(plugins.check(plan))
    if problems:
        raise source.error(problems)
    plugins.plan_ready(plan)
    return plan


def load(path: str | Path, plugins: Plugins | None = None) -> Plan:
    """Read, validate and resolve a composition file."""
    return build(load_file(path), plugins)


def loads(text: str, plugins: Plugins | None = None, filename: str = "<composition>") -> Plan:
    """Same as :func:`load`, from YAML text."""
    return build(load_text(text, filename), plugins)
