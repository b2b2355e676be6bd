"""What the serving-stack engine tests share: nodes started for one module, stopped in reverse.

The single-engine baseline is not one of them: the session shares one (``conftest.py``).
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

from kvcompose.examples import EXAMPLES
from kvcompose_tools.e2e.fleet import Fleet, Scenario
from kvcompose_tools.e2e.flow import same_output
from kvcompose_tools.e2e.model import make_model
from kvcompose_tools.e2e.server import ServerNode
from kvcompose_tools.e2e.spec import EngineSpec

#: How long after a prefill is killed a request may still fail: the router's health window
#: (HEALTH_ARGS: two failed checks a second apart) and a check's own timeout.
DETECT_S = 6.0


class Nodes:
    """Engines, servers and routers a test module started; :meth:`close` stops them, last first.

    A subclass's constructor records each node in :attr:`nodes` as soon as it exists, before
    waiting for it, so that a constructor failing half-way still has them stopped
    (:func:`module_stack`)."""

    def __init__(self) -> None:
        self.nodes: list[Any] = []

    def prefill_server(self, model: Path, logs: Path, port: int) -> ServerNode:
        """A prefill server of the shipped ``pd-prefill.yaml`` (NIXL side channel on ``port``),
        not started yet: record it, start the module's other servers, then wait for them all."""
        return ServerNode(EngineSpec("prefill", str(model), str(EXAMPLES / "pd-prefill.yaml"), port), logs)

    def close(self) -> None:
        for n in reversed(getattr(self, "nodes", [])):  # none when the constructor failed early
            n.close()


class FleetStack(Nodes):
    """A 2P2D :class:`Fleet` of the seeded tiny model behind vLLM's router, ``fleet`` its keyword
    arguments (policy, host tier, pool), started for one module."""

    def __init__(self, logs: Path, fleet: dict[str, Any]) -> None:
        super().__init__()
        self.fleet = Fleet(make_model(0), logs, **fleet)
        self.nodes.append(self.fleet)
        self.fleet.start()


def assert_served_after_detection(scenario: Scenario) -> None:
    """No turn failed later than :data:`DETECT_S` after the kill."""
    late = [t for t in scenario.turns if t.served is None and (t.after_s or 0) > DETECT_S]
    assert not late, [(t.session, t.after_s, t.error) for t in late]


def assert_answers_as_one_engine(scenario: Scenario, baseline: Any, max_tokens: int) -> None:
    """Every served turn's answer is the single engine's, asked the same prompts in the same order."""
    for t in scenario.turns:
        if t.served is not None:
            (want,) = baseline.generate([t.prompt], max_tokens)
            assert same_output(t.served.token_ids, t.served.logprobs, want), (t.session, t.served.token_ids, want)


S = TypeVar("S", bound=Nodes)


def module_stack(cls: type[S], prefix: str, *args: Any) -> Iterator[S]:
    """A module fixture's body: ``cls(logs, *args)`` in a temporary log folder, yielded, then
    closed, also when its constructor failed half-way: the instance exists before its
    constructor runs, so the nodes it had recorded are stopped."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        stack = cls.__new__(cls)
        try:
            stack.__init__(Path(tmp), *args)  # type: ignore[misc]
            yield stack
        finally:
            stack.close()
