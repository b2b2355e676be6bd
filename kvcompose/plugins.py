"""The plugin manager: built-in plugins and third-party entry points, registered the same way.

Every hook is called through pluggy's hook caller, never by calling an implementation directly,
so pluggy's tracing (and any other hook-call monitoring) sees every call. The registration hooks
(``kvcompose_connector_types``, ``kvcompose_rules``) are called once per implementing plugin,
through :meth:`pluggy.PluginManager.subset_hook_caller`, so that each connector type and rule is
credited to the plugin that returned it (``kvcompose plugins``; duplicate-name errors name both).

Environment:

``KVCOMPOSE_PLUGINS``
    Comma-separated entry-point names. A plain name selects (when any plain name is given, only
    the selected third-party plugins load); ``-name`` blocks that plugin. Built-ins always load.
``KVCOMPOSE_TRACE``
    Set to ``1`` to log, at INFO level on the ``kvcompose.trace`` logger, every hook call
    (pluggy tracing: registration hooks, each preceded by a line naming the plugin called, and
    ``kvcompose_check``) and every child call the composed connector makes
    (:mod:`kvcompose.vllm.calls`). Read from the process environment when a :class:`Plugins` is
    built (hooks) and when a composition is resolved (child calls). The CLI shows the logger's
    lines on stderr while the variable is set (:func:`kvcompose.cli.main`).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property

import pluggy

from kvcompose import NAME, hookspecs
from kvcompose.catalog import ConnectorType, Plan, Rule
from kvcompose.contract import RULE_KINDS
from kvcompose.errors import Problem

ENV_SELECT = "KVCOMPOSE_PLUGINS"
ENV_TRACE = "KVCOMPOSE_TRACE"

#: kvcompose's own behaviour, written as plugins (datasette's DEFAULT_PLUGINS pattern).
BUILTIN_PLUGINS: tuple[str, ...] = (
    "kvcompose.rules.load",
    "kvcompose.rules.store",
    "kvcompose.rules.metadata",
    "kvcompose.rules.params",
    "kvcompose.rules.faults",
    "kvcompose.rules.checks",
    "kvcompose.generic",
)

trace_log = logging.getLogger("kvcompose.trace")


def tracing_enabled() -> bool:
    return os.environ.get(ENV_TRACE, "").strip().lower() not in ("", "0", "false", "no")


class PluginError(RuntimeError):
    """A plugin is broken or two plugins claim the same name."""


def _said(exc: BaseException) -> str:
    """An exception's message on one line (pluggy's and a SyntaxError's span several)."""
    return "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {_said(exc)}"


@dataclass(frozen=True)
class Provided:
    """Something a plugin contributed, with who contributed it (for ``kvcompose plugins``)."""

    kind: str  # "type" or a rule kind
    name: str
    summary: str
    provider: str  # distribution name and version, or "kvcompose (built-in)"


