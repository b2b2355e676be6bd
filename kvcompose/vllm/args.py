"""Rendering a plan as vLLM's ``--kv-transfer-config`` (no vLLM import needed)."""

from __future__ import annotations

import json
import shlex
from typing import Any

from kvcompose.compose import Plan
from kvcompose.config import to_builtins

MODULE = "kvcompose.vllm.connector"
#: The name vLLM special-cases for composites; the module path makes it load kvcompose's class.
CONNECTOR_NAME = "MultiConnector"


def _top_role(plan: Plan) -> str:
    # The P/D transport's role is the instance's role; a composition without one serves both.
    for c in plan.children:
        if c.type.param_keys:
            return c.vllm_role
    return "kv_both"


def kv_transfer_config(plan: Plan) -> dict[str, Any]:
    """``KVTransferConfig(**kv_transfer_config(plan))`` makes vLLM load the composed connector."""
    cfg: dict[str, Any] = {
        "kv_connector": CONNECTOR_NAME,
        "kv_connector_module_path": MODULE,
        "kv_role": _top_role(plan),
        "kv_connector_extra_config": {
            "connectors": [c.vllm_config() for c in plan.children],
            "kvcompose": {"composition": to_builtins(plan.composition), "source": plan.source.filename},
        },
    }
    if plan.composition.load_failure is not None:
        cfg["kv_load_failure_policy"] = plan.composition.load_failure
    return cfg


def render(plan: Plan, style: str = "json") -> str:
    """``json``: the value of ``--kv-transfer-config``; ``shell``: the whole flag, quoted."""
    value = json.dumps(kv_transfer_config(plan), separators=(",", ":"), sort_keys=False)
    if style == "shell":
        return "--kv-transfer-config " + shlex.quote(value)
    return value
