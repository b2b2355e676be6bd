"""What the serving-stack engine tests share: nodes started for one module, stopped in reverse.

The single-engine baseline is not one of them: the session shares one (``conftest.py``).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from kvcompose.e2e.node import EngineSpec, wait_all_ready
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

    def prefill_server(self, model: Path, logs: Path, port: int) -> ServerNode:
        """A prefill server of the shipped ``pd-prefill.yaml`` (NIXL side channel on ``port``),
        not started yet: start it with the module's other servers (:meth:`start`)."""
        return ServerNode(EngineSpec("prefill", str(model), str(EXAMPLES / "pd-prefill.yaml"), port), logs)

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
