"""A worker's record of each request's load and free (``kvcompose.vllm.loads.Transfers``) under
the completion rule ``owner``: which child reports reach vLLM, once.

Children in these tests: ``a`` (0) and ``b`` (1) load request ``r`` together; ``c`` (2) does not.
"""

from __future__ import annotations

import pytest

from kvcompose.contract import TransferResults
from kvcompose.rules.load import Owner
from kvcompose.vllm.loads import FREED_KEPT, Transfers


def transfers() -> Transfers:
    return Transfers(Owner(), ("a", "b", "c"))


def expect_load(t: Transfers, request_id: str, children: tuple[int, ...]) -> None:
    """The scheduler announced the load in a step's metadata."""
    t.told({request_id: children}, {}, {}, ())


def expect_saves(t: Transfers, request_id: str, children: tuple[int, ...]) -> None:
    """The scheduler announced the delayed free in a step's metadata."""
    t.told({}, {request_id: children}, {}, ())


def abandoned(t: Transfers, child: int, *request_ids: str) -> None:
    """The scheduler announced that ``child`` failed before these loads started."""
    t.told({}, {}, {r: (child,) for r in request_ids}, ())


def recv(*ids: str, failed: tuple[str, ...] = ()) -> TransferResults:
    """A child's ``finished_recving`` report (failed receives appear in both sets, vLLM's rule)."""
    return TransferResults(finished_recving={*ids, *failed}, failed_recving=set(failed))


def sent(*ids: str) -> TransferResults:
    return TransferResults(finished_sending=set(ids))


def report(**by_child: TransferResults) -> list[TransferResults | None]:
    """One report per child in YAML order: ``report(a=..., c=...)``."""
    return [by_child.get(name) for name in ("a", "b", "c")]


def two_loaders() -> Transfers:
    t = transfers()
    expect_load(t, "r", (0, 1))
    return t


def test_nothing_reported_is_nothing_forwarded() -> None:
    out, dropped = two_loaders().settle([None, None, None])
    assert out == TransferResults() and not out and dropped == 0


# ------------------------------------------------------------------ the load barrier


def test_barrier_first_report_forwards_nothing_second_forwards_once() -> None:
    t = two_loaders()
    out, dropped = t.settle(report(a=recv("r")))
    assert not out and dropped == 0
    out, dropped = t.settle(report(b=recv("r")))
    assert out == TransferResults(finished_recving={"r"}) and dropped == 0
    # Late duplicates after the load completed are withheld and counted.
    out, dropped = t.settle(report(a=recv("r"), b=recv("r")))
    assert not out and dropped == 2


def test_barrier_both_in_one_step_forward_once() -> None:
    out, dropped = two_loaders().settle(report(a=recv("r"), b=recv("r")))
    assert out == TransferResults(finished_recving={"r"}) and dropped == 0


def test_barrier_order_does_not_matter() -> None:
    t = two_loaders()
    assert t.settle(report(b=recv("r"))) == (TransferResults(), 0)
    assert t.settle(report(a=recv("r"))) == (TransferResults(finished_recving={"r"}), 0)


def test_a_duplicate_before_the_barrier_is_dropped_and_does_not_count() -> None:
    t = two_loaders()
    t.settle(report(a=recv("r")))
    out, dropped = t.settle(report(a=recv("r")))
    assert not out and dropped == 1
    assert t.owed_by(1) == {"r"}  # still waiting for b


def test_a_non_loader_report_is_dropped_and_does_not_count() -> None:
    t = two_loaders()
    out, dropped = t.settle(report(c=recv("r")))
    assert not out and dropped == 1
    t.settle(report(a=recv("r")))
    out, dropped = t.settle(report(b=recv("r"), c=recv("r")))
    assert out == TransferResults(finished_recving={"r"}) and dropped == 1


def test_a_report_for_an_unknown_request_is_dropped() -> None:
    out, dropped = two_loaders().settle(report(a=recv("nobody"), c=recv("other")))
    assert not out and dropped == 2


@pytest.mark.parametrize("who", ["a", "b"])
def test_a_failed_contributor_fails_the_forwarded_report(who: str) -> None:
    t = two_loaders()
    first, last = ("a", "b") if who == "a" else ("b", "a")
    # The failed one reports first: the failure is remembered until the barrier.
    assert t.settle(report(**{first: recv(failed=("r",))})) == (TransferResults(), 0)
    out, _ = t.settle(report(**{last: recv("r")}))
    assert out == TransferResults(finished_recving={"r"}, failed_recving={"r"})


