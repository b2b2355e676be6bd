"""The composition as vLLM's ``--kv-transfer-config``: written here, read back by the composite.

No vLLM import: ``kvcompose vllm-args`` runs without vLLM. The keys of
``kv_connector_extra_config`` that carry the composition are defined here only, next to both the
code that writes them (:func:`kv_transfer_config`) and the code that reads them back
(:func:`embedded`).
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping
from typing import Any

from kvcompose.catalog import Plan
from kvcompose.config import Source, from_builtins, to_builtins

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


def children_configs(extra_config: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """The children's ``KVTransferConfig`` kwargs from a ``kv_connector_extra_config``."""
    return list((extra_config or {}).get(CHILDREN_KEY) or [])


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
