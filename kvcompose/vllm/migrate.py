"""vLLM's ``--kv-transfer-config`` in, a composition out: ``kvcompose import`` and drop-in configs.

A MultiConnector config lists its children under ``kv_connector_extra_config["connectors"]``.
Each entry becomes a child named after its connector (``nixl``, ``nixl-2``, ``example``, ...) of
the first connector type whose :meth:`~kvcompose.catalog.ConnectorType.options_from_vllm` reads
the entry back whole (``NixlConnector`` -> ``nixl``, ``SimpleCPUOffloadConnector`` ->
``cpu-offload``), or else of the generic ``vllm`` type, which passes the entry to vLLM as it is.
The rules are kvcompose's defaults (``first-wins`` in list order, ``store: all``, ``metadata:
merge``). No vLLM import here: ``kvcompose import`` runs without vLLM.
"""

from __future__ import annotations

import json
import logging
import re
import shlex
from collections.abc import Mapping
from typing import Any

import msgspec
import yaml

from kvcompose.catalog import ConnectorType, Plan, given_options
from kvcompose.compose import build
from kvcompose.config import DEFAULT_RULES, KEY, VLLM_ROLES, Source, dec_hook, from_builtins, msgspec_problem
from kvcompose.errors import CompositionError, Problem
from kvcompose.errors import Path as DocPath
from kvcompose.generic import TYPE_NAME, VllmType
from kvcompose.plugins import get_plugins
from kvcompose.reader import MAX_DEPTH
from kvcompose.vllm.args import (
    CHILDREN_KEY,
    CONNECTOR_NAME,
    EXTRA_KEY,
    children_configs,
    embedded,
    listed_mismatch,
)
from kvcompose.vllm.register import REGISTERED_NAME

log = logging.getLogger("kvcompose.vllm")

#: The file name a drop-in composition's errors are reported against.
DROPIN_SOURCE = "<MultiConnector connectors>"

FLAG = "--kv-transfer-config"
#: The names a composite goes by in a config (vLLM's, and the one kvcompose registers).
COMPOSITE_NAMES = (CONNECTOR_NAME, REGISTERED_NAME)
ROLE_OF_KV_ROLE = {kv_role: role for role, kv_role in VLLM_ROLES.items()}
#: Top-level keys of a composite's config that describe the composite itself, not a child.
COMPOSITE_KEYS = ("kv_connector", "kv_connector_module_path", "kv_role", "kv_connector_extra_config")


def parse(text: str, filename: str = "<kv-transfer-config>") -> dict[str, Any]:
    """The config from what a user has at hand: the JSON, or the flag and its value.

    Takes ``{...}``, ``'{...}'`` (shell quotes), ``--kv-transfer-config '{...}'``,
    ``--kv-transfer-config={...}``, or a whole ``vllm serve ...`` command line with the flag in
    it (backslash-newline continuations included).
    """
    text = text.strip()
    if not text:
        problem = Problem("no --kv-transfer-config value given", hint="pass the JSON, a file or stdin")
        raise CompositionError([problem], filename)
    value = text
    if not text.startswith("{"):
        try:
            words = shlex.split(text.replace("\\\n", " "))
        except ValueError as exc:
            raise CompositionError([Problem(f"cannot split it as a shell would: {exc}")], filename) from None
        value = _flag_value(words, filename)
    deep = Problem(f"nested more than {MAX_DEPTH} levels deep", hint="a --kv-transfer-config needs a few")
    try:
        data = json.loads(value)
    except json.JSONDecodeError as exc:
        line, column = (exc.lineno, exc.colno) if value == text else (None, None)
        raise CompositionError(
            [Problem(f"not valid JSON: {exc.msg}", line=line, column=column, hint="the value of --kv-transfer-config")],
            filename,
        ) from None
    except RecursionError:
        raise CompositionError([deep], filename) from None
    if not isinstance(data, dict):
        problem = Problem(f"a --kv-transfer-config value is a JSON object, not {json_kind(data)}")
        raise CompositionError([problem], filename)
    if _depth(data) > MAX_DEPTH:
        raise CompositionError([deep], filename)
    return data


def json_kind(value: Any) -> str:
    """What a JSON value is, in words: ``an array``, ``a string``, ..."""
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "null"
    kinds = ((Mapping, "an object"), (list, "an array"), (str, "a string"), ((int, float), "a number"))
    return next((kind for cls, kind in kinds if isinstance(value, cls)), type(value).__name__)