class Plugins:
    """Typed facade over pluggy (tox's pattern): one method per hook, results validated."""

    def __init__(
        self, *, entry_points: bool = True, extra: Iterable[object] = (), env: dict[str, str] | None = None
    ) -> None:
        """``env`` is where ``KVCOMPOSE_PLUGINS`` is read (default: the process environment).

        ``KVCOMPOSE_TRACE`` is always read from the process environment, as the composition reads
        it for child-call tracing, so that hook and child-call tracing are on together.
        """
        env = dict(os.environ) if env is None else env
        self.pm = pluggy.PluginManager(NAME)
        self.pm.add_hookspecs(hookspecs)
        self._trace = self.pm.trace.root.get("provider")
        self._providers: dict[int, str] = {}
        for modname in BUILTIN_PLUGINS:
            module = importlib.import_module(modname)
            self.pm.register(module, name=modname)
            self._providers[id(module)] = "kvcompose (built-in)"
        if entry_points:
            self._load_entry_points(env.get(ENV_SELECT, ""))
        for plugin in extra:
            self.pm.register(plugin)
            self._providers[id(plugin)] = getattr(plugin, "__name__", type(plugin).__name__)
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError as exc:  # a kvcompose_* hook kvcompose does not have
            raise PluginError(f"{self._provider(exc.plugin)} does not fit kvcompose's hooks: {_said(exc)}") from exc
        if tracing_enabled():
            self.pm.trace.root.setwriter(lambda msg: trace_log.info("%s", msg.rstrip()))
            self.pm.enable_tracing()

    def _load_entry_points(self, spec: str) -> None:
        names = [n.strip() for n in spec.split(",") if n.strip()]
        for name in names:
            if name.startswith("-"):
                self.pm.set_blocked(name[1:])
        selected = [n for n in names if not n.startswith("-")]
        loaded = self._load_group(set(selected) or None)
        for name in selected:
            if name not in loaded:
                raise PluginError(
                    f"{ENV_SELECT} selects plugin {name!r}, but no installed distribution "
                    f"provides an entry point of that name in the {NAME!r} group"
                )

    def _load_group(self, only: set[str] | None) -> set[str]:
        """Register every entry point of the ``kvcompose`` group (those in ``only``, when given), as
        pluggy's ``load_setuptools_entrypoints`` does, but one that fails to import or does not fit
        the hooks is a :class:`PluginError` naming its distribution. Returns the names loaded."""
        loaded: set[str] = set()
        for dist in list(importlib.metadata.distributions()):
            for ep in dist.entry_points:
                if (
                    ep.group != NAME
                    or (only is not None and ep.name not in only)
                    or self.pm.has_plugin(ep.name)
                    or self.pm.is_blocked(ep.name)
                ):
                    continue
                provider = f"{dist.metadata['name']} {dist.version}"
                where = f"plugin {ep.name!r} ({ep.value}) of the distribution {provider}"
                remedy = (
                    f"fix or reinstall {dist.metadata['name']}, uninstall it, or skip it with {ENV_SELECT}=-{ep.name}"
                )
                try:
                    plugin = ep.load()
                except Exception as exc:
                    raise PluginError(f"{where} failed to load: {_one_line(exc)} ({remedy})") from exc
                try:
                    self.pm.register(plugin, name=ep.name)
                except pluggy.PluginValidationError as exc:
                    raise PluginError(f"{where} does not fit kvcompose's hooks: {_said(exc)} ({remedy})") from exc
                except ValueError as exc:  # pluggy: the same object under another name
                    raise PluginError(f"{where} cannot be registered: {exc} ({remedy})") from exc
                self._providers[id(plugin)] = provider
                loaded.add(ep.name)
        return loaded

    def register(self, plugin: object, name: str | None = None) -> None:
        """Register a plugin object at run time (tests do; so can embedding code)."""
        self.pm.register(plugin, name=name)
        self._providers[id(plugin)] = name or getattr(plugin, "__name__", type(plugin).__name__)
        self.__dict__.pop("_provided", None)  # recollect types and rules on next access

    def unregister(self, plugin: object) -> None:
        """Undo :meth:`register` (the test kit's fixtures do, so test types do not outlive a test)."""
        self.pm.unregister(plugin)
        self._providers.pop(id(plugin), None)
        self.__dict__.pop("_provided", None)

    def _collect(self, hook_name: str) -> list[tuple[object, object]]:
        """(item, plugin) pairs from every implementation of a registration hook.

        One hook call per implementing plugin, in registration order: pluggy's result list does
        not say which plugin returned what, and a subset caller holding one plugin does.
        """
        caller: pluggy.HookCaller = getattr(self.pm.hook, hook_name)
        plugins = list(dict.fromkeys(impl.plugin for impl in caller.get_hookimpls()))
        out: list[tuple[object, object]] = []
        for plugin in plugins:
            provider = self._provider(plugin)
            # Goes to pluggy's trace writer only when tracing is on; without it the identical
            # per-plugin hook lines could not be told apart.
            self._trace(hook_name, "from plugin", self.pm.get_name(plugin), f"({provider})")
            only = self.pm.subset_hook_caller(hook_name, [p for p in plugins if p is not plugin])
            try:
                for result in only():
                    if not isinstance(result, Iterable):
                        raise PluginError(f"{provider} returned {result!r} from {hook_name}; expected an iterable")
                    # Inside the try: a generator implementation runs its body only here.
                    out.extend((item, plugin) for item in list(result))
            except PluginError:
                raise
            except Exception as exc:
                raise PluginError(f"{provider} failed in {hook_name}: {type(exc).__name__}: {exc}") from exc
        return out

    def _provider(self, plugin: object) -> str:
        return self._providers.get(id(plugin), str(plugin))

    @cached_property
    def _provided(self) -> tuple[dict[str, ConnectorType], dict[tuple[str, str], Rule], list[Provided]]:
        types: dict[str, ConnectorType] = {}
        rules: dict[tuple[str, str], Rule] = {}
        rows: list[Provided] = []
        owner: dict[tuple[str, str], str] = {}
        for item, plugin in self._collect("kvcompose_connector_types"):
            provider = self._provider(plugin)
            if not isinstance(item, ConnectorType):
                raise PluginError(
                    f"{provider} returned {item!r} from kvcompose_connector_types; expected a ConnectorType"
                )
            key = ("type", item.name)
            if key in owner:
                raise PluginError(f"connector type {item.name!r} is provided twice: by {owner[key]} and by {provider}")
            owner[key] = provider
            types[item.name] = item
            rows.append(Provided("type", item.name, item.summary, provider))
        for item, plugin in self._collect("kvcompose_rules"):
            provider = self._provider(plugin)
            if not isinstance(item, Rule):
                raise PluginError(f"{provider} returned {item!r} from kvcompose_rules; expected a Rule")
            if item.kind not in RULE_KINDS:
                raise PluginError(f"{provider} offers rule {item.name!r} of unknown kind {item.kind!r}")
            key = (item.kind, item.name)
            if key in owner:
                raise PluginError(
                    f"{item.kind} rule {item.name!r} is provided twice: by {owner[key]} and by {provider}"
                )
            owner[key] = provider
            rules[key] = item
            rows.append(Provided(item.kind, item.name, item.summary, provider))
        return types, rules, rows

    @property
    def connector_types(self) -> dict[str, ConnectorType]:
        return self._provided[0]

    @property
    def rules(self) -> dict[tuple[str, str], Rule]:
        return self._provided[1]

    def provided(self) -> list[Provided]:
        """Every connector type and rule, with the distribution that provides it."""
        return list(self._provided[2])

    def check(self, plan: Plan) -> list[Problem]:
        problems: list[Problem] = []
        for result in self.pm.hook.kvcompose_check(plan=plan):
            problems.extend(result or ())
        return problems


_default: Plugins | None = None


def get_plugins() -> Plugins:
    """The process-wide plugin manager (entry points loaded once, on first use)."""
    global _default
    if _default is None:
        _default = Plugins()
    return _default
