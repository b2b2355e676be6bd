"""The rule in vLLM's real scheduler (the kvcompose test kit's ``kvcompose_scheduler`` fixture)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler

from kvcompose.testing import inspector
from kvcompose.testing.harness import make_request

# Both children have a hit for every request: only the rule decides who loads.
YAML = """\
version: 1
connectors:
  - {name: pd, type: record, options: {matched_tokens: 32}}
  - {name: host, type: record, options: {matched_tokens: 32}}
rules:
  load: {use: prefer, child: host, key: prefer_host}
"""


def loaders_of(sched: Scheduler, kv_transfer_params: dict[str, Any] | None) -> tuple[str, ...]:
    # A prompt of its own: a prefix another request left in vLLM's cache would be computed locally.
    req = make_request(prompt=[100 + len(sched.requests), *range(3, 66)], kv_transfer_params=kv_transfer_params)
    sched.add_request(req)
    sched.schedule()
    return inspector.loaders(sched.connector, req.request_id)


def test_the_preferred_child_loads_requests_carrying_the_key(kvcompose_scheduler: Callable[..., Scheduler]) -> None:
    sched = kvcompose_scheduler(YAML)
    assert loaders_of(sched, {"prefer_host": True}) == ("host",)
    assert loaders_of(sched, None) == ("pd",)
    assert loaders_of(sched, {"something_else": 1}) == ("pd",)


def test_the_child_after_the_winner_is_not_asked(kvcompose_scheduler: Callable[..., Scheduler]) -> None:
    sched = kvcompose_scheduler(YAML)
    loaders_of(sched, {"prefer_host": True})
    assert not inspector.child(sched.connector, "pd").called("get_num_new_matched_tokens")
