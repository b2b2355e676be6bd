"""Fault rules: whether a child that raises is contained (the engine goes on without it) and
whether, and when, it is called again (a circuit breaker's state).

What a contained child answers in its call's place, and how what it owed is reported failed,
are the adapter's (``KVComposeConnector._contained`` in :mod:`kvcompose.vllm.connector`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgspec

from kvcompose import hookimpl
from kvcompose.catalog import Child, Rule
from kvcompose.contract import ChildState, FaultMonitor, FaultsRule
from kvcompose.rules.children import ChildrenParams, indices

log = logging.getLogger("kvcompose.rules.faults")


@dataclass(frozen=True)
class Contain(FaultsRule):
    """Errors of the ``best_effort`` children are contained; a child that raised is bypassed for
    good (the :class:`FaultsRule` default monitor)."""

    best_effort: frozenset[int]

    def contains(self, child: int) -> bool:
        return child in self.best_effort


def _isolate(children: tuple[Child, ...], params: ChildrenParams) -> Contain:
    return Contain(frozenset(indices(children, params.children)))


# ------------------------------------------------------------------ breaker


class BreakerParams(ChildrenParams, kw_only=True):
    """``faults: {use: breaker, children: [host], failures: 3, cooldown_s: 30, successes: 3}``."""

    #: Failed calls, with no step free of failures between them, before the child is bypassed.
    failures: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] = 3
    #: Seconds a bypassed child is left alone before one probe call.
    cooldown_s: Annotated[float, msgspec.Meta(ge=0, le=86_400)] = 30.0
    #: Steps in a row with a call that succeeded and none that failed, from the probe on,
    #: before the child is fully back.
    successes: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] = 3


@dataclass
class _Child:
    state: ChildState = "closed"
    failures: int = 0  # while closed, since the last step free of failures
    successes: int = 0  # while half-open: steps in a row with a call that succeeded, none failed
    failed_this_step: bool = False
    succeeded_this_step: bool = False
    opened_at: float = 0.0


class Breaker(FaultMonitor):
    """A circuit breaker per contained child, for one connector instance.

    closed: called; ``failures`` failed calls with no step free of failures between them open
    it. open: bypassed (its loads recompute, its stores are skipped) until ``cooldown_s`` passed;
    then, at the next step, half-open: called again, its first call the probe. A failure in
    half-open opens it again (a new cooldown); ``successes`` steps in a row, each with a call
    that succeeded and none that failed, close it (a step in which the child was not called
    proves nothing and counts neither way). Each state change is logged once.
    """

    def __init__(self, rule: BreakerRule) -> None:
        self._rule = rule
        self._children = {i: _Child() for i in rule.children}
        self._changes: dict[int, ChildState] = {}
        self.watched: set[int] = set()

    def failed(self, child: int) -> bool:
        c = self._children[child]
        c.failed_this_step = True
        self.watched.add(child)
        if c.state == "open":  # a call that was already under way when it opened
            return True
        if c.state == "half-open":
            self._open(child, c, f"its probe failed; retried in {self._rule.cooldown_s:g} s")
            return True
        c.failures += 1
        if c.failures >= self._rule.failures:
            self._open(
                child,
                c,
                f"{c.failures} call{'s' if c.failures > 1 else ''} failed; bypassed (its loads recompute, "
                "its stores are skipped), "
                f"retried in {self._rule.cooldown_s:g} s",
            )
            return True
        return False

    def succeeded(self, child: int) -> None:
        self._children[child].succeeded_this_step = True

    def step(self) -> tuple[int, ...]:
        back = []
        now = None
        for i in tuple(self.watched):
            c = self._children[i]
            clean, c.failed_this_step = not c.failed_this_step, False
            called, c.succeeded_this_step = c.succeeded_this_step, False
            if c.state == "closed":
                if clean:  # a step free of failures: the count starts again
                    c.failures = 0
                    self.watched.discard(i)
            elif c.state == "half-open":
                if clean and called:
                    c.successes += 1
                    if c.successes >= self._rule.successes:
                        self._change(
                            i, c, "closed", f"{c.successes} steps in a row with calls that succeeded; fully back"
                        )
                        self.watched.discard(i)
            else:
                now = self._rule.clock() if now is None else now
                if now - c.opened_at >= self._rule.cooldown_s:
                    c.successes = 0
                    c.succeeded_this_step = False  # a call under way when it opened is no probe
                    self._change(i, c, "half-open", "cooldown over; its next call is a probe")
                    back.append(i)
        return tuple(sorted(back))

    def state(self, child: int) -> ChildState:
        c = self._children.get(child)
        return c.state if c is not None else "closed"

    def take_changes(self) -> dict[int, ChildState]:
        changes, self._changes = self._changes, {}
        return changes

    def _open(self, child: int, c: _Child, why: str) -> None:
        c.opened_at = self._rule.clock()
        c.failures = 0
        self._change(child, c, "open", why)

    def _change(self, child: int, c: _Child, state: ChildState, why: str) -> None:
        c.state = state
        self._changes[child] = state
        # WARNING: rare, the level vLLM logs by default, and a child seen bypassed must be seen back.
        log.warning("connector %s: breaker %s: %s", self._rule.names[child], state, why)


@dataclass(frozen=True)
class BreakerRule(Contain):
    """Contains the errors of ``best_effort`` children; each connector instance keeps a
    :class:`Breaker` over them."""

    names: tuple[str, ...] = ()
    failures: int = 3
    cooldown_s: float = 30.0
    successes: int = 3
    #: Seconds, monotonic; tests pass their own.
    clock: Callable[[], float] = field(default=time.monotonic, compare=False)

    @property
    def children(self) -> frozenset[int]:
        return self.best_effort

    def monitor(self) -> Breaker:
        return Breaker(self)


def _breaker(children: tuple[Child, ...], params: BreakerParams) -> BreakerRule:
    return BreakerRule(
        frozenset(indices(children, params.children)),
        tuple(c.name for c in children),
        params.failures,
        params.cooldown_s,
        params.successes,
    )


def _explain_breaker(children: tuple[Child, ...], p: BreakerParams) -> str:
    calls = "a call fails" if p.failures == 1 else f"{p.failures} calls fail (with no step free of failures between)"
    steps = "a step" if p.successes == 1 else f"{p.successes} steps in a row"
    return (
        f"faults: {', '.join(p.children)} {'has' if len(p.children) == 1 else 'each have'} a circuit breaker: "
        f"when {calls}, the child is bypassed "
        f"(its loads recompute, its stores are skipped); after {p.cooldown_s:g} s one probe call goes "
        f"to it, and after {steps} with calls that succeeded and none that failed it is fully back "
        "(a failed probe bypasses it again); its state is the gauge vllm:kvcompose_breaker_state"
    )


@hookimpl
def kvcompose_rules() -> list[Rule[Any]]:
    return [
        Rule(
            "faults",
            "fail",
            "an exception in any child propagates (vLLM's behaviour)",
            lambda children, params: Contain(frozenset()),
            explain=lambda ch, p: "faults: an error in any child stops the engine",
        ),
        Rule(
            "faults",
            "isolate",
            "the listed best-effort children are disabled on error; their requests recompute",
            _isolate,
            params=ChildrenParams,
            explain=lambda ch, p: (
                "faults: "
                + ", ".join(p.children)
                + " are best-effort: on error they are disabled and their loads recompute"
            ),
        ),
        Rule(
            "faults",
            "breaker",
            "the listed children are bypassed after failures, probed after a cooldown, re-enabled after successes",
            _breaker,
            params=BreakerParams,
            explain=_explain_breaker,
            brief=lambda ch, p: (
                f"faults: {', '.join(p.children)} behind a circuit breaker ({p.failures} failures, "
                f"{p.cooldown_s:g} s cooldown)"
            ),
        ),
    ]
