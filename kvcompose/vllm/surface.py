"""The one place where the engine's code copes with the differences between the vLLMs kvcompose supports.

kvcompose supports vLLM 0.32 and 0.33 (:data:`kvcompose.versions.VLLM`, docs/versions.md). Code
elsewhere asks this module instead of testing vLLM's modules and classes itself, so a new vLLM
is one module's work:

- **Calls a child may lack.** vLLM 0.33 added sleep mode to the connector API
  (``supports_sleep_mode``, ``unregister_kv_caches``, ``restore_kv_caches``). The composite
  forwards those calls on every vLLM, to the children that have them (:func:`provides`); a child
  class written for 0.32 has none of them and does not support sleep mode (:func:`sleep_mode`).
- **Calls kvcompose does not know.** An engine call of a newer vLLM's base class that the
  composite does not define (:func:`unknown_calls`) is forwarded to every child and the answers
  combined by :func:`kvcompose.merge.merge_values`
  (:func:`kvcompose.vllm.connector.forward_unknown_calls`), instead of vLLM's do-nothing default
  answering for the children.

Transfer-result fields kvcompose does not know are carried through by
:class:`kvcompose.vllm.metadata.ResultsCodec` (it reads the fields of vLLM's class, whatever the
version). What only the test kit and the tests need to know of the installed vLLM (whether it
has sleep mode, where it keeps its KV cache planning) is :mod:`kvcompose.testing.versions`'s.
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

if TYPE_CHECKING:
    from vllm.config.kv_transfer import KVTransferConfig

log = logging.getLogger("kvcompose.vllm")

#: Base-class members whose base implementation is right for the composite too (vLLM's own
#: MultiConnector guard exempts the same two).
NOT_FORWARDED = frozenset({"role", "has_connector_metadata"})


def provides(connector: object, call: str) -> bool:
    """Whether a connector (instance or class) has the engine call ``call``: a class written for
    an older vLLM may lack a call a newer vLLM added (the sleep-mode calls before 0.33)."""
    return callable(getattr(connector, call, None))


def sleep_mode(cls: type, kv_transfer_config: KVTransferConfig) -> bool:
    """Whether a child connector class supports sleep mode, as vLLM 0.33 asks it; a class
    without the classmethod (written for vLLM 0.32) does not."""
    if not provides(cls, "supports_sleep_mode"):
        return False
    return bool(cls.supports_sleep_mode(kv_transfer_config))


def base_calls(base: type = KVConnectorBase_V1) -> dict[str, str]:
    """The installed vLLM's connector API: each public member of ``KVConnectorBase_V1`` (or
    ``base``) and its kind (``method``, ``classmethod``, ``property``)."""
    out = {}
    for name, member in inspect.getmembers_static(base):
        if name.startswith("_"):
            continue
        if isinstance(member, classmethod):
            out[name] = "classmethod"
        elif isinstance(member, property):
            out[name] = "property"
        elif callable(member):
            out[name] = "method"
    return out


def unknown_calls(cls: type, base: type = KVConnectorBase_V1) -> list[str]:
    """The engine calls of vLLM's base class (or ``base``) that ``cls`` does not define itself:
    it lacks them or inherits vLLM's default."""
    return sorted(
        name
        for name in base_calls(base)
        if name not in NOT_FORWARDED
        and inspect.getattr_static(cls, name, None) in (None, inspect.getattr_static(base, name))
    )


@functools.cache
def warn_generic(name: str) -> None:
    """Say once per process that an engine call is forwarded by the generic rule."""
    log.warning(
        "vLLM calls %s, which this kvcompose does not know: forwarded to every child, answers merged by type "
        "(docs/versions.md)",
        name,
    )
