"""The resolver: a validated composition and the plugins' types and rules -> a :class:`Plan`.

No vLLM types here. The vLLM adapter (``kvcompose.vllm``) calls the plan's rules at every
engine call; :class:`~kvcompose.catalog.Child` and :class:`~kvcompose.catalog.Plan` are plain
data in :mod:`kvcompose.catalog`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import msgspec

from kvcompose.catalog import Child, Plan, Rule
from kvcompose.config import Source, dec_hook, load_file, load_text, msgspec_problem
from kvcompose.contract import PROTOCOLS, RULE_KINDS
from kvcompose.errors import CompositionError, Problem, did_you_mean
from kvcompose.plugins import Plugins, get_plugins, tracing_enabled


def _rule_choice(kind: str, value: Any) -> tuple[str, dict[str, Any]]:
    if isinstance(value, str):
        return value, {}
    rest = dict(value)
    name = rest.pop("use", None)
    if not isinstance(name, str):
        raise CompositionError(
            [
                Problem(
                    "a rule with parameters needs `use: <rule name>`", (), f"for example `{kind}: {{use: <name>, ...}}`"
                )
            ]
        )
    return name, rest


def build(source: Source, plugins: Plugins | None = None, *, import_modules: bool = False) -> Plan:
    """Resolve types, options and rules; run every check. Raises a located CompositionError.

    ``import_modules``: the checks may import the modules the composition names
    (:attr:`Plan.import_modules`); off, they resolve only what needs no such import.
    """
    plugins = plugins or get_plugins()
    comp = source.composition
    problems: list[Problem] = []
    types = plugins.connector_types
    children: list[Child] = []
    for i, spec in enumerate(comp.connectors):
        ctype = types.get(spec.type)
        if ctype is None:
            problems.append(
                Problem(
                    f"unknown connector type {spec.type!r}", ("connectors", i, "type"), did_you_mean(spec.type, types)
                )
            )
            continue
        try:
            options = msgspec.convert(spec.options, type=ctype.options, dec_hook=dec_hook)
        except msgspec.ValidationError as exc:
            problems.append(msgspec_problem(exc, ("connectors", i, "options"), ctype.options))
            continue
        children.append(Child(i, spec.name, ctype.specialised(options), spec.role, options))
    transport = next((c.name for c in children if c.type.pd_transport), None)
    children = [c if c.type.pd_transport else dataclasses.replace(c, transport=transport) for c in children]
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
                    problems.append(
                        Problem(f"unknown {kind} rule {name!r}", ("rules", kind), did_you_mean(name, names))
                    )
                    continue
                if rule.params is None:
                    if raw:
                        problems.append(
                            Problem(f"{kind} rule {name!r} takes no parameters", ("rules", kind, next(iter(raw))))
                        )
                        continue
                    p = None
                else:
                    try:
                        p = msgspec.convert(raw, type=rule.params, dec_hook=dec_hook)
                    except msgspec.ValidationError as exc:
                        problems.append(msgspec_problem(exc, ("rules", kind), rule.params))
                        continue
                obj = rule.build(tuple(children), p)
                protocol = PROTOCOLS[kind]
                if not isinstance(obj, protocol):
                    problems.append(
                        Problem(
                            f"{kind} rule {name!r} built {type(obj).__name__}, which does not implement "
                            f"{protocol.__name__} (kvcompose.contract)",
                            ("rules", kind),
                            "the rule's plugin is broken; report it to its author",
                        )
                    )
                    continue
                chosen[kind], params[kind], built[kind] = rule, p, obj
            except CompositionError as exc:
                problems.extend(Problem(q.message, ("rules", kind) + q.path, q.hint) for q in exc.problems)
    if problems:
        raise source.error(problems)
    plan = Plan(
        source=source,
        children=tuple(children),
        rules=chosen,
        rule_params=params,
        trace=tracing_enabled(),
        import_modules=import_modules,
        **built,
    )
    for c in children:
        problems.extend(c.type.check(c, plan))
    problems.extend(plugins.check(plan))
    errors = [p for p in problems if not p.warning]
    if errors:
        raise source.error(errors)
    if problems:
        plan = dataclasses.replace(plan, warnings=source.locate(problems))
    return plan


def load(path: str | Path, plugins: Plugins | None = None, *, import_modules: bool = False) -> Plan:
    """Read, validate and resolve a composition file (``import_modules``: see :func:`build`)."""
    return build(load_file(path), plugins, import_modules=import_modules)


def loads(
    text: str, plugins: Plugins | None = None, filename: str = "<composition>", *, import_modules: bool = False
) -> Plan:
    """Same as :func:`load`, from YAML text."""
    return build(load_text(text, filename), plugins, import_modules=import_modules)
