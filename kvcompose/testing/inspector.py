"""The test kit's view into a composed connector: what a test asserts that vLLM never asks.

The composite (:class:`kvcompose.vllm.connector.KVComposeConnector`) carries no accessor for
tests; these functions read the same state from outside, so that a test can name a child, see
which children load a request, or see a child's state under the faults rule.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from kvcompose.contract import ChildState
    from kvcompose.vllm.connector import KVComposeConnector


def child(connector: KVComposeConnector, name: str) -> KVConnectorBase_V1:
    """The child connector instance for a composition name."""
    return connector.sub_connectors[connector.names.index(name)]


def loaders(connector: KVComposeConnector, request_id: str) -> tuple[str, ...]:
    """Names of the children loading (or chosen to load) a request's external KV (scheduler)."""
    return tuple(connector.names[c.child] for c in connector.loads.contributions(request_id))


def deferred_loaders(connector: KVComposeConnector, request_id: str) -> tuple[str, ...]:
    """Names of the children whose part of a request's load waits for the request's next
    schedule (a synchronous range of a mixed load, :meth:`LoadRule.deferred`)."""
    load = connector.loads.requests.get(request_id)
    part = load.deferred if load is not None else None
    return tuple(connector.names[c.child] for c in part.contributions) if part is not None else ()


def bypassed(connector: KVComposeConnector) -> tuple[str, ...]:
    """Names of the children bypassed now after a contained fault (open breakers included)."""
    return tuple(connector.names[i] for i in sorted(connector.bypassed))


def child_state(connector: KVComposeConnector, name: str) -> ChildState:
    """``closed``, ``open`` or ``half-open``: the child's state in this connector instance."""
    return connector.monitor.state(connector.names.index(name))


def bypass(connector: KVComposeConnector, name: str) -> None:
    """Bypass a child as the faults rule does after a failure (without one)."""
    connector._bypass(connector.names.index(name))


def call_again(connector: KVComposeConnector, name: str) -> None:
    """Call a child again from the next call on, as the faults rule lets one back (its calls
    looked up anew: a method patched on the instance since is called as patched)."""
    connector._call_again((connector.names.index(name),))
