"""Allocation under a load rule (the steps in :mod:`kvcompose.vllm.loads`): the allocation at
``update_state_after_alloc``, a mixed load's deferred part, what vLLM kept of the load, the
blocks no other request may hit before the deferred part loads, and who loads a request.

No vLLM: a request is a namespace with the fields allocation reads (``Progress``).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvcompose.contract import Contribution, EngineFacts, LoadRule, Selection
from kvcompose.rules.load import FirstWins, Ranges
from kvcompose.vllm import loads as allocation
from kvcompose.vllm.loads import Allocation, DeferredPart

BS = 16
HOST = Contribution(0, 0, 32, True)  # async, [0, 32) beyond the local prefix
DISK = Contribution(1, 32, 48, False)  # sync, [32, 80)
PD = Contribution(2, 80, 16, True)  # async, [80, 96)
MIXED = Selection(96, True, (HOST, DISK, PD))
RULE: LoadRule = FirstWins()  # the LoadRule defaults: every built-in rule allocates with them


def request(computed: int = 0, tokens: int = 200, rid: str = "r") -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, num_computed_tokens=computed, num_tokens=tokens)


# ------------------------------------------------------------------ allocation


def test_one_async_child_is_given_everything_and_awaited() -> None:
    load = allocation.allocation(RULE, Selection(32, True, (HOST,)), 32)
    assert load == Allocation((HOST,), (0,), (HOST,), ())
    assert load.tokens() == {0: 32} and load.deferred_children() == ()


def test_a_sync_load_is_awaited_by_no_one_and_defers_nothing() -> None:
    load = allocation.allocation(RULE, Selection(48, False, (Contribution(1, 0, 48, False),)), 48)
    assert load is not None and load.awaited == () and load.deferred == ()
    assert load.tokens() == {1: 48}


def test_a_mixed_load_defers_its_sync_part_and_waits_for_the_async_ones() -> None:
    load = allocation.allocation(RULE, MIXED, 96)
    assert load is not None
    assert load.awaited == (0, 2)
    assert load.deferred == (DISK,) and load.deferred_children() == (1,)
    assert load.given == (HOST, PD) and load.tokens() == {0: 32, 2: 16}
    assert load.contributions == (HOST, DISK, PD)


def test_vllm_allocating_fewer_tokens_cuts_the_load_first() -> None:
    load = allocation.allocation(RULE, MIXED, 40)
    assert load is not None
    assert load.contributions == (HOST, Contribution(1, 32, 8, False))
    assert load.deferred == (Contribution(1, 32, 8, False),) and load.awaited == (0,)


def test_a_sync_part_of_a_load_cut_to_sync_only_is_not_deferred() -> None:
    sel = Selection(80, False, (Contribution(1, 0, 48, False), Contribution(2, 48, 32, True)))
    load = allocation.allocation(RULE, sel, 48)
    assert load is not None and load.awaited == () and load.deferred == ()


@pytest.mark.parametrize("tokens", [0, -1])
def test_nothing_allocated_is_no_load(tokens: int) -> None:
    assert allocation.allocation(RULE, MIXED, tokens) is None


# ------------------------------------------------------------------ the deferred part


def deferred(req: SimpleNamespace, local: int = 32) -> DeferredPart:
    load = allocation.allocation(RULE, MIXED, 96)
    assert load is not None
    return allocation.deferred_part(req, load, local, list(range(100, 120)), BS)


def test_defer_keeps_the_sync_ranges_blocks_and_the_loads_end() -> None:
    d = deferred(request())
    # local 32 + disk [32, 80) = tokens [64, 112): blocks 4, 5, 6 (the last one partly)
    assert d.block_ids == (104, 105, 106)
    assert d.contributions == (DISK,) and d.local == 32 and d.end == 128


def test_a_clean_load_keeps_every_token() -> None:
    d = deferred(request(computed=128))
    assert allocation.kept(d) == 96
    assert allocation.resume(RULE, d) == (DISK,)


def test_a_load_that_reaches_the_requests_end_keeps_its_last_token() -> None:
    """vLLM recomputes the last token of a load that covers the whole request."""
    d = deferred(request(computed=127, tokens=128))
    assert allocation.kept(d) == 96
    assert allocation.resume(RULE, d) == (DISK,)


def test_a_failed_async_child_cuts_the_deferred_part_to_what_vllm_kept() -> None:
    d = deferred(request(computed=32 + 48))  # vLLM recomputes from token 48 beyond the prefix
    assert allocation.kept(d) == 48
    assert allocation.resume(RULE, d) == (Contribution(1, 32, 16, False),)


def test_a_deferred_part_wholly_beyond_what_vllm_kept_is_dropped() -> None:
    d = deferred(request(computed=32 + 16))
    assert allocation.kept(d) == 16
    assert allocation.resume(RULE, d) == ()


def test_resume_is_the_rules_own() -> None:
    class GiveAll(FirstWins):
        def resume(self, deferred: tuple[Contribution, ...], kept: int) -> tuple[Contribution, ...]:
            return deferred

    assert allocation.resume(GiveAll(), deferred(request(computed=32))) == (DISK,)


# ------------------------------------------------------------------ blocks never loaded


def test_unloaded_blocks_are_those_of_arrived_loads_not_scheduled_since() -> None:
    parts = {"waits": deferred(request(computed=32)), "arrived": deferred(request(computed=128))}
    assert allocation.unloaded_blocks(parts, {"waits"}) == {104, 105, 106}
    assert set(parts) == {"waits", "arrived"}


def test_a_request_vllm_kept_nothing_of_drops_its_deferred_part() -> None:
    """vLLM looks it up again from scratch, and its blocks were freed."""
    req = request(computed=128)
    parts = {"r": deferred(req)}
    req.num_computed_tokens = 0
    assert allocation.unloaded_blocks(parts, set()) == set()
    assert parts == {}


def test_nothing_deferred_evicts_nothing() -> None:
    assert allocation.unloaded_blocks({}, {"r"}) == set()


# ------------------------------------------------------------------ who loads a request


def loads_of(selection: Selection | None, allocated: int | None = None) -> allocation.RequestLoads:
    """A request ``r``'s load state after its lookup chose ``selection`` and, when ``allocated``
    is given, vLLM allocated that many external tokens."""
    loads = allocation.RequestLoads(RULE, ("host", "disk", "pd"), EngineFacts(BS))
    if selection is not None:
        loads.selected("r", selection, 0)
    if allocated is not None:
        blocks = SimpleNamespace(get_block_ids=lambda: (list(range(100, 120)),))
        loads.after_alloc(request(), blocks, allocated)  # type: ignore[arg-type]
    return loads


def test_loaders_before_allocation_are_the_selection() -> None:
    assert loads_of(MIXED).contributions("r") == (HOST, DISK, PD)


def test_loaders_after_allocation_are_the_allocation() -> None:
    assert loads_of(MIXED, allocated=32).contributions("r") == (HOST,)


def test_loaders_of_a_number_of_tokens_rerun_the_rules_split() -> None:
    """vLLM asks where a hit comes from with the tokens it means to load, before it allocates."""
    assert loads_of(MIXED).contributions("r", 40) == (HOST, Contribution(1, 32, 8, False))
    assert loads_of(MIXED, allocated=96).contributions("r", 40) == (HOST, Contribution(1, 32, 8, False))


def test_no_loader_without_a_selection() -> None:
    assert loads_of(None).contributions("r") == ()
    assert loads_of(None).contributions("r", 32) == ()


def test_ranges_allocates_with_the_same_defaults() -> None:
    rule = Ranges(())
    assert allocation.allocation(rule, MIXED, 96) == allocation.allocation(RULE, MIXED, 96)


def test_only_the_loads_vllm_waits_for_arrive_each_once() -> None:
    """Another worker's duplicate or a late report after an abort would trip vLLM's
    ``assert req_id in self.requests``: it is withheld."""
    loads = loads_of(MIXED, allocated=96)  # the pd part is asynchronous: vLLM waits for the load
    assert loads.arrived({"r", "late"}) == {"r"}
    assert loads.arrived({"r"}) == set()


def test_a_load_that_finished_mid_load_is_kept_until_its_report() -> None:
    loads = loads_of(MIXED, allocated=96)
    loads.finished("r", ())
    assert loads.contributions("r") == ()
    assert loads.arrived({"r"}) == {"r"}  # vLLM frees the aborted request on this report
    assert "r" not in loads.requests
