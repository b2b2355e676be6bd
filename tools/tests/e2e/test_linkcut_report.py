"""What the link-cut drive (:mod:`kvcompose_tools.e2e.linkcut`) counts as a problem, from its report alone."""

from __future__ import annotations

from kvcompose_tools.e2e.linkcut import CutReport, Outcome


def served() -> CutReport:
    return CutReport(
        cut_s=15,
        bound_s=120,
        during=[Outcome(sent_s=1.0, took_s=27.0, tokens=[1, 2])],
        usage_zero_after_s=12.0,
        after=[([1, 2], 229_376)],
    )


def test_a_pair_that_answered_and_refused_every_late_read_has_no_problem() -> None:
    report = served()
    report.expired, report.late_reads, report.refused = 2, 2, 2
    assert report.problems() == []


def test_a_read_of_released_blocks_the_decode_did_not_refuse_is_a_problem() -> None:
    report = served()
    report.expired, report.late_reads, report.refused, report.unrefused = 2, 2, 1, 1
    (problem,) = report.problems()
    assert "the decode used 1 read(s) of blocks the prefill had released" in problem


def test_a_request_with_no_end_and_kv_left_are_problems() -> None:
    report = served()
    report.during = [Outcome(sent_s=2.0)]
    report.usage_zero_after_s, report.usage_left = None, {"decode": 0.1}
    problems = report.problems()
    assert len(problems) == 2 and "no end" in problems[0] and "KV usage" in problems[1]
