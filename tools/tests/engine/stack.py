"""What the serving-stack engine tests share: nodes started for one module, stopped in reverse.

The single-engine baseline is not one of them: the session shares one (``conftest.py``).
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

from kvcompose.examples import EXAMPLES
from kvcompose_tools.e2e.server import ServerNode
from kvcompose_tools.e2e.spec import EngineSpec


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
