"""The rule contract: one typed Protocol per rule kind, and the plain data they exchange.

A composition picks one rule per kind. Each kind's Protocol owns everything that kind decides,
on both halves of vLLM's connector: the scheduler process (one composite per engine core) and
the worker processes (one composite per worker). The composed connector in
:mod:`kvcompose.vllm.connector` asks the rules where vLLM calls it; they answer plain values
(which children, which ranges, contained or not) and keep no per-request state: what was
decided for a request is kept in the adapter's one record per request
(:mod:`kvcompose.vllm.loads`). A faults rule's :class:`FaultMonitor` keeps each child's health.
The adapter itself decides only what no kind below does: which children get each call
(:mod:`kvcompose.vllm.calls`), that a contained child that raised answers nothing, and that
what a failed child owed is reported failed.

=============  ====================================================================
kind           decides
=============  ====================================================================
load           who loads which tokens of a request (lookup), how
               ``update_state_after_alloc`` splits them, whose completion ends the load,
               which part waits for the request's next schedule (a mixed load's sync part)
store          which children receive the save hooks
metadata       how the children's per-step metadata travels scheduler -> workers
params         how the children's ``kv_transfer_params`` are merged
completion     whose transfer reports end a load or a free (worker half)
faults         which children may fail without stopping the engine, and when they are called again
=============  ====================================================================

Nothing here imports vLLM: rules are unit-tested without it. Child positions are the children's
indices in the composition (YAML order). :meth:`FaultsRule.monitor`'s body is a default that a
rule class inherits when it subclasses the Protocol explicitly; the built-in load rules' shared
methods are :class:`kvcompose.rules.load.StandardLoad`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, Protocol, runtime_checkable

# ------------------------------------------------------------------ plain data


# Contribution and Selection are made per request: immutable NamedTuples, since a frozen
# dataclass costs four times as much to make (docs/performance.md: scheduler step, issue 44).


class Contribution(NamedTuple):
    """One child's part of a request's external load.

    The child loads ``tokens`` tokens starting ``start`` tokens after the request's local prefix
    (vLLM's ``num_computed_tokens``). Under a single-child rule ``start`` is 0.
    """

    child: int
    start: int
    tokens: int
    is_async: bool


class Selection(NamedTuple):
    """A load rule's answer to vLLM's ``get_num_new_matched_tokens``.

    ``tokens`` is what vLLM sees: ``None`` asks vLLM to look the request up again next step,
    ``0`` is "nothing to load". ``contributions`` says who loads what, in YAML order.
    """

    tokens: int | None
    is_async: bool
    contributions: tuple[Contribution, ...] = ()


@dataclass(frozen=True, slots=True)
class EngineFacts:
    """What a load rule may need to know of the engine it serves (see :meth:`LoadRule.bind`)."""

    #: vLLM's scheduler block size, in tokens: loads move whole blocks.
    block_size: int
    #: KV cache groups (more than one with sliding-window or hybrid models).
    kv_cache_groups: int = 1
    #: Decode times prefill context-parallel size (1: none).
    context_parallel: int = 1


#: Ask again next step (a child above any hit answered ``None``).
NOT_READY = Selection(None, False)
#: No child has anything to load.
NO_HIT = Selection(0, False)

#: ``ask(child, num_computed_tokens)`` returns that child's ``get_num_new_matched_tokens``
#: answer for the request being looked up, as vLLM defines it: ``(tokens | None, is_async)``.
Ask = Callable[[int, int], "tuple[int | None, bool]"]


@dataclass(slots=True)
class TransferResults:
    """One child's transfer report for a step, or what the composite forwards to vLLM.

    The fields of vLLM's ``KVConnectorTransferResults`` the rules read, copied by name (a test
    pins the two together). A field a newer vLLM adds that this class lacks is not the rules':
    the vLLM adapter carries it through, merged by type (docs/versions.md). Failed receives
    also appear in ``finished_recving`` (vLLM's rule).
    """

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)

    def __bool__(self) -> bool:
        return bool(self.finished_sending or self.finished_recving or self.failed_recving)


# ------------------------------------------------------------------ the Protocols


@runtime_checkable
class LoadRule(Protocol):
    """Rule kind ``load``: lookup, allocation split and whose reports end the load (scheduler half).

    Called by the composite at vLLM's ``get_num_new_matched_tokens`` (:meth:`select`) and
    ``update_state_after_alloc`` (:meth:`allocate`, then :meth:`awaited` and :meth:`deferred`;
    :meth:`resume` at the request's next schedule when something was deferred). The answers are
    plain values; the adapter keeps them in the request's record (:mod:`kvcompose.vllm.loads`).
    :class:`kvcompose.rules.load.StandardLoad` writes the built-in rules' ``bind``,
    ``allocate``, ``awaited``, ``deferred`` and ``resume``: a rule subclasses it and writes
    ``select``.
    """

    def bind(self, engine: EngineFacts) -> None:
        """Called once per scheduler connector, before any lookup, with the engine's facts.

        A rule that needs them keeps them (``ranges``: block alignment); a rule that cannot
        serve this engine raises ``ValueError`` saying why, which stops the engine at start
        instead of loading wrong KV later.
        """
        ...

    def select(
        self,
        ask: Ask,
        children: Sequence[int],
        num_computed_tokens: int,
        kv_transfer_params: Mapping[str, Any] | None,
    ) -> Selection:
        """Decide who loads which tokens of a request.

        :param ask: asks one child (by index) with a ``num_computed_tokens`` of the rule's
            choosing; a child asked with ``num_computed_tokens + s`` answers for the tokens
            beyond ``s`` (vLLM's own contract).
        :param children: the children that may be asked, in YAML order (a bypassed child is
            left out).
        :param num_computed_tokens: the request's local prefix (block-aligned, from vLLM).
        :param kv_transfer_params: the request's ``kv_transfer_params`` as the client sent them
            (vLLM's ``Request.kv_transfer_params``; ``None`` for none). Read-only: the children
            read the same dict.
        :return: :data:`NOT_READY`, :data:`NO_HIT`, or a :class:`Selection` whose ``tokens`` is
            the sum of its contributions' tokens.
        """
        ...

    def allocate(self, selection: Selection, num_external_tokens: int) -> tuple[Contribution, ...]:
        """Split vLLM's ``num_external_tokens`` among the contributions of a selection.

        vLLM calls ``update_state_after_alloc`` with the external tokens it allocated blocks for
        (the selection's tokens, or 0 when it decided to load nothing). Every child that is not
        in the result is told 0 tokens with the real blocks (children track stores from it).
        """
        ...

    def awaited(self, contributions: tuple[Contribution, ...]) -> tuple[int, ...]:
        """The children whose ``finished_recving`` completes the request's load.

        vLLM sees one load per request: it leaves ``WAITING_FOR_REMOTE_KVS`` when these children
        reported, as the completion rule judges. Empty for a synchronous load.
        """
        ...

    def deferred(self, contributions: tuple[Contribution, ...]) -> tuple[Contribution, ...]:
        """Of :meth:`allocate`'s contributions, those whose ``update_state_after_alloc`` waits
        for the request's next schedule (the second phase of allocation).

        A synchronous connector loads in the step that schedules the request (vLLM's
        ``ExampleConnector`` requires the request among that step's new requests), but vLLM
        does not schedule a request with an asynchronous load until that load completes. So a
        load that mixes both runs in two phases: at the first ``update_state_after_alloc`` the
        deferred children are not called at all (their lookup stays pending, as when vLLM
        cannot allocate); when :meth:`awaited` reported and vLLM schedules the request, they are
        called with the tokens :meth:`resume` gives them, and load in that step, before the
        forward pass that reads their KV.
        """
        ...

    def resume(self, deferred: tuple[Contribution, ...], kept: int) -> tuple[Contribution, ...]:
        """The deferred contributions to give at the request's first schedule after its
        asynchronous load (:meth:`deferred`), cut to what vLLM kept of the load.

        ``kept`` is how many tokens beyond the local prefix vLLM counts as loaded now: all of
        the selection's after a clean load, fewer after an awaited child failed (vLLM then
        recomputes from the failed child's first invalid block).
        """
        ...


@runtime_checkable
class StoreRule(Protocol):
    """Rule kind ``store``: which children receive the save hooks (worker half).

    ``save_kv_layer`` and ``wait_for_save`` go to :attr:`targets` only; each target still
    decides from its own metadata what to save. The scheduler half of a save (a delayed free)
    is the completion rule's.
    """

    #: Child indices that receive the save hooks, in YAML order.
    targets: tuple[int, ...]


@runtime_checkable
class MetadataRule(Protocol):
    """Rule kind ``metadata``: the per-step scheduler -> worker payload of the children."""

    def pack(self, metas: Sequence[Any]) -> dict[str, Any]:
        """Scheduler half: one metadata object per child (``None`` for a bypassed child), in
        YAML order, into the payload the workers receive."""
        ...

    def unpack(self, payload: Mapping[str, Any]) -> Sequence[Any]:
        """Worker half: the payload back into one metadata object per child, in YAML order.
        Raises when the payload does not fit this composition's children."""
        ...


@runtime_checkable
class ParamsRule(Protocol):
    """Rule kind ``params``: the ``kv_transfer_params`` of ``request_finished`` (scheduler half)."""

    def merge(self, results: Sequence[Mapping[str, Any] | None]) -> dict[str, Any] | None:
        """Each child's returned params (``None`` where it returned none), in YAML order, into
        what vLLM returns to the client (``None`` for nothing)."""
        ...


@runtime_checkable
class CompletionRule(Protocol):
    """Rule kind ``completion``: which children's transfer reports end a request's load and free
    its blocks (worker half). The adapter keeps each request's record of who reported
    (:class:`kvcompose.vllm.loads.Transfers`) and asks these questions of it; it forwards a
    report to vLLM when the rule says the load, or the free, is done."""

    def counts(self, child: int, awaited: tuple[int, ...]) -> bool:
        """Whether ``child``'s ``finished_recving`` counts for a load that awaits ``awaited``
        (the load rule's :meth:`LoadRule.awaited`); one that does not is withheld."""
        ...

    def done(self, owed: tuple[int, ...], reported: Collection[int]) -> bool:
        """Whether a load that awaits ``owed`` (or a free that ``owed`` delay) is done, once the
        children in ``reported`` reported it (each counted once; a child that failed counts as
        reported)."""
        ...


#: A child's health under a faults rule, as its Prometheus gauge says it (``vllm:kvcompose_breaker_state``):
#: closed (called), open (bypassed), half-open (on probation after a cooldown).
ChildState = Literal["closed", "open", "half-open"]


@runtime_checkable
class FaultMonitor(Protocol):
    """One connector instance's view of its contained children's health (one per scheduler or
    worker connector, from :meth:`FaultsRule.monitor`).

    The composite reports each contained failure (:meth:`failed`) and bypasses the child while
    that says so. It calls :meth:`step` once per engine step, before the step's first call to the
    children (the scheduler's ``build_connector_meta``, a worker's ``bind_connector_metadata``),
    whenever :attr:`watched` is not empty, and calls the children :meth:`step` names again from
    then on: a child comes back at a step boundary, never halfway through a step.
    """

    #: Children the monitor needs to hear of at every step (with failures not yet enough to
    #: bypass them, bypassed for a while, on probation). Empty: the composite does nothing per step.
    watched: Collection[int]

    def failed(self, child: int) -> bool:
        """A contained call of ``child`` raised. True: bypass the child from now on."""
        ...

    def succeeded(self, child: int) -> None:
        """``child`` was called in the step that ends and did not fail. The composite reports it
        at the next step's start, before :meth:`step`, for each child in :attr:`watched` it calls
        (every active child gets each step's first call), so a healthy child costs nothing; a
        monitor that lets a child back on probation counts these, not quiet steps."""
        ...

    def step(self) -> tuple[int, ...]:
        """A step starts: the bypassed children to call again from now on (each one's next call
        is its probe)."""
        ...

    def state(self, child: int) -> ChildState:
        """The child's state now."""
        ...

    def take_changes(self) -> dict[int, ChildState]:
        """Children whose state changed since the last call, with their state now (for the
        gauge); empty on most steps."""
        ...


class Isolation(FaultMonitor):
    """The monitor of rules that never call a failed child again (``fail``, ``isolate``)."""

    def __init__(self) -> None:
        self.watched: frozenset[int] = frozenset()
        self._open: set[int] = set()
        self._changes: dict[int, ChildState] = {}

    def succeeded(self, child: int) -> None:
        pass  # never watched: a child is bypassed for good

    def failed(self, child: int) -> bool:
        if child not in self._open:
            self._open.add(child)
            self._changes[child] = "open"
        return True

    def step(self) -> tuple[int, ...]:
        return ()

    def state(self, child: int) -> ChildState:
        return "open" if child in self._open else "closed"

    def take_changes(self) -> dict[int, ChildState]:
        changes, self._changes = self._changes, {}
        return changes


@runtime_checkable
class FaultsRule(Protocol):
    """Rule kind ``faults``: which child failures are contained, and whether (and when) a
    bypassed child is called again. The adapter reports the loads a contained child owed failed,
    so that vLLM stops waiting for them."""

    def contains(self, child: int) -> bool:
        """Whether an exception raised by ``child`` is contained (the child's call answers
        vLLM's "nothing" and the engine goes on) instead of propagating to vLLM."""
        ...

    def monitor(self) -> FaultMonitor:
        """A fresh monitor for one connector instance. The default bypasses a child at its
        first contained failure, for good (:class:`Isolation`)."""
        return Isolation()


RuleKind = Literal["load", "store", "metadata", "params", "completion", "faults"]

#: The Protocol each rule kind's ``Rule.build`` returns; its keys are the rule kinds, in the
#: order ``kvcompose check`` explains them.
PROTOCOLS: dict[RuleKind, type] = {
    "load": LoadRule,
    "store": StoreRule,
    "metadata": MetadataRule,
    "params": ParamsRule,
    "completion": CompletionRule,
    "faults": FaultsRule,
}

RULE_KINDS: tuple[RuleKind, ...] = tuple(PROTOCOLS)

#: Whatever a ``Rule.build`` returns.
RuleObject = LoadRule | StoreRule | MetadataRule | ParamsRule | CompletionRule | FaultsRule
