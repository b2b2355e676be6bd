"""Hook specifications: the whole contract between kvcompose and its plugins.

A plugin is a module (or object) with functions named like the hooks below, each marked with
``@hookimpl`` (``from kvcompose.api import hookimpl``: :mod:`kvcompose.api` is all a plugin
imports from kvcompose). Third-party plugins are found through the ``kvcompose`` entry-point
group; kvcompose's own rules and checks are plugins registered the same way.

Every hook here runs when a composition is *built* (``kvcompose check``, ``vllm-args``, or
engine start-up), never per request: what a hook returns is resolved once into a call plan, and
the engine's per-step calls go straight to the resolved objects.

kvcompose calls every hook through pluggy's hook caller, so ``KVCOMPOSE_TRACE=1`` logs each call
(logger ``kvcompose.trace``). Each docstring below says how the implementations' results combine.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import pluggy

from kvcompose import NAME

if TYPE_CHECKING:
    from kvcompose.catalog import ConnectorType, Plan, Rule
    from kvcompose.errors import Problem

hookspec = pluggy.HookspecMarker(NAME)


# -------------------------------------------------------------------------------------------
# Registration hooks: what a plugin contributes. Called once per plugin manager (again after a
# plugin is registered or unregistered at run time), and then once per implementing plugin (a
# pluggy subset hook caller holding only that plugin), so that every result is credited to the
# plugin that returned it. A wrapper implementation wraps only its own plugin's call.
# -------------------------------------------------------------------------------------------


@hookspec
def kvcompose_connector_types() -> Iterable[ConnectorType]:
    """Contribute connector types: the values a composition may give as ``type:``.

    :return: :class:`~kvcompose.api.ConnectorType` instances.

    Results combine by concatenation, plugin by plugin in registration order (built-ins, then
    entry points, then plugins registered at run time); each type is listed under its plugin by
    ``kvcompose plugins``. Two plugins offering the same name is an error that names both
    plugins; so is returning something other than an iterable of ``ConnectorType``, or raising.

    Example::

        @hookimpl
        def kvcompose_connector_types():
            return [MooncakeType()]
    """


@hookspec
def kvcompose_rules() -> Iterable[Rule]:
    """Contribute rules: named policies for one kind of engine call (``load``, ``store``,
    ``metadata``, ``params``, ``completion``, ``faults``).

    :return: :class:`~kvcompose.api.Rule` objects. A composition selects one rule per kind
        by name under ``rules:``; the rule's ``build`` runs once per composition.

    Results combine as for :func:`kvcompose_connector_types`: concatenated plugin by plugin, each
    rule credited to its plugin. Two plugins offering the same ``(kind, name)`` is an error that
    names both plugins; so is a rule of an unknown kind.
    """


# -------------------------------------------------------------------------------------------
# Composition hook: called once each time a composition is resolved into a plan.
# -------------------------------------------------------------------------------------------


@hookspec
def kvcompose_check(plan: Plan) -> Iterable[Problem] | None:
    """Inspect a resolved plan and report what is wrong with it across children.

    Called after every child's type and options and every rule were resolved. Per-child checks
    belong in :meth:`ConnectorType.check`, and what one rule needs of the children in that
    rule's own ``check`` (:class:`~kvcompose.api.ChecksPlan`); this hook is for checks that span
    children (one host-buffer owner, one P/D transport, ...).

    :param plan: the call plan, read-only.
    :return: :class:`~kvcompose.api.Problem` objects, each with the document path it is
        about, so the user sees ``FILE:LINE:COL``. Return nothing when all is well.

    Results combine by concatenation: one hook call runs every implementation (pluggy's order,
    the most recently registered first) and all their problems are reported together; any
    problem fails the composition, except those with ``warning=True``, which ``kvcompose check``
    prints while the composition still runs (the plan keeps them in ``Plan.warnings``).
    """
