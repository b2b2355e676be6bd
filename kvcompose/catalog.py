"""What plugins contribute (connector types, rules) and what they are given (children, the plan).

A plugin returns instances of :class:`ConnectorType` from ``kvcompose_connector_types`` and
:class:`Rule` objects from ``kvcompose_rules``; types and rules are handed :class:`Child` and
:class:`Plan`, plain data that :mod:`kvcompose.compose` resolves. Nothing here imports vLLM: a
connector type describes the vLLM child it stands for as a plain ``KVTransferConfig`` dict.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar, Generic, TypeVar

import msgspec
import msgspec.structs

from kvcompose.config import VLLM_ROLES, Composition, Role, Source
from kvcompose.contract import (
    RULE_KINDS,
    CompletionRule,
    FaultsRule,
    LoadRule,
    MetadataRule,
    ParamsRule,
    RuleKind,
    RuleObject,
    StoreRule,
)
from kvcompose.errors import Problem


class Options(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Base class for a connector type's options: unknown keys are errors, not silently ignored.

    Describe each field with ``Annotated[..., msgspec.Meta(description=...)]``: that is what
    ``kvcompose schema`` shows editors, so a ``#:`` comment alone never reaches a user.
    """


class NoOptions(Options):
    """For types that take no options."""


def given_options(options: Options) -> dict[str, Any]:
    """The fields whose value differs from the field's default, by name, in declaration order.

    Only these are rendered for vLLM: declare a default equal to vLLM's own (or None for "vLLM
    decides") and a value the user did not change never reaches vLLM's arguments, which keeps
    them minimal and lets vLLM's defaults evolve. A required field is always given.
    """
    given: dict[str, Any] = {}
    for f in msgspec.structs.fields(options):
        value = getattr(options, f.name)
        if f.default is not msgspec.NODEFAULT:
            default = f.default
        elif f.default_factory is not msgspec.NODEFAULT:
            default = f.default_factory()
        else:
            given[f.name] = value
            continue
        if value != default:
            given[f.name] = value
    return given


