"""The generic connector type ``vllm``: any connector vLLM can load, as a child of a composition.

A child of this type names a connector the way ``--kv-transfer-config`` does: a name vLLM's
``KVConnectorFactory`` registers (``ExampleConnector``, ``LMCacheConnectorV1``,
``MooncakeStoreConnector``, ...) or a class in a module (``kv_connector_module_path``). Its
``kv_connector_extra_config`` and the other ``KVTransferConfig`` fields are passed to vLLM as
they are; its ``role:`` is its ``kv_role``. Example::

    connectors:
      - name: disk
        type: vllm
        options:
          kv_connector: ExampleConnector
          kv_connector_extra_config: {shared_storage_path: /var/cache/kv}

Such a child takes part in every rule with what kvcompose can know of its class: it declares no
``kv_transfer_params`` keys (so under ``params: owners`` a key it returns is kept when no child
above it returned it first), it loads only from the local prefix end (``load: ranges`` offers it
no range) unless its options declare ``range_loads``, and it never owns vLLM's host-buffer copy
op. What vLLM asks of the class itself (KV layout, HMA, handshake, stats) the composed connector
asks the class at engine start. Nothing here imports vLLM unless a check runs where vLLM is
installed, which resolves the class as vLLM would: a name through vLLM's registry, and a module
path only when the plan allows imports (:attr:`~kvcompose.catalog.Plan.import_modules`: the
engine's plan does; ``kvcompose check`` only with ``--import-modules``), since importing a module
a file names runs that module's code.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

import msgspec
from msgspec import Meta

from kvcompose import hookimpl
from kvcompose.catalog import ConnectorType, Options, vllm_value
from kvcompose.errors import Problem, did_you_mean

if TYPE_CHECKING:
    from kvcompose.catalog import Child, Plan

TYPE_NAME = "vllm"

_NonEmpty = Annotated[str, Meta(min_length=1)]


class VllmOptions(Options):
    """``options:`` of a ``vllm`` child: vLLM's own ``KVTransferConfig`` keys, plus two declarations.

    The ``kv_*`` keys are rendered as they are (an unset one is left to vLLM's default); ``kv_role``
    is the child's ``role:``. ``range_loads``, ``range_alignment`` and ``param_keys`` are never
    passed to vLLM: they declare what kvcompose cannot learn from the class.
    """

    kv_connector: Annotated[
        _NonEmpty,
        Meta(description="the connector: a name vLLM registers, or a class in kv_connector_module_path"),
    ]
    kv_connector_module_path: Annotated[
        _NonEmpty | None,
        Meta(description="the module vLLM imports kv_connector from; unset: vLLM's registry resolves the name"),
    ] = None
    kv_connector_extra_config: Annotated[
        dict[str, Any],
        Meta(description="the connector's own settings, passed to vLLM as is"),
    ] = msgspec.field(default_factory=dict)
    kv_buffer_device: Annotated[
        _NonEmpty | None, Meta(description="the device the connector buffers KV on; unset: the platform's")
    ] = None
    kv_port: Annotated[
        Annotated[int, Meta(ge=0, le=65535)] | None, Meta(description="the connector's port (vLLM's kv_port)")
    ] = None
    engine_id: Annotated[_NonEmpty | None, Meta(description="this child's engine id; unset: the engine's")] = None
    enable_permute_local_kv: Annotated[
        bool | None, Meta(description="vLLM's experimental HND-to-NHD transfer flag")
    ] = None
    kv_load_failure_policy: Annotated[
        Literal["fail", "recompute"] | None,
        Meta(description="the entry's own kv_load_failure_policy (vLLM reads the composite's; `load_failure:`)"),
    ] = None
    range_loads: Annotated[
        bool,
        Meta(
            description="declare that the connector loads a range that starts after the local prefix "
            "(see ConnectorType.range_loads); not passed to vLLM"
        ),
    ] = False
    range_alignment: Annotated[
        int,
        Meta(ge=0, description="with range_loads: tokens a range must start at a multiple of; not passed to vLLM"),
    ] = 0
    param_keys: Annotated[
        list[_NonEmpty],
        Meta(description="declare the kv_transfer_params keys the connector owns (params: owners); not passed to vLLM"),
    ] = msgspec.field(default_factory=list)
    needs_save_hooks: Annotated[
        bool | None,
        Meta(
            description="declare that the connector's worker must get the save hooks, because its scheduler holds "
            "KV blocks until a save it planned is reported done (a store rule may not leave it out); unset: "
            "known for vLLM's own such connectors (HOLDS_BLOCKS_FOR_SAVES); not passed to vLLM"
        ),
    ] = None


#: Option -> the top-level ``KVTransferConfig`` field it is rendered as (the same name).
TOP_LEVEL: tuple[str, ...] = (
    "kv_connector_module_path",
    "kv_buffer_device",
    "kv_port",
    "engine_id",
    "enable_permute_local_kv",
    "kv_load_failure_policy",
)


#: vLLM connectors, by name, whose scheduler holds KV blocks until a save it planned is reported
#: done, and what that does when the worker never gets the save hooks (a ``vllm`` child's
#: ``needs_save_hooks`` unset). The cpu-offload type says it for its own child, with its mode.
HOLDS_BLOCKS_FOR_SAVES: Mapping[str, str] = {
    "SimpleCPUOffloadConnector": (
        "is vLLM's SimpleCPUOffloadConnector: its scheduler plans stores that only its worker's wait_for_save "
        "starts, and keeps those KV blocks in use until they are reported done; they would never be freed, and "
        "the engine stalls once its KV cache is used up"
    ),
}


class VllmType(ConnectorType):
    """Any vLLM connector, by registered name or module path, its settings passed through."""

    name: ClassVar[str] = TYPE_NAME
    summary: ClassVar[str] = "any connector vLLM can load, by name or module path, its config passed as is"
    options: ClassVar[type[Options]] = VllmOptions
    top_level_keys: ClassVar[Mapping[str, str]] = {key: key for key in TOP_LEVEL}

    def specialised(self, options: Options) -> ConnectorType:
        """A type carrying what these options declare (range loads, ``kv_transfer_params`` keys)."""
        assert isinstance(options, VllmOptions)
        if not options.range_loads and not options.param_keys:
            return self
        declared = type(
            "DeclaredVllmType",
            (VllmType,),
            {
                "range_loads": options.range_loads,
                "range_alignment": options.range_alignment,
                "param_keys": frozenset(options.param_keys),
            },
        )
        return declared()

    def connector_name(self, child: Child) -> str:
        return child.options_as(VllmOptions).kv_connector

    def vllm_config(self, child: Child) -> dict[str, Any]:
        """The connector, each top-level field that is set, and the extra config as it is (when any)."""
        o = child.options_as(VllmOptions)
        cfg: dict[str, Any] = {"kv_connector": o.kv_connector}
        for key in TOP_LEVEL:
            value = getattr(o, key)
            if value is not None:
                cfg[key] = vllm_value(value)
        if o.kv_connector_extra_config:
            cfg["kv_connector_extra_config"] = vllm_value(o.kv_connector_extra_config)
        return cfg

    def options_from_vllm(self, config: Mapping[str, Any]) -> dict[str, Any] | None:
        """Any entry: every key but ``kv_role`` is an option of the same name (an empty extra config,
        vLLM's default, is left out)."""
        if not config.get("kv_connector"):
            return None
        empty = {"kv_connector_extra_config": {}}
        return {k: v for k, v in config.items() if k != "kv_role" and empty.get(k, ()) != v}

    def save_hooks_needed(self, child: Child) -> str | None:
        """As declared (``needs_save_hooks``); unset, from :data:`HOLDS_BLOCKS_FOR_SAVES` by name."""
        o = child.options_as(VllmOptions)
        if o.needs_save_hooks is None:
            return HOLDS_BLOCKS_FOR_SAVES.get(o.kv_connector)
        if not o.needs_save_hooks:
            return None
        return (
            "is declared needs_save_hooks: true (its scheduler holds KV blocks until a save it planned is "
            "reported done)"
        )

    def describe(self, child: Child) -> str:
        o = child.options_as(VllmOptions)
        where = f"from {o.kv_connector_module_path}" if o.kv_connector_module_path else "by vLLM's registry"
        extra = json.dumps(vllm_value(o.kv_connector_extra_config), sort_keys=True)
        ranges = (
            "loads a range after the local prefix (declared)"
            if o.range_loads
            else "loads only from the local prefix end"
        )
        keys = (
            "owns kv_transfer_params " + ", ".join(sorted(o.param_keys)) + " (declared)"
            if o.param_keys
            else "declares no kv_transfer_params keys (a key it returns is kept when no child above returned it)"
        )
        unresolved = _unresolvable(o)
        note = f"; its class cannot be imported here ({unresolved})" if unresolved else ""
        return (
            f"vLLM's {o.kv_connector}, loaded {where}; kv_connector_extra_config {extra} passed to vLLM as is; "
            f"{ranges}; {keys}; no host-buffer copies{note}"
        )

    def check(self, child: Child, plan: Plan) -> Iterator[Problem]:
        """Where vLLM is installed: the class must resolve as vLLM would resolve it (a module path's
        only when the plan allows imports; see :func:`unverified`)."""
        o = child.options_as(VllmOptions)
        at = ("connectors", child.index, "options")
        if o.range_alignment and not o.range_loads:
            yield Problem(
                "range_alignment only applies with range_loads: true",
                at + ("range_alignment",),
                "remove range_alignment, or declare range_loads: true",
            )
        if o.kv_connector_module_path:
            bad_name = _module_name_problem(o.kv_connector_module_path, at + ("kv_connector_module_path",))
            if bad_name is not None:
                yield bad_name
                return
        if importlib.util.find_spec("vllm") is None:
            return
        if o.kv_connector_module_path:
            if plan.import_modules:
                yield from _check_module_class(o, at)
            return
        names = registered_names()
        if o.kv_connector not in names:
            close = did_you_mean(o.kv_connector, names)
            yield Problem(
                f"vLLM knows no connector named {o.kv_connector!r}",
                at + ("kv_connector",),
                (close + " " if close.startswith("did you mean") else "")
                + "vLLM registers: "
                + ", ".join(names)
                + "; or set kv_connector_module_path to load a class of your own",
            )


def registered_names() -> list[str]:
    """The connector names vLLM's factory knows, after vLLM's general plugins registered theirs."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    return sorted(KVConnectorFactory._registry)  # vLLM has no public listing


def module_class(child: Child) -> str:
    """The class a ``vllm`` child names: ``module.Class`` with a module path, else the registered name."""
    o = child.options_as(VllmOptions)
    if o.kv_connector_module_path:
        return f"{o.kv_connector_module_path}.{o.kv_connector}"
    return o.kv_connector


def unverified(plan: Plan) -> tuple[list[Child], str]:
    """The ``vllm`` children whose class the checks did not resolve, and why (no children: all were).

    Without vLLM nothing can be resolved; with it, a module path is left unimported unless the plan
    allows imports (the name is still checked to be one vLLM can import).
    """
    children = [c for c in plan.children if isinstance(c.options, VllmOptions)]
    if children and importlib.util.find_spec("vllm") is None:
        return children, "vLLM is not installed here"
    if plan.import_modules:
        return [], ""
    named = [c for c in children if c.options_as(VllmOptions).kv_connector_module_path]
    return named, "not imported: importing a module runs its code"


def imported(plan: Plan) -> list[Child]:
    """The ``vllm`` children whose module the checks imported, and whose class they checked."""
    if not plan.import_modules or importlib.util.find_spec("vllm") is None:
        return []
    return [c for c in plan.children if isinstance(c.options, VllmOptions) and c.options.kv_connector_module_path]


def _module_name_problem(name: str, at: tuple[str | int, ...]) -> Problem | None:
    """A module path vLLM's ``importlib.import_module`` cannot take (relative, or with an empty part)."""
    if all(name.split(".")):
        return None
    what = "a relative module name" if name.startswith(".") else "not a module name (a part between dots is empty)"
    return Problem(
        f"{name!r} is {what}: vLLM imports kv_connector_module_path by its full dotted name",
        at,
        "write the module's full name from its top-level package, e.g. my_package.connector",
    )


def _check_module_class(o: VllmOptions, at: tuple[str | int, ...]) -> Iterator[Problem]:
    """The module imports and holds a vLLM connector class of that name; whatever the import
    raises is a problem located at the module path (the engine would meet it at start)."""
    from vllm.distributed.kv_transfer.kv_connector.base import KVConnectorBase

    path = o.kv_connector_module_path
    assert path is not None
    try:
        module = importlib.import_module(path)
        cls = getattr(module, o.kv_connector, None)
    except (Exception, SystemExit) as exc:  # the module's own code ran: anything, sys.exit() included
        yield Problem(
            f"importing {path} failed: {_one_line(exc)}",
            at + ("kv_connector_module_path",),
            "the engine imports it too; install what it needs, or check where vLLM serves",
        )
        return
    if cls is None:
        found = [n for n, v in vars(module).items() if _is_subclass(v, KVConnectorBase)]
        yield Problem(
            f"{path} has no class {o.kv_connector!r}",
            at + ("kv_connector",),
            did_you_mean(o.kv_connector, found),
        )
    elif not _is_subclass(cls, KVConnectorBase):
        yield Problem(
            f"{path}.{o.kv_connector} is not a vLLM KV connector class",
            at + ("kv_connector",),
            "name a subclass of vLLM's KVConnectorBase_V1",
        )


def _is_subclass(value: object, base: type) -> bool:
    """``issubclass`` for anything a module holds (a class whose metaclass raises is not one)."""
    try:
        return isinstance(value, type) and issubclass(value, base)
    except Exception:  # a foreign metaclass's __subclasscheck__
        return False


#: The longest exception message a problem quotes (a module may raise with a page of text).
_MESSAGE_LIMIT = 300


def _one_line(exc: BaseException) -> str:
    """``Type: message`` on one line, cut to a readable length (errors are one line each)."""
    said = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    if len(said) > _MESSAGE_LIMIT:
        said = said[:_MESSAGE_LIMIT] + "..."
    return f"{type(exc).__name__}: {said}" if said else type(exc).__name__


def _unresolvable(o: VllmOptions) -> str | None:
    """Why vLLM's registry cannot import the class of a registered name here (None: it can, vLLM
    is absent, or the child names a module, which only a check allowed to import resolves)."""
    if o.kv_connector_module_path or importlib.util.find_spec("vllm") is None:
        return None
    try:
        if o.kv_connector in registered_names():
            from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

            KVConnectorFactory.get_connector_class_by_name(o.kv_connector)
    except Exception as exc:  # whatever vLLM would meet importing it at engine start
        return f"{type(exc).__name__}: {exc}"
    return None


@hookimpl
def kvcompose_connector_types() -> list[ConnectorType]:
    """Contribute the ``vllm`` type."""
    return [VllmType()]
