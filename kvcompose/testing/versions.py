"""What the kit and its tests need to know about the installed vLLM beyond what the engine asks.

The engine's own version differences are :mod:`kvcompose.vllm.surface`'s; the ones here only
tests and the kit's KV layout use:

- **Sleep mode.** vLLM 0.33 added it to the connector API (``supports_sleep_mode``,
  ``unregister_kv_caches``, ``restore_kv_caches``): :data:`HAS_SLEEP_MODE` says whether the
  installed vLLM makes those calls, :data:`INSTALLED_LACKS` which calls the composite declares
  that it does not make.
- **Moved helpers of vLLM's.** The kit's KV layout (:func:`kvcompose.testing.kv.make_engine_kv`)
  uses vLLM's KV cache planning, which 0.33 moved to another module
  (:func:`kv_cache_config_from_groups`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

from kvcompose.vllm.surface import provides

#: Whether the installed vLLM asks connectors about sleep mode (0.33 and later).
HAS_SLEEP_MODE = provides(KVConnectorBase_V1, "supports_sleep_mode")
#: The calls the composite declares that the installed vLLM does not make: vLLM 0.32 lacks
#: the sleep-mode calls; none from 0.33 on.
INSTALLED_LACKS: frozenset[str] = (
    frozenset() if HAS_SLEEP_MODE else frozenset({"supports_sleep_mode", "unregister_kv_caches", "restore_kv_caches"})
)


def kv_cache_config_from_groups() -> Callable[..., Any]:
    """vLLM's ``get_kv_cache_config_from_groups(vllm_config, groups, available_memory)``: in
    ``kv_cache_utils`` up to 0.32, in ``kv_cache_planning`` from 0.33."""
    for module in ("vllm.v1.core.kv_cache_planning", "vllm.v1.core.kv_cache_utils"):
        try:
            fn = getattr(importlib.import_module(module), "get_kv_cache_config_from_groups", None)
        except ImportError:
            continue
        if fn is not None:
            return fn
    raise ImportError("this vLLM has no get_kv_cache_config_from_groups (looked in kv_cache_planning, kv_cache_utils)")