def _depth(data: Any) -> int:
    """How deep objects and arrays nest in ``data`` (a scalar: 0), without recursion."""
    deepest, stack = 0, [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            children: Any = value.values()
        elif isinstance(value, list):
            children = value
        else:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def _flag_value(words: list[str], filename: str) -> str:
    for i, word in enumerate(words):
        if word.startswith(FLAG + "="):
            return word.split("=", 1)[1]
        if word == FLAG and i + 1 < len(words):
            return words[i + 1]
    if len(words) == 1:
        return words[0]
    raise CompositionError([Problem(f"no {FLAG} value in the command line")], filename)


def extra_of(cfg: Mapping[str, Any], at: DocPath = ()) -> Mapping[str, Any]:
    """``cfg``'s ``kv_connector_extra_config`` (absent or null: empty); anything but a JSON object
    is an error located at ``at`` (where ``cfg`` is in the whole config)."""
    extra = cfg.get("kv_connector_extra_config")
    if extra is None:
        return {}
    if not isinstance(extra, Mapping):
        raise CompositionError(
            [
                Problem(
                    f"expected a JSON object, got {json_kind(extra)}",
                    at + ("kv_connector_extra_config",),
                    "the connector's own settings by name; a MultiConnector's: "
                    f'{{"{CHILDREN_KEY}": [{{"kv_connector": ...}}, ...]}}',
                )
            ]
        )
    return extra


def is_composite(cfg: Mapping[str, Any]) -> bool:
    """vLLM's MultiConnector, kvcompose's, or a subclass of MultiConnector under another name
    (Dynamo's ``PdConnector``): whatever lists its children under ``connectors``."""
    extra = cfg.get("kv_connector_extra_config")
    listed = extra.get(CHILDREN_KEY) if isinstance(extra, Mapping) else None
    return cfg.get("kv_connector") in COMPOSITE_NAMES or isinstance(listed, list)


def entries(cfg: Mapping[str, Any]) -> list[Any]:
    """The children's configs: a composite's ``connectors`` list, or the single connector."""
    if not is_composite(cfg):
        return [cfg]
    listed = extra_of(cfg).get(CHILDREN_KEY)
    if not isinstance(listed, list) or not listed:
        raise CompositionError(
            [
                Problem(
                    f"a MultiConnector config lists its children under kv_connector_extra_config.{CHILDREN_KEY}",
                    ("kv_connector_extra_config", CHILDREN_KEY),
                    "a non-empty array of connector configs",
                )
            ]
        )
    return listed


def child_name(connector: str) -> str:
    """``NixlConnector`` -> ``nixl``, ``LMCacheConnectorV1`` -> ``lm-cache``, ``a.b.MyConnector`` -> ``my``."""
    base = connector.rsplit(".", 1)[-1]
    base = re.sub(r"Connector(V\d+)?$", "", base) or base
    words = re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "-", base).lower()
    return re.sub(r"[^a-z0-9_-]+", "-", words).strip("-")[:60] or "connector"


