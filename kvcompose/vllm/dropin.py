"""vLLM's MultiConnector ``connectors`` list read as a composition: what the composite does when
it is started from a config written for vLLM's MultiConnector (a drop-in), and what ``kvcompose
import`` (:mod:`kvcompose.vllm.migrate`) writes as YAML.

Each entry becomes a child named after its connector (``nixl``, ``nixl-2``, ``example``, ...) of
the first connector type whose :meth:`~kvcompose.catalog.ConnectorType.options_from_vllm` reads
the entry back whole (``NixlConnector`` -> ``nixl``, ``SimpleCPUOffloadConnector`` ->
``cpu-offload``), or else of the generic ``vllm`` type, which passes the entry to vLLM as it is.
The rules are kvcompose's defaults (``first-wins`` in list order, ``store: all``, ``metadata:
merge``). No vLLM import here.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from typing import Any

import msgspec

from kvcompose.catalog import ConnectorType, Plan, given_options
from kvcompose.compose import build
from kvcompose.config import KEY, VLLM_ROLES, Source, dec_hook, from_builtins, msgspec_problem
from kvcompose.errors import CompositionError, Problem
from kvcompose.errors import Path as DocPath
from kvcompose.generic import TYPE_NAME, VllmType
from kvcompose.plugins import get_plugins
from kvcompose.vllm.args import (
    CHILDREN_KEY,
    CONNECTOR_NAME,
    EXTRA_KEY,
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


def json_kind(value: Any) -> str:
    """What a JSON value is, in words: ``an array``, ``a string``, ..."""
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "null"
    kinds = ((Mapping, "an object"), (list, "an array"), (str, "a string"), ((int, float), "a number"))
    return next((kind for cls, kind in kinds if isinstance(value, cls)), type(value).__name__)


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


#: What a ``--kv-transfer-config``'s errors are reported against (it is no file).
CONFIG_NAME = FLAG


def refuse_mismatch(plan: Plan, listed: list[Any], filename: str = CONFIG_NAME) -> None:
    """Raise a located CompositionError when the listed entries are not what ``plan`` renders."""
    problem = listed_mismatch(plan, listed)
    if problem is not None:
        raise CompositionError([problem], filename)
