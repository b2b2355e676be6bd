"""The completion rule ``owner`` and its tracker: which child reports reach vLLM, once. No vLLM.

Children in these tests: ``a`` (0) and ``b`` (1) load request ``r`` together; ``c`` (2) does not.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvcompose.catalog import Rule
from kvcompose.compose import loads
from kvcompose.contract import CompletionRule, CompletionTracker, TransferResults
from kvcompose.rules import completion
from kvcompose.rules.completion import FREED_KEPT, Owner, OwnerAccounting
from tests.unit.three import THREE


def owner_rule() -> Rule[Any]:
    [rule] = completion.kvcompose_rules()
    return rule


def tracker() -> CompletionTracker:
    obj = owner_rule().build(loads(THREE).children, None)
    assert isinstance(obj, CompletionRule)
    return obj.tracker()


def recv(*ids: str, failed: tuple[str, ...] = ()) -> TransferResults:
    """A child's ``finished_recving`` report (failed receives appear in both sets, vLLM's rule)."""
    return TransferResults(finished_recving={*ids, *failed}, failed_recving=set(failed))


def sent(*ids: str) -> TransferResults:
    return TransferResults(finished_sending=set(ids))


def report(**by_child: TransferResults) -> list[TransferResults | None]:
    """One report per child in YAML order: ``report(a=..., c=...)``."""
    return [by_child.get(name) for name in ("a", "b", "c")]


def two_loaders() -> CompletionTracker:
    t = tracker()
    t.expect_load("r", (0, 1))
    return t


# ------------------------------------------------------------------ the rule


def test_owner_builds_a_fresh_tracker_each_time() -> None:
    rule = owner_rule()
    assert (rule.kind, rule.name, rule.params) == ("completion", "owner", None)
    obj = rule.build(loads(THREE).children, None)
    assert isinstance(obj, Owner) and obj.names == ("a", "b", "c")
    one, two = obj.tracker(), obj.tracker()
    assert isinstance(one, OwnerAccounting) and isinstance(one, CompletionTracker)
    assert one is not two
    one.expect_load("r", (0,))
    assert two.owed_by(0) == set()
    assert isinstance(loads(THREE).completion, Owner)


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
    t = tracker()
    t.expect_load("r1", (0, 1))
    t.expect_load("r2", (1,))
    t.expect_load("r3", (2,))
    out, dropped = t.settle(report(a=recv("r1"), b=recv("r1", "r2"), c=recv(failed=("r3",))))
    assert out == TransferResults(finished_recving={"r1", "r2", "r3"}, failed_recving={"r3"})
    assert dropped == 0


# ------------------------------------------------------------------ owed_by and abandon


def test_owed_by_lists_the_loads_still_waiting_for_a_child() -> None:
    t = tracker()
    t.expect_load("r1", (0, 1))
    t.expect_load("r2", (1,))
    assert t.owed_by(0) == {"r1"} and t.owed_by(1) == {"r1", "r2"} and t.owed_by(2) == set()
    t.settle(report(a=recv("r1")))
    assert t.owed_by(0) == set() and t.owed_by(1) == {"r1", "r2"}
    t.settle(report(b=recv("r1", "r2")))
    assert t.owed_by(1) == set()


def test_abandon_turns_into_finished_and_failed_at_the_next_settle() -> None:
    t = two_loaders()
    t.settle(report(b=recv("r")))
    t.abandon(0, t.owed_by(0))
    out, dropped = t.settle([None, None, None])
    assert out == TransferResults(finished_recving={"r"}, failed_recving={"r"}) and dropped == 0
    assert t.owed_by(0) == set()


def test_abandon_counts_as_one_report_and_the_barrier_still_waits() -> None:
    t = two_loaders()
    t.abandon(0, {"r"})
    assert t.settle([None, None, None]) == (TransferResults(), 0)
    out, _ = t.settle(report(b=recv("r")))
    assert out == TransferResults(finished_recving={"r"}, failed_recving={"r"})


def test_abandon_is_settled_once() -> None:
    t = two_loaders()
    t.settle(report(b=recv("r")))
    t.abandon(0, {"r"})
    t.settle([None, None, None])
    assert t.settle([None, None, None]) == (TransferResults(), 0)


def test_abandon_merges_with_the_childs_own_report_of_that_step() -> None:
    t = tracker()
    t.expect_load("r1", (0,))
    t.expect_load("r2", (0,))
    t.abandon(0, {"r2"})
    out, dropped = t.settle(report(a=recv("r1")))
    assert out == TransferResults(finished_recving={"r1", "r2"}, failed_recving={"r2"}) and dropped == 0


def test_abandon_accumulates_until_settled() -> None:
    t = tracker()
    t.expect_load("r1", (0,))
    t.expect_load("r2", (0,))
    t.abandon(0, ["r1"])
    t.abandon(0, ["r2"])
    out, _ = t.settle([None, None, None])
    assert out == TransferResults(finished_recving={"r1", "r2"}, failed_recving={"r1", "r2"})


def test_a_failed_childs_owed_loads_abandoned_report_failed() -> None:
    t = tracker()
    t.expect_load("r1", (0, 1))
    t.expect_load("r2", (0,))
    assert t.owed_by(0) == {"r1", "r2"} and t.owed_by(1) == {"r1"}
    t.abandon(0, t.owed_by(0))
    out, _ = t.settle(report(b=recv("r1")))
    assert out == TransferResults(finished_recving={"r1", "r2"}, failed_recving={"r1", "r2"})


# ------------------------------------------------------------------ delayed frees


def test_a_delayed_free_owed_by_two_children_ends_when_both_reported() -> None:
    t = tracker()
    t.expect_saves("r", (0, 2))
    out, dropped = t.settle(report(a=sent("r")))
    assert not out and dropped == 0
    out, dropped = t.settle(report(c=sent("r")))
    assert out == TransferResults(finished_sending={"r"}) and dropped == 0


def test_a_delayed_free_both_in_one_step() -> None:
    t = tracker()
    t.expect_saves("r", (0, 2))
    assert t.settle(report(a=sent("r"), c=sent("r"))) == (TransferResults(finished_sending={"r"}), 0)


def test_a_non_saving_child_does_not_end_a_delayed_free() -> None:
    t = tracker()
    t.expect_saves("r", (0, 2))
    assert not t.settle(report(b=sent("r")))[0]
    assert not t.settle(report(a=sent("r")))[0]
    assert t.settle(report(c=sent("r")))[0] == TransferResults(finished_sending={"r"})


def test_an_unannounced_free_is_a_single_childs_own_and_forwarded() -> None:
    out, dropped = tracker().settle(report(b=sent("solo")))
    assert out == TransferResults(finished_sending={"solo"}) and dropped == 0


def test_loads_and_frees_settle_together() -> None:
    t = two_loaders()
    t.expect_saves("p", (1,))
    t.settle(report(a=recv("r")))
    out, _ = t.settle(report(b=TransferResults(finished_sending={"p"}, finished_recving={"r"})))
    assert out == TransferResults(finished_sending={"p"}, finished_recving={"r"})


# ------------------------------------------------------------------ admit (scheduler half)


def test_admit_keeps_only_requests_vllm_waits_for() -> None:
    t = tracker()
    assert t.admit({"r1", "r2", "late"}, {"r1", "r2", "r3"}) == {"r1", "r2"}
    assert t.admit(set(), {"r1"}) == set()
    assert t.admit({"r1"}, set()) == set()


def test_admit_does_not_change_its_arguments() -> None:
    finished, waiting = {"r1", "x"}, {"r1"}
    tracker().admit(finished, waiting)
    assert finished == {"r1", "x"} and waiting == {"r1"}


def test_explanation() -> None:
    rule = owner_rule()
    assert rule.explain is not None
    assert "each once" in rule.explain(loads(THREE).children, None)


def test_a_free_is_forwarded_once_even_when_a_child_repeats_it() -> None:
    t = tracker()
    t.expect_saves("r", (0, 2))
    t.settle(report(a=sent("r"), c=sent("r")))
    # A repeat from an owing child, or a report from a child that never owed it: vLLM already
    # freed the request, and its scheduler asserts on a finished_sending it does not know.
    assert t.settle(report(a=sent("r"))) == (TransferResults(), 1)
    assert t.settle(report(b=sent("r"))) == (TransferResults(), 1)
    assert t.settle(report(b=sent("solo")))[0] == TransferResults(finished_sending={"solo"})
    assert t.settle(report(b=sent("solo"))) == (TransferResults(), 1)


def test_the_memory_of_forwarded_frees_is_bounded() -> None:
    t = tracker()
    for i in range(FREED_KEPT + 1):
        t.settle(report(b=sent(f"r{i}")))
    assert len(t.freed) == FREED_KEPT and "r0" not in t.freed and f"r{FREED_KEPT}" in t.freed


def test_release_frees_what_only_the_released_child_owed() -> None:
    tracker = OwnerAccounting(("a", "b"))
    tracker.expect_saves("s1", (1,))
    tracker.expect_saves("s2", (0, 1))
    tracker.release(1)
    out, dropped = tracker.settle([None, None])
    assert out.finished_sending == {"s1"} and dropped == 0
    out, dropped = tracker.settle([TransferResults(finished_sending={"s2"}), TransferResults(finished_sending={"s1"})])
    assert out.finished_sending == {"s2"} and dropped == 1  # b's late s1 is a duplicate


# ------------------------------------------------------------------ what the scheduler announced


def test_told_records_loads_and_frees_and_reports_nothing_failed() -> None:
    t = tracker()
    assert t.told({"r": (0, 1)}, {"s": (2,)}, {}, bypassed=()) is False
    assert t.owed_by(0) == {"r"} == t.owed_by(1)
    out, _ = t.settle(report(a=recv("r"), b=recv("r"), c=sent("s")))
    assert out.finished_recving == {"r"} and out.finished_sending == {"s"} and not out.failed_recving


def test_told_fails_a_load_a_bypassed_child_owes_and_the_barrier_waits_for_the_rest() -> None:
    t = tracker()
    assert t.told({"r": (0, 1)}, {}, {}, bypassed={1}) is True
    out, _ = t.settle(report())  # b's share is settled as failed; a has not reported yet
    assert not out
    out, _ = t.settle(report(a=recv("r")))
    assert out.finished_recving == {"r"} == out.failed_recving


def test_told_abandoned_loads_are_reported_failed() -> None:
    t = tracker()
    assert t.told({"r": (0,)}, {}, {"r": (0,)}, bypassed=()) is True
    out, _ = t.settle(report())
    assert out.finished_recving == {"r"} == out.failed_recving


def test_told_releases_the_frees_a_bypassed_child_delays() -> None:
    t = tracker()
    assert t.told({}, {"s1": (2,), "s2": (0, 2)}, {}, bypassed={2}) is True
    out, _ = t.settle(report())
    assert out.finished_sending == {"s1"}  # c alone delayed it: freed now
    out, _ = t.settle(report(a=sent("s2")))
    assert out.finished_sending == {"s2"}
