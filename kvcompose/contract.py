"""The rule contract: one typed Protocol per rule kind, and the plain data they exchange.

A composition picks one rule per kind. Each kind's Protocol owns everything that kind decides,
on both halves of vLLM's connector: the scheduler process (one composite per engine core) and
the worker processes (one composite per worker). The composed connector in
:mod:`kvcompose.vllm.connector` calls the rules where vLLM calls it and applies their answers.
What a rule decided for a request is kept between vLLM's calls by the adapter (a load's:
:class:`kvcompose.vllm.loads.RequestLoads`) and by the objects the rules make (a completion
rule's :class:`CompletionTracker`, a faults rule's :class:`FaultMonitor`). The adapter itself
decides only what no kind below does: how each call's answers combine and which children get
it (the save hooks: the store rule's targets; :mod:`kvcompose.vllm.forward`), what a contained
child that raised answers instead, and that what a failed child owed is reported failed.

=============  ====================================================================
kind           decides
=============  ====================================================================
load           who loads which tokens of a request (lookup), how
               ``update_state_after_alloc`` splits them, whose completion ends the load,
               which part waits for the request's next schedule (a mixed load's sync part)
store          which children receive the save hooks
metadata       how the children's per-step metadata travels scheduler -> workers
params         how the children's ``kv_transfer_params`` are merged
completion     which child reports reach vLLM, once (worker and scheduler halves)
faults         which children may fail without stopping the engine, and when they are called again
=============  ====================================================================

Nothing here imports vLLM: rules are unit-tested without it. Child positions are the children's
indices in the composition (YAML order). A Protocol's methods with a body are defaults that a
rule class inherits when it subclasses the Protocol explicitly.
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
    """Rule kind ``load``: lookup, allocation split and load completion (scheduler half).

    Called by the composite at vLLM's ``get_num_new_matched_tokens`` (:meth:`select`) and
    ``update_state_after_alloc`` (:meth:`allocate`, then :meth:`awaited` and :meth:`deferred`;
    :meth:`resume` at the request's next schedule when something was deferred). The worker half
    of a load is the completion rule's: it waits for the children :meth:`awaited` names.
    """

    def bind(self, engine: EngineFacts) -> None:
        """Called once per scheduler connector, before any lookup, with the engine's facts.

        A rule that needs them keeps them (``ranges``: block alignment); a rule that cannot
        serve this engine raises ``ValueError`` saying why, which stops the engine at start
        instead of loading wrong KV later. The default needs nothing.
        """

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
        :param children: the children that may be asked, in YAML order (a disabled child is
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
        out = []
        left = num_external_tokens
        for c in selection.contributions:  # vLLM may allocate fewer tokens than selected
            if left <= 0:
                break
            out.append(c if c.tokens <= left else Contribution(c.child, c.start, left, c.is_async))
            left -= c.tokens
        return tuple(out)

    def awaited(self, contributions: tuple[Contribution, ...]) -> tuple[int, ...]:
        """The children whose ``finished_recving`` completes the request's load.

        vLLM sees one load per request: it leaves ``WAITING_FOR_REMOTE_KVS`` when each of these
        children reported (the completion rule keeps that barrier). Empty for a synchronous load.
        """
        return tuple([c.child for c in contributions if c.is_async and c.tokens > 0])  # a list: no generator

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
        forward pass that reads their KV. The default defers the synchronous contributions of
        a load that also has an asynchronous one; nothing otherwise.
        """
        if len(contributions) < 2:  # one child: nothing to hold for a schedule of its own
            return ()
        for c in contributions:
            if c.is_async and c.tokens > 0:
                return tuple([c for c in contributions if not c.is_async and c.tokens > 0])
        return ()

    def resume(self, deferred: tuple[Contribution, ...], kept: int) -> tuple[Contribution, ...]:
        """The deferred contributions to give at the request's first schedule after its
        asynchronous load (:meth:`deferred`), cut to what vLLM kept of the load.

        ``kept`` is how many tokens beyond the local prefix vLLM counts as loaded now: all of
        the selection's after a clean load, fewer after an awaited child failed (vLLM then
        recomputes from the failed child's first invalid block). The default gives each deferred
        contribution the part of its range below ``kept``: one wholly beyond it is dropped (vLLM
        computes those tokens), so no child loads KV vLLM will not read.
        """
        out = []
        for c in deferred:
            tokens = min(c.tokens, kept - c.start)
            if tokens > 0:
                out.append(c if tokens == c.tokens else Contribution(c.child, c.start, tokens, c.is_async))
        return tuple(out)


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
        """Scheduler half: one metadata object per child (``None`` for a disabled child), in
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
class CompletionTracker(Protocol):
    """One connector instance's bookkeeping of who owes which completion.

    Worker half: told by the scheduler (through the step's metadata) which children each load
    awaits and which children delay each free; settles the children's reports into what vLLM may
    see. Scheduler half: :meth:`admit` keeps vLLM's scheduler from a report it does not wait for.
    """

    def expect_load(self, request_id: str, children: tuple[int, ...]) -> None:
        """Worker half: the request's load completes when each of ``children`` reported."""
        ...

    def expect_saves(self, request_id: str, children: tuple[int, ...]) -> None:
        """Worker half: the request's blocks are freed when each of ``children`` reported
        ``finished_sending``."""
        ...

    def owed_by(self, child: int) -> set[str]:
        """Worker half: the requests whose load still waits for ``child``."""
        ...

    def abandon(self, child: int, request_ids: Collection[str]) -> None:
        """Worker half: ``child`` will never report these loads (it was disabled); the next
        :meth:`settle` counts them as reported by it, finished and failed."""
        ...

    def release(self, child: int) -> None:
        """Worker half: ``child`` is bypassed and will not report the delayed frees it owes now;
        the next :meth:`settle` counts them as reported by it (a free no other child still owes
        is forwarded). The default keeps them owed."""

    def told(
        self,
        loads: Mapping[str, tuple[int, ...]],
        saves: Mapping[str, tuple[int, ...]],
        abandoned: Mapping[str, tuple[int, ...]],
        bypassed: Collection[int],
    ) -> bool:
        """Worker half, once per step with anything in it: what the scheduler announced in the
        step's metadata. ``loads``: request -> the children its load awaits (the load rule's
        :meth:`LoadRule.awaited`); ``saves``: request -> the children delaying its free;
        ``abandoned``: request -> children that failed on the scheduler before the load started.
        ``bypassed``: children this worker does not call now (they will neither load nor report).
        Returns whether the next :meth:`settle` has loads to report failed. The default records
        each announcement with :meth:`expect_load` / :meth:`expect_saves`, abandons what
        ``abandoned`` and ``bypassed`` children owe, and releases the frees they delay."""
        some = False
        for req, children in loads.items():
            self.expect_load(req, children)
            for child in children:
                if child in bypassed:
                    self.abandon(child, (req,))
                    some = True
        for req, children in abandoned.items():
            for child in children:
                self.abandon(child, (req,))
            some = True
        if saves:
            for req, children in saves.items():
                self.expect_saves(req, children)
            for child in bypassed:
                self.release(child)
                some = True
        return some

    def settle(self, results: Sequence[TransferResults | None]) -> tuple[TransferResults, int]:
        """Worker half: each child's report for this step (``None``: nothing), in YAML order,
        into what this worker forwards to vLLM, and how many reports were withheld."""
        ...

    def admit(self, finished_recving: set[str], waiting: Collection[str]) -> set[str]:
        """Scheduler half: of the ``finished_recving`` aggregated over the workers, the ones
        vLLM's scheduler may see. ``waiting`` holds the requests whose async load it waits for.
        """
        ...


@runtime_checkable
class CompletionRule(Protocol):
    """Rule kind ``completion``: makes one :class:`CompletionTracker` per connector instance."""

    def tracker(self) -> CompletionTracker:
        """A fresh tracker (one per scheduler or worker connector)."""
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
        """A contained call of ``child`` returned. The composite reports it only while ``child``
        is in :attr:`watched`, so a healthy child costs nothing; a monitor that lets a child back
        on probation counts these, not quiet steps."""
        return None

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
    bypassed child is called again. The adapter reports the loads a contained child owed failed
    (:meth:`CompletionTracker.owed_by`), so that vLLM stops waiting for them."""

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
