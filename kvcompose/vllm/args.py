"""The composition as vLLM's ``--kv-transfer-config``: written here, read back by the composite.

No vLLM import: ``kvcompose vllm-args`` runs without vLLM. The keys of
``kv_connector_extra_config`` that carry the composition are defined here only, next to both the
code that writes them (:func:`kv_transfer_config`) and the code that reads them back
(:func:`embedded`).
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping, Sequence
from typing import Any

from kvcompose.catalog import Plan
from kvcompose.config import Source, from_builtins, to_builtins
from kvcompose.errors import Problem

MODULE = "kvcompose.vllm.connector"
#: The name vLLM special-cases for composites; the module path makes it load kvcompose's class.
CONNECTOR_NAME = "MultiConnector"
#: ``kv_connector_extra_config`` keys: the children's configs (the key vLLM's own
#: ``MultiConnector`` checks read), and kvcompose's entry with the composition and its source.
CHILDREN_KEY = "connectors"
EXTRA_KEY = "kvcompose"


def kv_transfer_config(plan: Plan) -> dict[str, Any]:
    """``KVTransferConfig(**kv_transfer_config(plan))`` makes vLLM load the composed connector."""
    pd = plan.pd_transport
    cfg: dict[str, Any] = {
        "kv_connector": CONNECTOR_NAME,
        "kv_connector_module_path": MODULE,
        # The P/D transport's role is the instance's role; a composition without one serves both.
        "kv_role": pd.vllm_role if pd else "kv_both",
        "kv_connector_extra_config": {
            CHILDREN_KEY: [c.vllm_config() for c in plan.children],
            EXTRA_KEY: {"composition": to_builtins(plan.composition), "source": plan.source.filename},
        },
    }
    if plan.composition.load_failure is not None:
        cfg["kv_load_failure_policy"] = plan.composition.load_failure
    return cfg


def vllm_multiconnector(config: Mapping[str, Any]) -> dict[str, Any]:
    """The same children under vLLM's own ``MultiConnector``: ``config`` (what
    :func:`kv_transfer_config` rendered) without kvcompose's module path and composition, so
    vLLM loads its class, with its fixed rules (first child with a hit loads, every child saves).
    The benchmarks' baseline for the composite's own cost."""
    out = {k: v for k, v in config.items() if k != "kv_connector_module_path"}
    out["kv_connector_extra_config"] = {k: v for k, v in config["kv_connector_extra_config"].items() if k != EXTRA_KEY}
    return out


def listed_entries(extra_config: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """The children's ``KVTransferConfig`` kwargs as a ``kv_connector_extra_config`` lists them."""
    return list((extra_config or {}).get(CHILDREN_KEY) or [])


#: The entry fields that say which class vLLM loads for a child, and in which role: compared first.
IDENTITY = ("kv_connector", "kv_connector_module_path", "kv_role")
#: Where the listed entries are in a ``--kv-transfer-config``, for the errors.
LISTED_AT = ("kv_connector_extra_config", CHILDREN_KEY)
_REGENERATE = (
    "the composition and the connectors list must stay as `kvcompose vllm-args` wrote them; edit the "
    "YAML file and render the value again"
)


def listed_mismatch(plan: Plan, listed: Sequence[Any]) -> Problem | None:
    """The first way the listed entries (what vLLM instantiates) differ from what the children of
    the composition beside them (what the rules act on) render: their number, or an entry's field.

    Both copies come from one :func:`kv_transfer_config`, so any difference is a hand edit of one
    of them, which would hand one child's calls to another class or config than the rules think.
    """
    rendered = [c.vllm_config() for c in plan.children]
    if len(listed) != len(rendered):
        return Problem(
            f"lists {len(listed)} connectors, but the composition beside it has {len(rendered)} "
            f"({', '.join(plan.names)})",
            LISTED_AT,
            _REGENERATE,
        )
    for index, (entry, want) in enumerate(zip(listed, rendered, strict=True)):
        problem = _entry_mismatch(plan, index, entry, want, rendered)
        if problem is not None:
            return problem
    return None


def _entry_mismatch(
    plan: Plan, index: int, entry: Any, want: Mapping[str, Any], rendered: Sequence[Mapping[str, Any]]
) -> Problem | None:
    """How entry ``index`` differs from child ``index``'s rendering, in the first field that does."""
    child = plan.children[index]
    of_child = f"child {index} of the composition ({child.name}, type {child.type.name})"
    if not isinstance(entry, Mapping):
        return Problem(f"is not an object, but {of_child} renders one", LISTED_AT + (index,), _REGENERATE)
    differs = _first_difference(entry, want)
    if differs is None:
        return None
    where, got, expected = differs
    renders = "leaves it unset" if expected is None else f"renders {_shown(expected)}"
    return Problem(
        f"is {'unset' if got is None else _shown(got)}, but {of_child} {renders}",
        LISTED_AT + (index, *where),
        _moved(plan, entry, index, rendered) or _REGENERATE,
    )


def _first_difference(entry: Mapping[str, Any], want: Mapping[str, Any]) -> tuple[tuple[str, ...], Any, Any] | None:
    """The first field whose value differs (class and role first; inside the extra config, the
    key), with the entry's value and the rendered one."""
    for key in [*IDENTITY, *sorted((set(entry) | set(want)) - set(IDENTITY), key=str)]:
        got, expected = entry.get(key), want.get(key)
        if key == "kv_connector_extra_config":  # unset is vLLM's default, {}
            got, expected = got or {}, expected or {}
            if isinstance(got, Mapping) and got != expected:
                inner = next(k for k in sorted(set(got) | set(expected), key=str) if got.get(k) != expected.get(k))
                return (key, inner), got.get(inner), expected.get(inner)
        if got != expected:
            return (key,), got, expected
    return None


def _moved(plan: Plan, entry: Mapping[str, Any], index: int, rendered: Sequence[Mapping[str, Any]]) -> str | None:
    """When the entry is another child's (the list was reordered), which child's."""
    for other, want in enumerate(rendered):
        if other != index and _first_difference(entry, want) is None:
            return (
                f"it is the entry of child {other} ({plan.children[other].name}): the list's order differs from "
                f"the composition's; {_REGENERATE}"
            )
    return None


def _shown(value: Any, limit: int = 80) -> str:
    """A value as the error quotes it: its repr, cut to a readable length."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def embedded(extra_config: Mapping[str, Any] | None) -> Source:
    """The composition that :func:`kv_transfer_config` embedded, validated again."""
    data = (extra_config or {}).get(EXTRA_KEY)
    if data is None:
        raise ValueError(
            f"kv_connector_extra_config has no {EXTRA_KEY!r} entry and no {CHILDREN_KEY!r} list: start vLLM "
            "with the arguments that `kvcompose vllm-args FILE` prints, or list the children as for "
            "vLLM's MultiConnector"
        )
    return from_builtins(data["composition"], data.get("source", "<kv_connector_extra_config>"))


def render(plan: Plan, style: str = "json") -> str:
    """``json``: the value of ``--kv-transfer-config``; ``shell``: the whole flag, quoted."""
    value = json.dumps(kv_transfer_config(plan), separators=(",", ":"), sort_keys=False)
    if style == "shell":
        return "--kv-transfer-config " + shlex.quote(value)
    return value
