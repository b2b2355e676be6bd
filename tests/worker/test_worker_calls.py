"""Worker calls whose children's answers are combined: ``get_finished_count`` (the children must
agree) and ``shutdown`` (every child gets it, every error is reported)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kvcompose.testing import inspector
from kvcompose.vllm.connector import ChildFailed

Factory = Callable[..., Any]

TWO = """
version: 1
connectors:
  - {name: a, type: record}
  - {name: b, type: record}
"""


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [(None, None, None), (2, 2, 2), (2, None, None), (None, 2, None)],
)
def test_finished_count_is_the_childrens_common_answer(
    kvcompose_worker: Factory, a: int | None, b: int | None, expected: int | None
) -> None:
    conn = kvcompose_worker(TWO, register=False).connector
    inspector.child(conn, "a").get_finished_count = lambda: a
    inspector.child(conn, "b").get_finished_count = lambda: b
    assert conn.get_finished_count() == expected


def test_children_that_expect_different_finished_counts_are_refused_by_name(kvcompose_worker: Factory) -> None:
    conn = kvcompose_worker(TWO, register=False).connector
    inspector.child(conn, "a").get_finished_count = lambda: 1
    inspector.child(conn, "b").get_finished_count = lambda: 2
    with pytest.raises(ValueError, match=r"get_finished_count differently: \{'a': 1, 'b': 2\}"):
        conn.get_finished_count()


def test_every_child_is_shut_down_and_every_error_is_named(kvcompose_worker: Factory) -> None:
    conn = kvcompose_worker(TWO, register=False).connector
    called: list[str] = []

    def failing(name: str) -> Callable[[], None]:
        def shutdown() -> None:
            called.append(name)
            if called.count(name) == 1:  # the kit's teardown shuts the harness down again
                raise RuntimeError(f"{name} stuck")

        return shutdown

    inspector.child(conn, "a").shutdown = failing("a")
    inspector.child(conn, "b").shutdown = failing("b")
    with pytest.raises(ChildFailed, match=r"shutdown failed in a \(RuntimeError\('a stuck'\)\), b ") as err:
        conn.shutdown()
    assert called == ["a", "b"]  # b was shut down although a raised
    assert isinstance(err.value.__cause__, RuntimeError)