def test_a_failure_reported_last_fails_the_forwarded_report() -> None:
    t = two_loaders()
    t.settle(report(a=recv("r")))
    out, _ = t.settle(report(b=recv(failed=("r",))))
    assert out == TransferResults(finished_recving={"r"}, failed_recving={"r"})


def test_a_failed_non_loader_does_not_fail_the_load() -> None:
    t = two_loaders()
    out, dropped = t.settle(report(a=recv("r"), c=recv(failed=("r",))))
    assert not out and dropped == 1
    out, _ = t.settle(report(b=recv("r")))
    assert out == TransferResults(finished_recving={"r"})


def test_loads_are_tracked_per_request() -> None:
    t = transfers()
    expect_load(t, "r1", (0, 1))
    expect_load(t, "r2", (1,))
    expect_load(t, "r3", (2,))
    out, dropped = t.settle(report(a=recv("r1"), b=recv("r1", "r2"), c=recv(failed=("r3",))))
    assert out == TransferResults(finished_recving={"r1", "r2", "r3"}, failed_recving={"r3"})
    assert dropped == 0


# ------------------------------------------------------------------ owed_by and abandon


def test_owed_by_lists_the_loads_still_waiting_for_a_child() -> None:
    t = transfers()
    expect_load(t, "r1", (0, 1))
    expect_load(t, "r2", (1,))
    assert t.owed_by(0) == {"r1"} and t.owed_by(1) == {"r1", "r2"} and t.owed_by(2) == set()
    t.settle(report(a=recv("r1")))
    assert t.owed_by(0) == set() and t.owed_by(1) == {"r1", "r2"}
    t.settle(report(b=recv("r1", "r2")))
    assert t.owed_by(1) == set()


def test_abandon_turns_into_finished_and_failed_at_the_next_settle() -> None:
    t = two_loaders()
    t.settle(report(b=recv("r")))
    t.failed(0, bypassed=False)
    out, dropped = t.settle([None, None, None])
    assert out == TransferResults(finished_recving={"r"}, failed_recving={"r"}) and dropped == 0
    assert t.owed_by(0) == set()


def test_abandon_counts_as_one_report_and_the_barrier_still_waits() -> None:
    t = two_loaders()
    abandoned(t, 0, "r")
    assert t.settle([None, None, None]) == (TransferResults(), 0)
    out, _ = t.settle(report(b=recv("r")))
    assert out == TransferResults(finished_recving={"r"}, failed_recving={"r"})


def test_abandon_is_settled_once() -> None:
    t = two_loaders()
    t.settle(report(b=recv("r")))
    abandoned(t, 0, "r")
    t.settle([None, None, None])
    assert t.settle([None, None, None]) == (TransferResults(), 0)


def test_abandon_merges_with_the_childs_own_report_of_that_step() -> None:
    t = transfers()
    expect_load(t, "r1", (0,))
    expect_load(t, "r2", (0,))
    abandoned(t, 0, "r2")
    out, dropped = t.settle(report(a=recv("r1")))
    assert out == TransferResults(finished_recving={"r1", "r2"}, failed_recving={"r2"}) and dropped == 0


def test_abandon_accumulates_until_settled() -> None:
    t = transfers()
    expect_load(t, "r1", (0,))
    expect_load(t, "r2", (0,))
    abandoned(t, 0, "r1")
    abandoned(t, 0, "r2")
    out, _ = t.settle([None, None, None])
    assert out == TransferResults(finished_recving={"r1", "r2"}, failed_recving={"r1", "r2"})


def test_a_failed_childs_owed_loads_abandoned_report_failed() -> None:
    t = transfers()
    expect_load(t, "r1", (0, 1))
    expect_load(t, "r2", (0,))
    assert t.owed_by(0) == {"r1", "r2"} and t.owed_by(1) == {"r1"}
    t.failed(0, bypassed=False)
    out, _ = t.settle(report(b=recv("r1")))
    assert out == TransferResults(finished_recving={"r1", "r2"}, failed_recving={"r1", "r2"})


# ------------------------------------------------------------------ delayed frees


def test_a_delayed_free_owed_by_two_children_ends_when_both_reported() -> None:
    t = transfers()
    expect_saves(t, "r", (0, 2))
    out, dropped = t.settle(report(a=sent("r")))
    assert not out and dropped == 0
    out, dropped = t.settle(report(c=sent("r")))
    assert out == TransferResults(finished_sending={"r"}) and dropped == 0