def vllm_value(value: Any) -> Any:
    """An option value as plain builtins: lists for sequences, ``int`` for ``ByteSize`` and the like.

    The rendered config becomes JSON on vLLM's command line, and vLLM compares values against
    builtins, so subclasses and tuples must not leak through.
    """
    if value is None or isinstance(value, bool):
        return value
    for plain in (int, float, str):
        if isinstance(value, plain):
            return plain(value)
    if isinstance(value, msgspec.Struct):
        return vllm_value(msgspec.structs.asdict(value))
    if isinstance(value, Mapping):
        return {str(k): vllm_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [vllm_value(v) for v in value]
    return value


@dataclass(frozen=True)
class Listener:
    """A TCP port a child's engine binds (a handshake side channel, a tier's control socket):
    kvcompose refuses a composition in which two of them would bind the same one.

    ``host`` and ``port`` as the engine resolves them; ``set_by`` says where they come from (the
    option, or the environment variable and its default) and ``path`` locates the option.
    vLLM adds the data-parallel index to every such base port, so equal bases clash at every index.
    """

    what: str
    host: str
    port: int
    set_by: str
    path: tuple[str | int, ...]


class ConnectorType:
    """A kind of child connector, as a plugin describes it to kvcompose.

    Subclass it and set the class attributes: :attr:`vllm_connector`, :attr:`vllm_module_path`
    and the two key maps are enough for the default :meth:`vllm_config`, which renders only the
    options the user set. Override :meth:`connector_name` when an option picks the vLLM class,
    and :meth:`vllm_config` only for a config the maps cannot express. The composed connector
    instantiates the vLLM class that the config names, so the type never has to import vLLM at
    description time.
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
    #: It is the instance's P/D transport: its role is the instance's ``kv_role``, and it owns
    #: the P/D ``kv_transfer_params`` (NIXL is; a prefix tier is not).
    pd_transport: ClassVar[bool] = False
    #: It can load a *range* that does not start at the request's local prefix end: asked
    #: ``get_num_new_matched_tokens(request, n)`` with ``n`` beyond that end, it answers for
    #: the tokens from ``n`` on and, in ``update_state_after_alloc``, loads only those, into the
    #: blocks from ``n // block_size`` on (the ``ranges`` load rule offers such a child the
    #: tokens the children above it do not cover; any other child only the local prefix end).
    range_loads: ClassVar[bool] = False
    #: Tokens a range this type loads must start at a multiple of, when coarser than vLLM's
    #: block size (0: the block size is enough).
    range_alignment: ClassVar[int] = 0
    #: Engine calls whose implementation in this type's connector class does nothing and answers
    #: ``None`` (vLLM's per-layer hooks of a connector that moves KV per step): the composite does
    #: not call them (docs/performance.md, worker step). A plugin's test pins each against the class.
    empty_calls: ClassVar[frozenset[str]] = frozenset()
    #: The ``kv_transfer_params`` keys this type reads and returns (the ``owners`` params rule
    #: gives each key to the type that declares it).
    param_keys: ClassVar[frozenset[str]] = frozenset()
    #: The vLLM connector class name (``kv_connector``). Keep the name vLLM knows, even for a
    #: subclass: vLLM looks connectors up by that literal name in several places.
    vllm_connector: ClassVar[str]
    #: The module vLLM imports that class from (``kv_connector_module_path``): point it at your
    #: subclass. None: vLLM's own registry resolves the name.
    vllm_module_path: ClassVar[str | None] = None
    #: Option field -> the ``kv_connector_extra_config`` key it is rendered as.
    extra_config_keys: ClassVar[Mapping[str, str]] = MappingProxyType({})
    #: Option field -> the top-level ``KVTransferConfig`` field it is rendered as.
    top_level_keys: ClassVar[Mapping[str, str]] = MappingProxyType({})

    def connector_name(self, child: Child) -> str:
        """The ``kv_connector`` for this child: :attr:`vllm_connector`, unless an option picks the class."""
        name = getattr(self, "vllm_connector", None)
        if not name:
            raise NotImplementedError(f"{type(self).__name__} sets neither vllm_connector nor vllm_config()")
        return name

    def vllm_config(self, child: Child) -> dict[str, Any]:
        """The child's ``KVTransferConfig`` keyword arguments, ``kv_role`` excluded (kvcompose sets it).

        The connector name and module path, then each option the user set (see
        :func:`given_options`) under the key the two maps give it. An option in neither map is
        not rendered: the type reads it itself (``describe``, ``check``, ``connector_name``).
        """
        cfg: dict[str, Any] = {"kv_connector": self.connector_name(child)}
        if self.vllm_module_path is not None:
            cfg["kv_connector_module_path"] = self.vllm_module_path
        given = given_options(child.options)
        for option, key in self.top_level_keys.items():
            if option in given:
                cfg[key] = vllm_value(given[option])
        cfg["kv_connector_extra_config"] = {
            key: vllm_value(given[option]) for option, key in self.extra_config_keys.items() if option in given
        }
        return cfg

    def options_from_vllm(self, config: Mapping[str, Any]) -> dict[str, Any] | None:
        """The ``options:`` that render ``config`` (a child's ``KVTransferConfig`` kwargs), or None.

        The inverse of :meth:`vllm_config`, for ``kvcompose import`` and for a MultiConnector
        config taken as it is: ``config`` names this type's :attr:`vllm_connector` (without a
        module path, or with this type's own) and each other key is one the two key maps render.
        ``kv_role`` is the child's role, not an option, and is ignored here. Override it when an
        option picks the class (:meth:`connector_name`).
        """
        name = getattr(self, "vllm_connector", None)
        if not name or config.get("kv_connector") != name:
            return None
        return self.options_from_keys(config)

    def options_from_keys(self, config: Mapping[str, Any]) -> dict[str, Any] | None:
        """The options the two key maps read back from ``config``; None when a key has no option.

        The connector's name is the caller's to check; the module path may be unset (vLLM's own
        class, which this type stands for) or this type's.
        """
        if config.get("kv_connector_module_path") not in (None, self.vllm_module_path):
            return None
        top = {key: option for option, key in self.top_level_keys.items()}
        extra = {key: option for option, key in self.extra_config_keys.items()}
        options: dict[str, Any] = {}
        for key, value in config.items():
            if key in ("kv_connector", "kv_connector_module_path", "kv_role"):
                continue
            if key == "kv_connector_extra_config":
                if not isinstance(value, Mapping):
                    return None
                for k, v in value.items():
                    if k not in extra:
                        return None
                    options[extra[k]] = v
            elif key in top:
                options[top[key]] = value
            else:
                return None
        return options

    def specialised(self, options: Options) -> ConnectorType:
        """This type as a child with these options sees it: ``self`` unless a trait is an option.

        The class attributes above (``range_loads``, ``param_keys``, ...) are what every rule
        reads; a type whose options declare some of them (the generic ``vllm`` type does)
        returns an instance carrying the declared values. Called once per child when a
        composition is resolved.
        """
        return self

    def describe(self, child: Child) -> str:
        """What this child does in the composition, in plain words: one sentence, or one fact a
        line (``explain`` prints each line under the child; ``check`` too unless :meth:`brief`)."""
        return self.summary

    def brief(self, child: Child) -> str:
        """What ``check`` prints under the child: one short fact a line (under about 70 characters:
        the screen's 100 less the indent); default :meth:`describe`, whose detail ``explain`` shows."""
        return self.describe(child)

    def check(self, child: Child, plan: Plan) -> Iterable[Problem]:
        """Problems that only this type can see (conflicting ports, a missing path, ...).

        A problem with ``warning=True`` is reported without refusing the composition.
        """
        return ()

    def listeners(self, child: Child) -> Iterable[Listener]:
        """The ports this child's engine binds (kvcompose refuses two children on one)."""
        return ()

    def kv_layout(self, child: Child) -> str | None:
        """The KV cache layout this child requires, when it is known without vLLM (else None)."""
        return None

    def save_hooks_needed(self, child: Child) -> str | None:
        """Why this child's worker must receive the save hooks, or None when it may go without.

        A child whose scheduler half plans saves that only its worker's ``save_kv_layer`` or
        ``wait_for_save`` carries out (and holds blocks until they are reported done) cannot be
        left out of the store rule's targets: its saves would never run and its blocks never be
        freed. The reason completes "..., but it ...", e.g. "plans a store of every new block".
        """
        return None


OptionsT = TypeVar("OptionsT", bound=Options)


@dataclass(frozen=True)
class Child:
    """One resolved child of a composition: its place, name, type and validated options."""

    index: int  # position in the YAML list: the order load rules ask children in
    name: str
    type: ConnectorType
    role: Role
    options: Options
    #: The composition's P/D transport where it is another child (its name), else None: a child
    #: that could also carry P/D (native-offload's p2p tier) then leaves the P/D legs to it.
    transport: str | None = None

    @property
    def vllm_role(self) -> str:
        return VLLM_ROLES[self.role]

    def options_as(self, cls: type[OptionsT]) -> OptionsT:
        """The options, typed: ``child.options_as(NixlOptions)``; raises for another type's child."""
        if not isinstance(self.options, cls):
            raise TypeError(f"{self.name} is a {self.type.name} child; its options are not {cls.__name__}")
        return self.options

    def vllm_config(self) -> dict[str, Any]:
        """The child's full ``KVTransferConfig`` kwargs (the type's, plus the role)."""
        cfg = dict(self.type.vllm_config(self))
        cfg["kv_role"] = self.vllm_role
        return cfg


T = TypeVar("T", bound=RuleObject)


@dataclass(frozen=True)
class Rule(Generic[T]):
    """A named policy for one kind of engine call.

    ``build(children, params)`` runs once when a composition is resolved and returns the rule
    object that the plan keeps: an implementation of the kind's Protocol in
    :mod:`kvcompose.contract` (checked when the plan is built). Per-request calls go to
    that object directly, never through pluggy.
    """

    kind: RuleKind
    name: str
    summary: str
    build: Callable[[tuple[Child, ...], Any], T]
    #: Struct for the rule's parameters (``load: {use: longest-hit, ...}``); None: takes none.
    params: type[msgspec.Struct] | None = None
    #: One line for ``kvcompose explain``, given the children and params (``check`` too without ``brief``).
    explain: Callable[[tuple[Child, ...], Any], str] | None = field(default=None, compare=False)
    #: The same in under 100 characters, for ``kvcompose check`` (None: :attr:`explain`'s line).
    brief: Callable[[tuple[Child, ...], Any], str] | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Plan:
    """A composition resolved against the installed plugins: what the vLLM adapter executes.

    Every field is plain data or a rule object, so the per-request path calls rule objects and
    children directly, never through pluggy.
    """

    source: Source
    children: tuple[Child, ...]
    #: Per kind, the chosen rule and its validated parameters (None: it takes none).
    rules: dict[RuleKind, Rule[Any]]
    rule_params: dict[RuleKind, Any]
    load: LoadRule
    store: StoreRule
    metadata: MetadataRule
    params: ParamsRule
    completion: CompletionRule
    faults: FaultsRule
    #: Log every hook and child call (``KVCOMPOSE_TRACE``).
    trace: bool = False
    #: What the checks warn of (located, :attr:`Problem.warning` set); the plan runs anyway.
    warnings: tuple[Problem, ...] = ()
    #: Whether the checks imported the modules the composition names (a ``vllm`` child's
    #: ``kv_connector_module_path``): importing runs their code, so the engine does (it imports
    #: them anyway) and the CLI only when asked (``--import-modules``).
    import_modules: bool = False

    @property
    def composition(self) -> Composition:
        return self.source.composition

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.children)

    def child(self, name: str) -> Child:
        for c in self.children:
            if c.name == name:
                return c
        raise KeyError(name)

    @property
    def handshake_children(self) -> tuple[int, ...]:
        """Children that exchange handshake metadata (each gets only its own back)."""
        return tuple(c.index for c in self.children if c.type.owns_handshake)

    @property
    def host_buffer_owner(self) -> int | None:
        """The child that receives vLLM's host-buffer copy op (checks allow at most one)."""
        return next((c.index for c in self.children if c.type.owns_host_buffer_ops), None)

    @property
    def pd_transport(self) -> Child | None:
        """The P/D transport child, if any (checks allow at most one)."""
        return next((c for c in self.children if c.type.pd_transport), None)

    def summary(self) -> list[str]:
        """What ``kvcompose check`` prints: the children and rules, one short fact a line
        (:meth:`explain` has the details)."""
        lines = ["children, in load priority order:"]
        for c in self.children:
            first, *facts = c.type.brief(c).split("\n")
            lines.append(f"  {c.index + 1}. {c.name} ({c.type.name}, {c.role}): {first}")
            lines.extend(f"       {fact}" for fact in facts)
        for kind in RULE_KINDS:
            rule = self.rules[kind]
            say = rule.brief or rule.explain
            lines.append(say(self.children, self.rule_params[kind]) if say else f"{kind}: {rule.name}")
        lines.append("a failed load: " + _LOAD_FAILURE[self.composition.load_failure])
        return lines

    def explain(self) -> list[str]:
        """The plan in plain words: who loads first, who stores, who owns what."""
        lines = ["children, in load priority order:"]
        for c in self.children:
            first, *facts = c.type.describe(c).split("\n")
            lines.append(f"  {c.index + 1}. {c.name} ({c.type.name}, {c.role}): {first}")
            lines.extend(f"       {fact}" for fact in facts)
        for kind in RULE_KINDS:
            rule = self.rules[kind]
            text = rule.explain(self.children, self.rule_params[kind]) if rule.explain else f"{kind}: {rule.name}"
            lines.append(text)
        owners = [self.children[i].name for i in self.handshake_children]
        if len(owners) == 1:
            handshake = f"{owners[0]} exchanges its own handshake metadata"
        elif owners:
            handshake = ", ".join(owners) + " exchange their own handshake metadata, kept apart per child"
        else:
            handshake = "no child uses a handshake"
        lines.append("handshake: " + handshake)
        pd = self.pd_transport
        lines.append("P/D kv_transfer_params: " + (pd.name if pd else "none (no P/D transport)"))
        if pd is not None and len(self.children) > 1:
            lines.append(f"each worker step: {pd.name}'s reads are posted before the other children start their loads")
        owner = self.host_buffer_owner
        lines.append("host-buffer copies: " + (self.children[owner].name if owner is not None else "no child"))
        lines.append("a failed load: " + _LOAD_FAILURE[self.composition.load_failure])
        return lines


_LOAD_FAILURE = {
    None: "vLLM's default (fail): the request ends with an error",
    "fail": "the request ends with an error (vLLM's kv_load_failure_policy=fail)",
    "recompute": "the prompt is computed locally (vLLM's kv_load_failure_policy=recompute)",
}
