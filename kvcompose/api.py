"""The one face kvcompose shows its plugins: everything a connector-type plugin or a rule package
imports from kvcompose is here (docs/plugins.md, The plugin API).

Import from this module only::

    from kvcompose.api import ConnectorType, Options, hookimpl

Every other module of kvcompose is internal: it may change in any release, and a plugin that
imports it may break. A test checks that the built-in plugins and the example rule package
import nothing else of kvcompose. Tests of a plugin also use the test kit
(:mod:`kvcompose.testing`, the ``pytest11`` plugin), which is public for test authors.
"""

from __future__ import annotations

from kvcompose import NAME, hookimpl
from kvcompose.catalog import Child, ConnectorType, Listener, Options, Plan, Rule, given_options
from kvcompose.config import convert
from kvcompose.contract import (
    NO_HIT,
    NOT_READY,
    RULE_KINDS,
    Ask,
    ChildState,
    CompletionRule,
    Contribution,
    EngineFacts,
    FaultMonitor,
    FaultsRule,
    Isolation,
    LoadRule,
    MetadataRule,
    ParamsRule,
    RuleKind,
    Selection,
    StoreRule,
    TransferResults,
)
from kvcompose.errors import CompositionError, Problem, did_you_mean
from kvcompose.rules.checks import ChecksPlan
from kvcompose.rules.children import ChildrenParams, index, indices
from kvcompose.rules.load import FirstWins, StandardLoad
from kvcompose.transfer_params import MAX_HOST_CHARS, P2P_DECODER, P2P_PREFILLER, P2P_ROLE_KEYS, P2P_SOURCE
from kvcompose.units import ByteSize, beyond_host_memory, format_size

__all__ = [
    # hooks: mark implementations; the entry-point group is NAME
    "NAME",
    "hookimpl",
    # connector types and the resolved composition
    "ConnectorType",
    "Listener",
    "Options",
    "given_options",
    "Child",
    "Plan",
    "Rule",
    # errors located in the composition document
    "CompositionError",
    "Problem",
    "did_you_mean",
    "convert",
    # sizes in options
    "ByteSize",
    "beyond_host_memory",
    "format_size",
    # the rule contract: one Protocol per kind, and the data they exchange
    "RULE_KINDS",
    "RuleKind",
    "LoadRule",
    "StoreRule",
    "MetadataRule",
    "ParamsRule",
    "CompletionRule",
    "StandardLoad",
    "FaultsRule",
    "FaultMonitor",
    "Isolation",
    "ChildState",
    "ChecksPlan",
    "Ask",
    "Contribution",
    "Selection",
    "EngineFacts",
    "NOT_READY",
    "NO_HIT",
    "TransferResults",
    # built-in rules meant to be extended
    "FirstWins",
    # child-index helpers for rules that name children
    "ChildrenParams",
    "index",
    "indices",
    # kv_transfer_params: the p2p tier's roles, the longest host a role names
    "P2P_DECODER",
    "P2P_PREFILLER",
    "P2P_SOURCE",
    "P2P_ROLE_KEYS",
    "MAX_HOST_CHARS",
]