def child_data(
    entry: Any,
    index: int,
    name: str,
    types: Mapping[str, ConnectorType],
    default_role: Any,
    at: DocPath | None = None,
) -> dict[str, Any]:
    """One composition child for one entry: a built-in type that reads it whole, else ``vllm``.

    ``at``: where the entry is in the config (default: a composite's ``connectors[index]``; a
    single connector is the whole config, ``()``), for the errors; ``default_role`` is the
    composite's ``kv_role``, for an entry without one of its own.
    """
    if at is None:
        at = ("kv_connector_extra_config", CHILDREN_KEY, index)
    if not isinstance(entry, dict) or not isinstance(entry.get("kv_connector"), str):
        raise CompositionError([Problem("a child config is an object with a kv_connector name", at)])
    if entry.get("kv_role"):
        kv_role, role_at = entry["kv_role"], at + ("kv_role",)
    else:  # the composite's, where the entry has none
        kv_role, role_at = default_role or VLLM_ROLES["both"], ("kv_role",)
    role = ROLE_OF_KV_ROLE.get(kv_role) if isinstance(kv_role, str) else None
    if role is None:
        raise CompositionError(
            [Problem(f"unknown kv_role {kv_role!r}", role_at, "one of " + ", ".join(ROLE_OF_KV_ROLE))]
        )
    for ctype in [t for t in types.values() if t.name != TYPE_NAME]:
        options = ctype.options_from_vllm(entry)
        if options is None:
            continue
        try:
            converted = msgspec.convert(options, type=ctype.options, dec_hook=dec_hook)
        except msgspec.ValidationError:
            continue  # values this type refuses (a backend it does not know, ...): the generic type
        given = given_options(converted)  # a value equal to vLLM's default is left out, as vllm-args does
        return _child(name, ctype.name, role, {k: v for k, v in options.items() if k in given})
    generic = types.get(TYPE_NAME) or VllmType()
    options = generic.options_from_vllm(entry) or {}
    try:
        msgspec.convert(options, type=generic.options, dec_hook=dec_hook)
    except msgspec.ValidationError as exc:
        problem = msgspec_problem(exc, at, generic.options)
        hint = problem.hint
        if problem.message.startswith("unknown key"):
            hint = (
                "not a KVTransferConfig field, so vLLM would refuse it too; a connector's own setting "
                "goes inside the entry's kv_connector_extra_config"
            )
        raise CompositionError([Problem(problem.message, tuple(k for k in problem.path if k != KEY), hint)]) from None
    return _child(name, TYPE_NAME, role, options)


def _child(name: str, type_name: str, role: str, options: dict[str, Any]) -> dict[str, Any]:
    child: dict[str, Any] = {"name": name, "type": type_name, "role": role}
    if options:
        child["options"] = options
    return child


def composition_data(
    cfg: Mapping[str, Any], types: Mapping[str, ConnectorType], filename: str = "<composition>"
) -> dict[str, Any]:
    """The composition (plain data) that composes the children ``cfg`` configures.

    A config that does not say one is a :class:`CompositionError` naming ``filename`` (where
    ``cfg`` came from) and the key.
    """
    try:
        return _composition_data(cfg, types)
    except CompositionError as exc:
        raise CompositionError(exc.problems, filename) from None


def _composition_data(cfg: Mapping[str, Any], types: Mapping[str, ConnectorType]) -> dict[str, Any]:
    embedded = extra_of(cfg).get(EXTRA_KEY)
    if is_composite(cfg) and isinstance(embedded, Mapping) and "composition" in embedded:
        composition = embedded["composition"]
        if not isinstance(composition, Mapping):
            at = ("kv_connector_extra_config", EXTRA_KEY, "composition")
            raise CompositionError([Problem(f"expected a JSON object, got {json_kind(composition)}", at)])
        # The list beside it is what vLLM ran: a hand edit of it would be lost here without a word.
        refuse_mismatch(build(from_builtins(dict(composition))), entries(cfg))
        return dict(composition)
    listed = entries(cfg)
    names: list[str] = []
    for entry in listed:
        base = child_name(str(entry.get("kv_connector", ""))) if isinstance(entry, dict) else "connector"
        name, n = base, 1
        while name in names:
            n += 1
            name = f"{base}-{n}"
        names.append(name)
    if is_composite(cfg):
        default_role = cfg.get("kv_role")
        children = [child_data(e, i, n, types, default_role) for i, (e, n) in enumerate(zip(listed, names))]
    else:  # the config is the one child's
        children = [child_data(listed[0], 0, names[0], types, None, at=())]
    data: dict[str, Any] = {"version": 1, "connectors": children}
    if cfg.get("kv_load_failure_policy") in ("fail", "recompute"):
        data["load_failure"] = cfg["kv_load_failure_policy"]
    return data


def left_behind(cfg: Mapping[str, Any]) -> list[str]:
    """Keys of a composite's config that no child carries (vLLM's MultiConnector ignores them too)."""
    if not is_composite(cfg):
        return []
    top = [k for k in cfg if k not in COMPOSITE_KEYS and k != "kv_load_failure_policy"]
    given = cfg.get("kv_connector_extra_config")
    given = given if isinstance(given, Mapping) else {}
    extra = [f"kv_connector_extra_config.{k}" for k in given if k != CHILDREN_KEY]
    name = cfg.get("kv_connector")
    if name not in COMPOSITE_NAMES:
        module = cfg.get("kv_connector_module_path")
        where = f" from {module}" if module else ""
        top.insert(0, f"the composite {name}{where} (kvcompose's composite takes its place)")
    return top + extra


