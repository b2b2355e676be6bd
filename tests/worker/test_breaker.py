"""``faults: {use: breaker}`` on the worker half: a ``faulty`` child failing for a while is bypassed and
re-enabled, and what it owed is settled once across open -> half-open -> closed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from kvcompose.testing import inspector
from kvcompose.testing.connectors import FaultyConnector
from kvcompose.testing.harness import assert_scheduler_empty, make_request
from kvcompose.vllm.connector import KVComposeConnector
from kvcompose.vllm.health import STATS_KEY
from kvcompose.vllm.loadstats import STATS_KEY as LOADS_KEY
from kvcompose.vllm.metadata import ComposedMetadata

#: The kit's fixtures are factories (kvcompose_scheduler, kvcompose_worker).
Factory = Callable[..., Any]

TWO = """
version: 1
connectors:
  - {{name: pd, type: record}}
  - name: host
    type: faulty
    options:
      matched_tokens: {tokens}
      is_async: true
      faults: {faults}
rules:
  faults: {{use: breaker, children: [host], failures: {failures}, cooldown_s: {cooldown}, successes: 2}}
"""


def withheld(conn: KVComposeConnector) -> int:
    """Reports withheld from vLLM since the last stats (vllm:kvcompose_withheld_reports)."""
    stats = conn.get_kv_connector_stats()
    return stats.data[LOADS_KEY].data["withheld"] if stats is not None and LOADS_KEY in stats.data else 0


def test_a_child_failing_for_a_while_in_a_worker_call_is_bypassed_and_re_enabled(kvcompose_worker: Factory) -> None:
    h = kvcompose_worker(
        TWO.format(
            tokens=0, faults="[{call: wait_for_save, action: raise, after: 1, times: 2}]", failures=2, cooldown=0
        )
    )
    conn: KVComposeConnector = h.connector
    host = inspector.child(conn, "host")
    assert isinstance(host, FaultyConnector)
    states: list[str] = []
    saves: list[int] = []
    for n in range(8):
        h.scheduler.add_request(make_request(32, request_id=f"r{n}"))
        _, eco = h.engine_step(eos=True)
        saves.append(len(host.called("wait_for_save")))
        for outputs in eco.values():
            stats = outputs.scheduler_stats.kv_connector_stats if outputs.scheduler_stats else None
            if stats and STATS_KEY in stats:
                states.append(stats[STATS_KEY]["data"]["states"]["worker0"]["host"])
    # healthy, two failures (the second opens it), then back at the next step (cooldown 0):
    # half-open, and closed after two steps without a failure; each change reported once.
    assert states == ["open", "half-open", "closed"]
    assert [f[:2] for f in host.fired] == [("wait_for_save", "raise")] * 2
    assert inspector.child_state(conn, "host") == "closed" and inspector.bypassed(conn) == ()
    assert saves[-1] > saves[2]  # called again once re-enabled
    h.drain()
    assert_scheduler_empty(h.scheduler)


def meta(loads: dict[str, tuple[int, ...]] | None = None) -> ComposedMetadata:
    return ComposedMetadata({"pd": None, "host": None}, loads_awaited=loads or {})


def test_loads_in_flight_when_it_opens_fail_once_and_a_late_report_is_dropped(kvcompose_worker: Factory) -> None:
    conn: KVComposeConnector = kvcompose_worker(
        TWO.format(tokens=0, faults="[{call: start_load_kv, action: raise, times: 1}]", failures=1, cooldown=0),
        register=False,
    ).connector
    host = inspector.child(conn, "host")
    conn.bind_connector_metadata(meta({"r1": (1,), "r2": (0, 1)}))
    conn.start_load_kv(None)  # type: ignore[arg-type]  # raises: open
    assert inspector.child_state(conn, "host") == "open"
    res = conn.get_transfer_results(set())
    assert res.finished_recving == {"r1"} == res.failed_recving  # r2 still waits for pd
    conn.clear_connector_metadata()

    conn.bind_connector_metadata(meta({"r3": (1,)}))  # cooldown over: half-open, host loads r3
    assert inspector.child_state(conn, "host") == "half-open"
    host.results = KVConnectorTransferResults(finished_recving={"r1", "r2", "r3"})  # r1, r2: late
    inspector.child(conn, "pd").results = KVConnectorTransferResults(finished_recving={"r2"})
    res = conn.get_transfer_results(set())
    assert res.finished_recving == {"r2", "r3"}
    assert res.failed_recving == {"r2"}  # host's part of r2 was abandoned when it opened
    assert withheld(conn) == 2  # host's late r1 and r2, never twice to vLLM
    conn.clear_connector_metadata()
    for _ in range(2):
        conn.bind_connector_metadata(meta())
        conn.clear_connector_metadata()
    assert inspector.child_state(conn, "host") == "closed"


def test_a_load_announced_while_it_is_open_fails_at_once(kvcompose_worker: Factory) -> None:
    conn: KVComposeConnector = kvcompose_worker(
        TWO.format(tokens=0, faults="[{call: wait_for_save, action: raise}]", failures=1, cooldown=3600),
        register=False,
    ).connector
    conn.bind_connector_metadata(meta())
    conn.wait_for_save()
    conn.clear_connector_metadata()
    assert inspector.bypassed(conn) == ("host",)
    conn.bind_connector_metadata(meta({"r9": (1,)}))  # the scheduler's half of host is healthy
    res = conn.get_transfer_results(set())
    assert res.finished_recving == {"r9"} == res.failed_recving  # not a wait forever


def test_a_scheduler_side_failure_after_the_load_was_chosen_fails_that_load(kvcompose_worker: Factory) -> None:
    h = kvcompose_worker(
        TWO.format(tokens=32, faults="[{call: update_state_after_alloc, action: raise}]", failures=3, cooldown=0),
        num_blocks=100,
    )
    req = make_request(64)
    h.scheduler.add_request(req)
    out, _ = h.engine_step()  # host was chosen, then failed to record the load
    meta = out.kv_connector_metadata
    assert isinstance(meta, ComposedMetadata)
    assert meta.loads_awaited == {req.request_id: (1,)} == meta.loads_abandoned
    kv_out = h.last_output
    assert kv_out.finished_recving == {req.request_id} == kv_out.failed_recving
    # vLLM's default kv_load_failure_policy ("fail") ends the request; nothing waits forever.
    assert req.request_id not in h.scheduler.requests
    assert_scheduler_empty(h.scheduler)


def test_a_bypassed_child_still_gets_shutdown(kvcompose_worker: Factory) -> None:
    faults = "[{call: wait_for_save, action: raise}, {call: shutdown, action: stall, seconds: 0}]"
    conn: KVComposeConnector = kvcompose_worker(
        TWO.format(tokens=0, faults=faults, failures=1, cooldown=3600), register=False
    ).connector
    conn.bind_connector_metadata(meta())
    conn.wait_for_save()
    assert inspector.bypassed(conn) == ("host",)
    conn.shutdown()
    host = inspector.child(conn, "host")
    assert isinstance(host, FaultyConnector)
    assert ("shutdown", "stall", None) in host.fired  # it ran: its threads and files are released


def test_delayed_frees_a_bypassed_child_owes_are_released_once(kvcompose_worker: Factory) -> None:
    conn: KVComposeConnector = kvcompose_worker(
        TWO.format(tokens=0, faults="[{call: wait_for_save, action: raise, times: 1}]", failures=1, cooldown=0),
        register=False,
    ).connector
    conn.bind_connector_metadata(ComposedMetadata({"pd": None, "host": None}, saves_owed={"s1": (1,), "s2": (0, 1)}))
    conn.wait_for_save()  # host raises: bypassed; it will not report its frees
    res = conn.get_transfer_results(set())
    assert res.finished_sending == {"s1"}  # owed by host alone: released at once
    conn.clear_connector_metadata()
    conn.bind_connector_metadata(meta())  # host back (half-open)
    inspector.child(conn, "pd").results = KVConnectorTransferResults(finished_sending={"s2"})
    inspector.child(conn, "host").results = KVConnectorTransferResults(finished_sending={"s1", "s2"})  # late
    res = conn.get_transfer_results(set())
    assert res.finished_sending == {"s2"}  # when pd, the last owner still called, reported it
    assert withheld(conn) == 2  # host's late s1 and s2: vLLM would assert on a second free
