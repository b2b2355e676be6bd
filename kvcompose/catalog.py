"""What plugins contribute: connector types and rules.

A plugin returns instances of :class:`ConnectorType` from ``kvcompose_connector_types`` and
:class:`Rule` objects from ``kvcompose_rules``. Nothing here imports vLLM: a connector type
describes the vLLM child it stands for as a plain ``KVTransferConfig`` dict.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import msgspec

from kvcompose.errors import Problem

if TYPE_CHECKING:
    from kvcompose.compose import Child, Plan

Role = Literal["producer", "consumer", "both"]
RuleKind = Literal["load", "store", "metadata", "params", "completion", "faults"]
RULE_KINDS: tuple[RuleKind, ...] = ("load", "store", "metadata", "params", "completion", "faults")

#: vLLM's spelling of a child's role.
VLLM_ROLES: dict[str, str] = {"producer": "kv_producer", "consumer": "kv_consumer", "both": "kv_both"}


class Options(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Base class for a connector type's options: unknown keys are errors, not silently ignored."""


class NoOptions(Options):
    """For types that take no options."""


class ConnectorType:
    """A kind of child connector, as a plugin describes it to kvcompose.

    Subclass it, set the class attributes, and implement :meth:`vllm_config`. The composed
    connector instantiates the vLLM class that the returned config names, so the type never has to
    import vLLM at description time.
    """

    #: The ``type:`` value in a composition file.
    name: ClassVar[str]
    #: One line for ``kvcompose plugins``.
    summary: ClassVar[str] = ""
    #: The msgspec Struct that validates ``options:``.
    options: ClassVar[type[Options]] = NoOptions
    #: It exchanges handshake metadata between worker and scheduler (P/D transports do).
    owns_handshake: ClassVar[bool] = False
    #: It wants vLLM's host-buffer copy op (``set_host_xfer_buffer_ops``).
    owns_host_buffer_ops: ClassVar[bool] = False
    #: The ``kv_transfer_params`` keys this type reads and returns.
    param_keys: ClassVar[frozenset[str]] = frozenset()

    def vllm_config(self, child: "Child") -> dict[str, Any]:
        """The child's ``KVTransferConfig`` keyword arguments, ``kv_role`` excluded (kvcompose sets it)."""
        raise NotImplementedError

    def describe(self, child: "Child") -> str:
        """One sentence, in plain words, of what this child does in the composition."""
        return self.summary

    def check(self, child: "Child", plan: "Plan") -> Iterable[Problem]:
        """Problems that only this type can see (conflicting ports, a missing path, ...)."""
        return ()

    def kv_layout(self, child: "Child") -> str | None:
        """The KV cache layout this child requires, when it is known without vLLM (else None)."""
        return None


@dataclass(frozen=True)
class Rule:
    """A named policy for one kind of engine call.

    ``build(children, params)`` runs once when a composition is resolved and returns the object
    that the call plan keeps (see ``kvcompose.rules`` for what each kind returns). Per-request
    calls go to that object directly, never through pluggy.
    """

    kind: RuleKind
    name: str
    summary: str
    build: Callable[[tuple["Child", ...], Any], Any]
    #: Struct for the rule's parameters (``load: {use: longest-hit, ...}``); None: takes none.
    params: type[msgspec.Struct] | None = None
    #: One line for ``kvcompose check``, given the children and params.
    explain: Callable[[tuple["Child", ...], Any], str] | None = field(default=None, compare=False)