def to_yaml(data: Mapping[str, Any], origin: str, dropped: list[str]) -> str:
    """The composition file ``kvcompose import`` writes, with a header saying where it came from."""
    rules = ", ".join(f"{kind}: {DEFAULT_RULES[kind]}" for kind in ("load", "store", "metadata"))
    head = [
        f"# Imported by `kvcompose import` from {origin}.",
        f"# Rules: kvcompose's defaults ({rules}); the load order is the list order.",
        "# `kvcompose vllm-args` of this file gives back a --kv-transfer-config composing the same children.",
    ]
    if dropped:
        head.append("# Not carried over (no child reads them): " + ", ".join(dropped) + ".")
    body = yaml.safe_dump(dict(data), sort_keys=False, default_flow_style=False, width=120)
    return "\n".join(head) + "\n" + body


def describe(data: Mapping[str, Any]) -> str:
    """The children of an imported composition in one line: ``nixl (nixl, consumer), ...``."""
    parts = []
    for c in data["connectors"]:
        kind = c["type"]
        if kind == TYPE_NAME:
            kind += " " + c["options"]["kv_connector"]
        parts.append(f"{c['name']} ({kind}, {c['role']})")
    return ", ".join(parts)


_announced: set[str] = set()


def announce_dropin(data: Mapping[str, Any], logger: logging.Logger = log) -> None:
    """Log, once per process and composition, what a MultiConnector config without kvcompose's entry
    became (the composite passes a logger under vLLM's, so the line is in vLLM's own log)."""
    key = json.dumps(data, sort_keys=True, default=str)
    if key in _announced:
        return
    _announced.add(key)
    logger.info(
        "kvcompose: MultiConnector config taken as it is (no %r entry), composed with kvcompose's defaults "
        "(load: first-wins in list order, store: all, metadata: merge): %s; `kvcompose import` writes it as YAML",
        EXTRA_KEY,
        describe(data),
    )


# ------------------------------------------------------------------ drop-in (the composite's side)


def source(extra_config: Mapping[str, Any] | None, kv_role: str | None = None) -> Source:
    """The composition a composite's ``kv_connector_extra_config`` carries.

    kvcompose's own entry when there is one (``kvcompose vllm-args``); else, for vLLM's plain
    ``connectors`` list, the composition :func:`composition_data` makes of it (logged once).
    ``kv_role`` is the composite's, for entries that leave theirs out.
    """
    extra = extra_config or {}
    if not is_dropin(extra):
        return embedded(extra)
    cfg = {"kv_connector": CONNECTOR_NAME, "kv_role": kv_role, "kv_connector_extra_config": extra}
    return from_builtins(composition_data(cfg, get_plugins().connector_types, DROPIN_SOURCE), DROPIN_SOURCE)


def is_dropin(extra_config: Mapping[str, Any] | None) -> bool:
    """vLLM's own ``connectors`` list without kvcompose's entry (a config written for MultiConnector)."""
    extra = extra_config or {}
    return EXTRA_KEY not in extra and CHILDREN_KEY in extra


def child_configs(extra_config: Mapping[str, Any] | None, kv_role: str | None = None) -> list[dict[str, Any]]:
    """The children's ``KVTransferConfig`` kwargs: as listed, or as the drop-in composition renders them.

    A drop-in's entries for a built-in type are rendered by that type (kvcompose's NIXL and CPU
    offload subclasses); a ``vllm`` child's entry comes back as it was.
    """
    extra = extra_config or {}
    if not is_dropin(extra):
        listed = children_configs(extra)
        refuse_mismatch(build(embedded(extra)), listed)
        return listed
    return [c.vllm_config() for c in build(source(extra, kv_role)).children]


#: What a ``--kv-transfer-config``'s errors are reported against (it is no file).
CONFIG_NAME = FLAG


def refuse_mismatch(plan: Plan, listed: list[Any], filename: str = CONFIG_NAME) -> None:
    """Raise a located CompositionError when the listed entries are not what ``plan`` renders."""
    problem = listed_mismatch(plan, listed)
    if problem is not None:
        raise CompositionError([problem], filename)
