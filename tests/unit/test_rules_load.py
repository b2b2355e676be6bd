"""Load rules (``first-wins``, ``longest-hit``, ``ranges``) and the LoadRule defaults (``allocate``,
``awaited``, ``deferred``, ``resume``).

Only public behaviour, no vLLM: a scripted ``ask`` stands in for the children's
``get_num_new_matched_tokens`` and records every call, so "not asked" is counted, not assumed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from kvcompose.catalog import Child, Rule
from kvcompose.compose import loads
from kvcompose.contract import NO_HIT, NOT_READY, Contribution, EngineFacts, LoadRule, Selection
from kvcompose.rules import load
from kvcompose.rules.load import FirstWins, LongestHit, Ranges
from kvcompose.testing.types import RecordRangeType
from tests.unit.three import THREE, three_children

Answer = tuple["int | None", bool]


class Script:
    """An ``ask`` that answers per child as scripted and records each call."""

    def __init__(self, answers: Mapping[int, Answer]) -> None:
        self.answers = dict(answers)
        self.calls: list[tuple[int, int]] = []

    def __call__(self, child: int, num_computed_tokens: int) -> Answer:
        self.calls.append((child, num_computed_tokens))
        return self.answers[child]

    @property
    def asked(self) -> list[int]:
        return [child for child, _ in self.calls]


def built_rules() -> dict[str, Rule[Any]]:
    return {r.name: r for r in load.kvcompose_rules() if r.kind == "load"}


def select(rule: LoadRule, answers: Mapping[int, Answer], n: int = 0) -> tuple[Selection, Script]:
    ask = Script(answers)
    return rule.select(ask, tuple(sorted(answers)), n, None), ask


def only(child: int, tokens: int, is_async: bool) -> Selection:
    return Selection(tokens, is_async, (Contribution(child, 0, tokens, is_async),))


# ------------------------------------------------------------------ the hook's Rule objects


def test_the_module_offers_both_load_rules() -> None:
    rules = built_rules()
    assert set(rules) == {"first-wins", "longest-hit", "ranges"}
    assert all(r.kind == "load" and r.params is None for r in rules.values())


@pytest.mark.parametrize(("name", "cls"), [("first-wins", FirstWins), ("longest-hit", LongestHit)])
def test_build_returns_a_load_rule(name: str, cls: type[LoadRule]) -> None:
    obj = built_rules()[name].build(three_children(), None)
    assert isinstance(obj, cls) and isinstance(obj, LoadRule)


def test_first_wins_is_the_default_and_longest_hit_is_chosen_by_name() -> None:
    assert isinstance(loads(THREE).load, FirstWins)
    assert isinstance(loads(THREE + "rules: {load: longest-hit}\n").load, LongestHit)


def test_explanations_name_the_order() -> None:
    children = three_children()
    rules = built_rules()
    first = rules["first-wins"]
    longest = rules["longest-hit"]
    assert first.explain is not None and longest.explain is not None
    assert "a > b > c" in first.explain(children, None) and "not asked" in first.explain(children, None)
    assert "a > b > c" in longest.explain(children, None) and "longest" in longest.explain(children, None)


# ------------------------------------------------------------------ first-wins


def test_first_wins_children_below_the_winner_are_not_asked() -> None:
    sel, ask = select(FirstWins(), {0: (0, False), 1: (32, True), 2: (64, False)}, n=16)
    assert sel == only(1, 32, True)
    assert ask.calls == [(0, 16), (1, 16)]  # c was never asked, though it had more


def test_first_wins_the_first_child_with_a_hit_wins_even_when_sync() -> None:
    sel, ask = select(FirstWins(), {0: (16, False), 1: (64, True), 2: (64, True)})
    assert sel == only(0, 16, False)
    assert ask.asked == [0]


def test_first_wins_none_above_the_winner_waits() -> None:
    sel, ask = select(FirstWins(), {0: (None, False), 1: (32, True), 2: (0, False)})
    assert sel == NOT_READY
    assert ask.asked == [0]  # nobody below the undecided child is probed either


def test_first_wins_none_after_a_zero_still_waits() -> None:
    sel, ask = select(FirstWins(), {0: (0, False), 1: (None, False), 2: (32, False)})
    assert sel == NOT_READY
    assert ask.asked == [0, 1]


def test_first_wins_none_below_a_winner_is_never_asked() -> None:
    sel, ask = select(FirstWins(), {0: (32, False), 1: (None, False), 2: (None, False)})
    assert sel == only(0, 32, False)
    assert ask.asked == [0]


def test_first_wins_no_hit_asks_everyone_once() -> None:
    sel, ask = select(FirstWins(), {0: (0, False), 1: (0, True), 2: (0, False)})
    assert sel == NO_HIT
    assert ask.asked == [0, 1, 2]


def test_first_wins_asks_only_the_given_children_in_their_order() -> None:
    ask = Script({0: (0, False), 1: (64, True), 2: (32, False)})
    sel = FirstWins().select(ask, (0, 2), 0, None)  # child 1 is bypassed
    assert sel == only(2, 32, False)
    assert ask.asked == [0, 2]


def test_first_wins_with_no_children_is_no_hit() -> None:
    ask = Script({})
    assert FirstWins().select(ask, (), 0, None) == NO_HIT
    assert ask.calls == []


class LastFirst(FirstWins):
    """A rule that is first-wins in another order: it overrides only ``order``."""

    def order(self, children: Sequence[int], kv_transfer_params: Mapping[str, Any] | None) -> Sequence[int]:
        return tuple(reversed(children)) if kv_transfer_params else children


def test_first_wins_asks_in_its_order_and_stops_at_the_first_hit() -> None:
    ask = Script({0: (16, False), 1: (0, False), 2: (32, True)})
    assert LastFirst().select(ask, (0, 1, 2), 0, {"any": 1}) == only(2, 32, True)
    assert ask.asked == [2]


def test_first_wins_order_is_asked_per_request() -> None:
    ask = Script({0: (16, False), 1: (0, False), 2: (32, True)})
    assert LastFirst().select(ask, (0, 1, 2), 0, None) == only(0, 16, False)
    assert ask.asked == [0]


def test_first_wins_none_early_in_its_order_waits() -> None:
    ask = Script({0: (16, False), 1: (None, False), 2: (0, False)})
    assert LastFirst().select(ask, (0, 1, 2), 0, {"any": 1}) == NOT_READY
    assert ask.asked == [2, 1]


def test_first_wins_default_order_is_yaml_order() -> None:
    assert FirstWins().order((2, 0, 1), {"k": 1}) == (2, 0, 1)


# ------------------------------------------------------------------ longest-hit


def test_longest_hit_asks_every_child_once_and_the_longest_wins() -> None:
    sel, ask = select(LongestHit(), {0: (16, False), 1: (48, True), 2: (32, False)}, n=32)
    assert sel == only(1, 48, True)
    assert ask.calls == [(0, 32), (1, 32), (2, 32)]


def test_longest_hit_keeps_asking_after_a_hit() -> None:
    sel, ask = select(LongestHit(), {0: (64, False), 1: (16, True), 2: (0, False)})
    assert sel == only(0, 64, False)
    assert ask.asked == [0, 1, 2]


@pytest.mark.parametrize(
    ("answers", "winner"),
    [
        ({0: (16, False), 1: (32, False), 2: (32, True)}, only(1, 32, False)),
        ({0: (32, True), 1: (32, False), 2: (32, False)}, only(0, 32, True)),
        ({0: (0, False), 1: (8, False), 2: (8, True)}, only(1, 8, False)),
    ],
)
def test_longest_hit_ties_go_to_yaml_order(answers: dict[int, Answer], winner: Selection) -> None:
    assert select(LongestHit(), answers)[0] == winner


@pytest.mark.parametrize(
    "answers",
    [
        {0: (None, False), 1: (64, True), 2: (0, False)},  # above the best
        {0: (64, True), 1: (0, False), 2: (None, False)},  # below the best
        {0: (None, False), 1: (None, False), 2: (None, False)},
        {0: (0, False), 1: (None, False), 2: (0, False)},
    ],
)
def test_longest_hit_any_none_waits(answers: dict[int, Answer]) -> None:
    sel, ask = select(LongestHit(), answers)
    assert sel == NOT_READY
    assert ask.asked == [0, 1, 2]


def test_longest_hit_zero_is_an_answer_not_a_wait() -> None:
    sel, ask = select(LongestHit(), {0: (0, False), 1: (0, True), 2: (0, False)})
    assert sel == NO_HIT
    assert sel.tokens == 0 and sel.contributions == ()
    assert ask.asked == [0, 1, 2]


def test_longest_hit_asks_only_the_given_children() -> None:
    ask = Script({0: (8, False), 1: (None, False), 2: (16, True)})
    sel = LongestHit().select(ask, (0, 2), 0, None)  # the undecided child 1 is bypassed
    assert sel == only(2, 16, True)
    assert ask.asked == [0, 2]


# ------------------------------------------------------------------ both: the selection's shape


@pytest.mark.parametrize("rule", [FirstWins(), LongestHit()], ids=["first-wins", "longest-hit"])
@pytest.mark.parametrize(
    "answers",
    [
        {0: (0, False), 1: (0, False)},
        {0: (16, True), 1: (32, False)},
        {0: (0, False), 1: (48, True)},
        {0: (None, False), 1: (48, True)},
    ],
)
def test_tokens_is_the_sum_of_contributions(rule: LoadRule, answers: dict[int, Answer]) -> None:
    sel, _ = select(rule, answers)
    if sel.tokens is None:
        assert sel == NOT_READY
    else:
        assert sel.tokens == sum(c.tokens for c in sel.contributions)
        assert all(c.start == 0 and c.tokens > 0 for c in sel.contributions)
        assert sel.is_async == any(c.is_async for c in sel.contributions)


# ------------------------------------------------------------------ allocate (the Protocol's default)

SPLIT = Selection(
    48,
    True,
    (Contribution(0, 0, 16, False), Contribution(1, 16, 32, True)),
)


@pytest.mark.parametrize("rule", [FirstWins(), LongestHit()], ids=["first-wins", "longest-hit"])
def test_allocate_gives_the_winner_what_vllm_allocated(rule: LoadRule) -> None:
    sel = only(1, 32, True)
    assert rule.allocate(sel, 32) == (Contribution(1, 0, 32, True),)


@pytest.mark.parametrize("rule", [FirstWins(), LongestHit()], ids=["first-wins", "longest-hit"])
def test_allocate_clips_to_fewer_tokens(rule: LoadRule) -> None:
    assert rule.allocate(only(1, 32, True), 16) == (Contribution(1, 0, 16, True),)


@pytest.mark.parametrize("rule", [FirstWins(), LongestHit()], ids=["first-wins", "longest-hit"])
def test_allocate_zero_gives_nothing(rule: LoadRule) -> None:
    assert rule.allocate(only(1, 32, True), 0) == ()
    assert rule.allocate(SPLIT, 0) == ()


@pytest.mark.parametrize("rule", [FirstWins(), LongestHit()], ids=["first-wins", "longest-hit"])
def test_allocate_of_no_hit_or_not_ready_is_nothing(rule: LoadRule) -> None:
    assert rule.allocate(NO_HIT, 0) == ()
    assert rule.allocate(NOT_READY, 0) == ()


@pytest.mark.parametrize(
    ("num_external_tokens", "expected"),
    [
        (48, SPLIT.contributions),
        (64, SPLIT.contributions),  # more than selected: nobody loads more than it offered
        (24, (Contribution(0, 0, 16, False), Contribution(1, 16, 8, True))),
        (16, (Contribution(0, 0, 16, False),)),
        (8, (Contribution(0, 0, 8, False),)),
        (0, ()),
    ],
)
def test_allocate_clips_a_split_in_order(num_external_tokens: int, expected: tuple[Contribution, ...]) -> None:
    out = FirstWins().allocate(SPLIT, num_external_tokens)
    assert out == expected
    assert sum(c.tokens for c in out) == min(num_external_tokens, 48)


# ------------------------------------------------------------------ awaited (the Protocol's default)


def test_awaited_is_only_async_contributors_with_tokens() -> None:
    contributions = (
        Contribution(0, 0, 16, True),
        Contribution(1, 16, 16, False),  # sync: loaded before vLLM proceeds
        Contribution(2, 32, 0, True),  # async but nothing to load
        Contribution(3, 32, 8, True),
    )
    assert FirstWins().awaited(contributions) == (0, 3)
    assert LongestHit().awaited(contributions) == (0, 3)


def test_awaited_of_a_sync_load_or_nothing_is_empty() -> None:
    assert FirstWins().awaited((Contribution(0, 0, 32, False),)) == ()
    assert FirstWins().awaited(()) == ()


@pytest.mark.parametrize(
    ("is_async", "num_external_tokens", "awaited"),
    [(True, 32, (1,)), (True, 8, (1,)), (True, 0, ()), (False, 32, ())],
)
def test_select_allocate_awaited_together(is_async: bool, num_external_tokens: int, awaited: tuple[int, ...]) -> None:
    rule = FirstWins()
    sel, _ = select(rule, {0: (0, False), 1: (32, is_async)})
    assert rule.awaited(rule.allocate(sel, num_external_tokens)) == awaited


# ------------------------------------------------------------------ deferred, resume (the Protocol's defaults)

MIXED = (
    Contribution(0, 0, 64, True),  # host
    Contribution(1, 64, 128, False),  # disk: synchronous
    Contribution(2, 192, 20, True),  # pd
)


def test_deferred_is_the_sync_part_of_a_load_with_an_async_part() -> None:
    assert FirstWins().deferred(MIXED) == (MIXED[1],)
    assert FirstWins().deferred(MIXED[1:2]) == ()  # a synchronous load alone runs at once
    assert FirstWins().deferred((MIXED[0], MIXED[2])) == ()
    assert FirstWins().deferred((Contribution(0, 0, 0, True), MIXED[1])) == ()  # nothing async to wait for
    assert FirstWins().deferred(()) == ()


@pytest.mark.parametrize(
    ("kept", "given"),
    [
        (212, (MIXED[1],)),  # the whole load arrived
        (192, (MIXED[1],)),  # pd failed at its first block: disk's range is still needed
        (64, ()),  # host's range was kept, disk's is beyond what vLLM kept: dropped
        (0, ()),  # host failed at its first block: vLLM computes the rest
        (128, (Contribution(1, 64, 64, False),)),  # cut at what vLLM kept
    ],
)
def test_resume_gives_the_deferred_part_below_what_vllm_kept(kept: int, given: tuple[Contribution, ...]) -> None:
    assert FirstWins().resume((MIXED[1],), kept) == given


# ------------------------------------------------------------------ ranges

RANGE_CHILDREN = """
version: 1
connectors:
  - {name: host, type: record-range}
  - {name: plain, type: record}
  - {name: pd, type: record-range}
