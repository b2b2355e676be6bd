"""``faults: {use: breaker}`` in vLLM's real scheduler: a ``faulty`` child that fails for a while is
bypassed, probed after its cooldown, and re-enabled; its state reaches the Prometheus gauge."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Gauge
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import Counter, Histogram

from kvcompose.testing import inspector
from kvcompose.testing.connectors import FaultyConnector
from kvcompose.testing.harness import assert_scheduler_empty, make_request, step
from kvcompose.vllm.connector import KVComposeConnector
from kvcompose.vllm.health import STATS_KEY, ChildStatePromMetrics

#: The kit's fixtures are factories (kvcompose_scheduler, kvcompose_worker).
Factory = Callable[..., Any]

#: host answers its first lookup, raises in the next two, then answers again.
FLAKY = """
version: 1
connectors:
  - name: host
    type: faulty
    options:
      matched_tokens: 0
      faults: [{call: get_num_new_matched_tokens, action: raise, after: 1, times: 2}]
  - {name: other, type: record}
rules:
  faults: {use: breaker, children: [host], failures: 2, cooldown_s: 1, successes: 2}
"""


def step_keeping_states(sched: Any, states: list[dict[str, Any]]) -> None:
    """One engine step; keeps the breaker states the scheduler's stats carried to the front end."""
    _, eco = step(sched, eos=True)
    for outputs in eco.values():
        stats = outputs.scheduler_stats.kv_connector_stats if outputs.scheduler_stats else None
        if stats and STATS_KEY in stats:
            states.append(stats[STATS_KEY]["data"]["states"])


def finish(sched: Any, request_id: str, states: list[dict[str, Any]]) -> None:
    """Steps until the request is done."""
    for _ in range(3):
        if request_id not in sched.requests:
            return
        step_keeping_states(sched, states)
    raise AssertionError(f"{request_id} did not finish")


def test_a_child_failing_for_a_while_is_bypassed_probed_and_re_enabled(kvcompose_scheduler: Factory) -> None:
    sched = kvcompose_scheduler(FLAKY)
    conn: KVComposeConnector = sched.connector
    host = inspector.child(conn, "host")
    assert isinstance(host, FaultyConnector)
    states: list[dict[str, Any]] = []

    def lookups() -> int:
        return len(host.called("get_num_new_matched_tokens"))

    for n in range(3):  # healthy, then one failure (contained), then the second: open
        req = make_request(64, request_id=f"r{n}")
        sched.add_request(req)
        finish(sched, req.request_id, states)
    assert [f[1] for f in host.fired] == ["raise", "raise"]
    assert states[0] == {"scheduler": {"host": "open"}}

    # While open: host is not asked, the other child is; requests go on, computed locally.
    if inspector.child_state(conn, "host") == "open":  # on a slow machine the cooldown may be over already
        asked = lookups()
        req = make_request(64, request_id="while-open")
        sched.add_request(req)
        finish(sched, req.request_id, states)
        if inspector.child_state(conn, "host") == "open":  # still: it was not let back during those steps
            assert lookups() == asked
        assert inspector.child(conn, "other").called("get_num_new_matched_tokens")[-1][0] == "while-open"

    deadline = time.monotonic() + 30  # a hang guard, not a timing assertion
    while inspector.child_state(conn, "host") != "closed":
        assert time.monotonic() < deadline, inspector.child_state(conn, "host")
        time.sleep(0.05)
        step_keeping_states(sched, states)  # build_connector_meta: the probe, then clean steps
    assert [s["scheduler"]["host"] for s in states] == ["open", "half-open", "closed"]

    # Re-enabled: host is asked again (and, its fault spent, answers).
    asked = lookups()
    req = make_request(64, request_id="after")
    sched.add_request(req)
    finish(sched, req.request_id, states)
    assert lookups() == asked + 1
    assert len(host.fired) == 2
    assert_scheduler_empty(sched)


def test_the_gauge_is_the_worst_state_over_scheduler_and_workers(kvcompose_scheduler: Factory) -> None:
    sched = kvcompose_scheduler(FLAKY)
    registry = CollectorRegistry()
    types = {Counter: Counter, Gauge: functools.partial(Gauge, registry=registry), Histogram: Histogram}
    gauge = ChildStatePromMetrics(sched.vllm_config, types, ["model_name", "engine"], {0: ["m", "0"]})  # type: ignore[arg-type]

    def value() -> float | None:
        return registry.get_sample_value(
            "vllm:kvcompose_breaker_state", {"model_name": "m", "engine": "0", "child": "host"}
        )

    gauge.observe({"states": {"scheduler": {"host": "open"}}})
    assert value() == 2
    gauge.observe({"states": {"worker0": {"host": "half-open"}}})
    assert value() == 2  # still open on the scheduler
    gauge.observe({"states": {"scheduler": {"host": "closed"}}})
    assert value() == 1
    gauge.observe({"states": {"worker0": {"host": "closed"}}})
    assert value() == 0


def test_breaker_states_survive_the_trip_to_the_front_end(kvcompose_scheduler: Factory) -> None:
    sched = kvcompose_scheduler(FLAKY.replace("after: 1, times: 2", "times: 2"))
    conn: KVComposeConnector = sched.connector
    for n in range(2):
        conn.get_num_new_matched_tokens(make_request(64, request_id=f"r{n}"), 0)
    stats = conn.get_kv_connector_stats()
    assert stats is not None
    rebuilt = KVComposeConnector.build_kv_connector_stats(stats.to_dict())
    assert rebuilt is not None
    assert rebuilt.data[STATS_KEY].data == {"states": {"scheduler": {"host": "open"}}}
    assert rebuilt.reduce()[f"{STATS_KEY}.host.breaker@scheduler"] == 2
