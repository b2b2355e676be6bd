"""What the serving-stack engine tests share: nodes started for one module, stopped in reverse."""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from kvcompose.e2e.node import EngineNode, EngineSpec, wait_all_ready
from kvcompose.e2e.server import ServerNode
from kvcompose.examples import EXAMPLES


class Nodes:
    """Engines, servers and routers a test module started; :meth:`close` stops them, last first."""

    def __init__(self) -> None:
        self.nodes: list[Any] = []

    def start(self, *nodes: Any) -> None:
        """Record ``nodes`` (so that :meth:`close` stops them even if one fails to start), wait
        until all are ready."""
        self.nodes += nodes
        wait_all_ready(list(nodes))

    def baseline_and_prefill(self, model: Path, logs: Path, port: int) -> tuple[EngineNode, ServerNode]:
        """An offline engine without connector (the baseline) and a prefill server of the shipped
        ``pd-prefill.yaml`` (NIXL side channel on ``port``), both ready."""
        baseline = EngineNode(EngineSpec("baseline", str(model)), logs)
        prefill = ServerNode(EngineSpec("prefill", str(model), str(EXAMPLES / "pd-prefill.yaml"), port), logs)
        self.start(baseline, prefill)
        return baseline, prefill

    def retire(self, node: Any) -> None:
        """Stop ``node`` now (the baseline, once it answered: at most three engines fit)."""
        node.close()
        self.nodes.remove(node)

    def close(self) -> None:
        for n in reversed(self.nodes):
            n.close()


S = TypeVar("S", bound=Nodes)


def module_stack(build: Callable[[Path], S], prefix: str) -> Iterator[S]:
    """A module fixture's body: ``build`` the stack in a temporary log folder, yield it, close
    whatever it started (also when ``build`` failed half-way, through the nodes it recorded)."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        started: list[S] = []
        try:
            started.append(build(Path(tmp)))
            yield started[0]
        finally:
            for s in started:
                s.close()