"""
BLOCK = 16


def ranges(children: str = RANGE_CHILDREN, block_size: int = BLOCK) -> tuple[Ranges, tuple[Child, ...]]:
    plan = loads(children + "rules: {load: ranges}\n")
    assert isinstance(plan.load, Ranges)
    plan.load.bind(EngineFacts(block_size))
    return plan.load, plan.children


def chain(*parts: tuple[int, int, int]) -> Selection:
    contribs = tuple(Contribution(c, start, n, True) for c, start, n in parts)
    return Selection(sum(n for _, _, n in parts), True, contribs)


def test_ranges_each_child_loads_after_the_one_above() -> None:
    rule, _ = ranges()
    sel, ask = select(rule, {0: (64, True), 1: (0, False), 2: (40, True)}, n=32)
    # host at the local prefix end (32); pd is asked beyond host's 64 tokens.
    assert ask.calls == [(0, 32), (2, 96)]
    assert sel == chain((0, 0, 64), (2, 64, 40))
    assert rule.allocate(sel, 104) == sel.contributions
    assert rule.awaited(sel.contributions) == (0, 2)


def test_ranges_skips_a_child_that_cannot_load_a_range_once_something_above_loaded() -> None:
    rule, _ = ranges()
    _, ask = select(rule, {0: (32, True), 1: (64, True), 2: (0, False)})
    assert ask.asked == [0, 2]  # plain is not offered a range that starts after host's


def test_ranges_offers_a_plain_child_the_local_prefix_end() -> None:
    rule, _ = ranges()
    sel, ask = select(rule, {0: (0, False), 1: (32, True), 2: (16, True)}, n=16)
    assert ask.calls == [(0, 16), (1, 16), (2, 48)]
    assert sel == chain((1, 0, 32), (2, 32, 16))


def test_ranges_ends_the_chain_after_a_range_that_ends_inside_a_block() -> None:
    rule, _ = ranges()
    sel, ask = select(rule, {0: (40, True), 1: (0, False), 2: (24, True)})
    assert ask.asked == [0]
    assert sel == chain((0, 0, 40))


def test_ranges_waits_for_a_child_that_is_not_ready() -> None:
    rule, _ = ranges()
    assert select(rule, {0: (None, False), 1: (0, False), 2: (64, True)})[0] is NOT_READY
    assert select(rule, {0: (32, True), 1: (0, False), 2: (None, False)})[0] is NOT_READY


def test_ranges_without_a_hit() -> None:
    rule, _ = ranges()
    assert select(rule, {0: (0, False), 1: (0, False), 2: (0, False)})[0] == NO_HIT


@pytest.mark.parametrize(
    ("modes", "is_async", "deferred"),
    [
        ((True, False), True, (Contribution(2, 32, 16, False),)),  # async host, sync rest
        ((False, True), True, (Contribution(0, 0, 32, False),)),  # sync prefix, async rest
        ((False, False), False, ()),  # all sync: one phase, as before
        ((True, True), True, ()),  # all async: one phase, as before
    ],
)
def test_ranges_chains_sync_and_async_contributors_and_defers_the_sync_ones(
    modes: tuple[bool, bool], is_async: bool, deferred: tuple[Contribution, ...]
) -> None:
    rule, _ = ranges()
    sel, ask = select(rule, {0: (32, modes[0]), 1: (0, False), 2: (16, modes[1])})
    assert ask.calls == [(0, 0), (2, 32)]
    assert sel.tokens == 48 and sel.is_async is is_async  # vLLM waits when any part is async
    assert sel.contributions == (Contribution(0, 0, 32, modes[0]), Contribution(2, 32, 16, modes[1]))
    allocated = rule.allocate(sel, 48)
    assert rule.deferred(allocated) == deferred
    assert rule.awaited(allocated) == tuple(c.child for c in allocated if c.is_async)


def test_ranges_vllm_allocating_fewer_tokens_cuts_the_last_ranges() -> None:
    rule, _ = ranges()
    sel, _ = select(rule, {0: (64, True), 1: (0, False), 2: (40, True)})
    assert rule.allocate(sel, 70) == (Contribution(0, 0, 64, True), Contribution(2, 64, 6, True))
    assert rule.allocate(sel, 0) == ()


def test_ranges_honours_a_coarser_alignment() -> None:
    class Coarse(RecordRangeType):
        range_alignment = 64

    children = loads(RANGE_CHILDREN).children
    coarse = tuple(Child(c.index, c.name, Coarse() if c.name == "pd" else c.type, c.role, c.options) for c in children)
    rule = Ranges(coarse)
    rule.bind(EngineFacts(BLOCK))
    sel, ask = select(rule, {0: (32, True), 1: (0, False), 2: (16, True)})
    assert ask.asked == [0] and sel == chain((0, 0, 32))  # pd could only start at 64
    sel, ask = select(rule, {0: (64, True), 1: (0, False), 2: (16, True)})
    assert sel == chain((0, 0, 64), (2, 64, 16))


@pytest.mark.parametrize(
    ("facts", "why"),
    [
        (EngineFacts(BLOCK, kv_cache_groups=2), "one KV cache group"),
        (EngineFacts(BLOCK, context_parallel=2), "context"),
    ],
)
def test_ranges_refuses_an_engine_it_would_load_wrong(facts: EngineFacts, why: str) -> None:
    rule = loads(RANGE_CHILDREN + "rules: {load: ranges}\n").load
    with pytest.raises(ValueError, match=why):
        rule.bind(facts)
    with pytest.raises(RuntimeError, match="not bound"):
        rule.select(Script({}), (), 0, None)


def test_ranges_explains_the_chain() -> None:
    rule = built_rules()["ranges"]
    assert rule.explain is not None
    text = rule.explain(loads(RANGE_CHILDREN).children, None)
    assert "host loads the prefix it holds" in text
    assert "plain loads only when nothing above it did" in text
    assert "pd loads what it holds of the rest" in text
