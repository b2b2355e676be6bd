"""``kvcompose import``: vLLM's ``--kv-transfer-config`` in, a composition file out.

Reads the JSON from what a user has at hand (the value, the flag, a whole command line), makes
the composition of its children as a drop-in composite would (:mod:`kvcompose.vllm.dropin`) and
writes it as YAML with a header saying where it came from and what was left behind. No vLLM
import here: ``kvcompose import`` runs without vLLM, and the engine never loads this module.
"""

from __future__ import annotations

import json
import logging
import shlex
from collections.abc import Mapping
from typing import Any

import yaml

from kvcompose.config import DEFAULT_RULES
from kvcompose.errors import CompositionError, Problem
from kvcompose.reader import MAX_DEPTH
from kvcompose.vllm.args import (
    CHILDREN_KEY,
)
from kvcompose.vllm.dropin import (
    COMPOSITE_NAMES,
    FLAG,
    is_composite,
    json_kind,
)

log = logging.getLogger("kvcompose.vllm")


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


# ------------------------------------------------------------------ drop-in (the composite's side)