def test_a_delayed_free_both_in_one_step() -> None:
    t = transfers()
    expect_saves(t, "r", (0, 2))
    assert t.settle(report(a=sent("r"), c=sent("r"))) == (TransferResults(finished_sending={"r"}), 0)


def test_a_non_saving_child_does_not_end_a_delayed_free() -> None:
    t = transfers()
    expect_saves(t, "r", (0, 2))
    assert not t.settle(report(b=sent("r")))[0]
    assert not t.settle(report(a=sent("r")))[0]
    assert t.settle(report(c=sent("r")))[0] == TransferResults(finished_sending={"r"})


def test_an_unannounced_free_is_a_single_childs_own_and_forwarded() -> None:
    out, dropped = transfers().settle(report(b=sent("solo")))
    assert out == TransferResults(finished_sending={"solo"}) and dropped == 0


def test_loads_and_frees_settle_together() -> None:
    t = two_loaders()
    expect_saves(t, "p", (1,))
    t.settle(report(a=recv("r")))
    out, _ = t.settle(report(b=TransferResults(finished_sending={"p"}, finished_recving={"r"})))
    assert out == TransferResults(finished_sending={"p"}, finished_recving={"r"})


def test_a_free_is_forwarded_once_even_when_a_child_repeats_it() -> None:
    t = transfers()
    expect_saves(t, "r", (0, 2))
    t.settle(report(a=sent("r"), c=sent("r")))
    # A repeat from an owing child, or a report from a child that never owed it: vLLM already
    # freed the request, and its scheduler asserts on a finished_sending it does not know.
    assert t.settle(report(a=sent("r"))) == (TransferResults(), 1)
    assert t.settle(report(b=sent("r"))) == (TransferResults(), 1)
    assert t.settle(report(b=sent("solo")))[0] == TransferResults(finished_sending={"solo"})
    assert t.settle(report(b=sent("solo"))) == (TransferResults(), 1)


def test_the_memory_of_forwarded_frees_is_bounded() -> None:
    t = transfers()
    for i in range(FREED_KEPT + 1):
        t.settle(report(b=sent(f"r{i}")))
    assert t.settle(report(b=sent(f"r{FREED_KEPT}"))) == (TransferResults(), 1)  # remembered: a duplicate
    assert t.settle(report(b=sent("r0")))[0] == TransferResults(finished_sending={"r0"})  # the oldest, forgotten


def test_release_frees_what_only_the_released_child_owed() -> None:
    t = Transfers(Owner(), ("a", "b"))
    expect_saves(t, "s1", (1,))
    expect_saves(t, "s2", (0, 1))
    t.failed(1, bypassed=True)
    out, dropped = t.settle([None, None])
    assert out.finished_sending == {"s1"} and dropped == 0
    out, dropped = t.settle([TransferResults(finished_sending={"s2"}), TransferResults(finished_sending={"s1"})])
    assert out.finished_sending == {"s2"} and dropped == 1  # b's late s1 is a duplicate


# ------------------------------------------------------------------ what the scheduler announced


def test_told_records_loads_and_frees_and_reports_nothing_failed() -> None:
    t = transfers()
    assert t.told({"r": (0, 1)}, {"s": (2,)}, {}, bypassed=()) is False
    assert t.owed_by(0) == {"r"} == t.owed_by(1)
    out, _ = t.settle(report(a=recv("r"), b=recv("r"), c=sent("s")))
    assert out.finished_recving == {"r"} and out.finished_sending == {"s"} and not out.failed_recving


def test_told_fails_a_load_a_bypassed_child_owes_and_the_barrier_waits_for_the_rest() -> None:
    t = transfers()
    assert t.told({"r": (0, 1)}, {}, {}, bypassed={1}) is True
    out, _ = t.settle(report())  # b's share is settled as failed; a has not reported yet
    assert not out
    out, _ = t.settle(report(a=recv("r")))
    assert out.finished_recving == {"r"} == out.failed_recving


def test_told_abandoned_loads_are_reported_failed() -> None:
    t = transfers()
    assert t.told({"r": (0,)}, {}, {"r": (0,)}, bypassed=()) is True
    out, _ = t.settle(report())
    assert out.finished_recving == {"r"} == out.failed_recving


def test_told_releases_the_frees_a_bypassed_child_delays() -> None:
    t = transfers()
    assert t.told({}, {"s1": (2,), "s2": (0, 2)}, {}, bypassed={2}) is True
    out, _ = t.settle(report())
    assert out.finished_sending == {"s1"}  # c alone delayed it: freed now
    out, _ = t.settle(report(a=sent("s2")))
    assert out.finished_sending == {"s2"}
