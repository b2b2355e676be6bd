"""The generic ``vllm`` type keeps vLLM's connector contract, on two connectors vLLM ships that run
on CPU: ExampleConnector (KV in safetensors files) and DecodeBenchConnector (fills the KV cache
with dummy values). This is how a user tests a connector of their own: name it in the options."""

import tempfile
from collections.abc import Callable

import pytest
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from kvcompose.testing.conformance import (
    CONTRACTS,
    ContractViolation,
    Subject,
    composition,
    conformance,
    lookup_is_side_effect_free,
    nothing_matches_is_zero,
)
from kvcompose.testing.harness import decode_request, make_request, scheduler_from_yaml
from kvcompose.testing.worker import WorkerHarness

EXAMPLE = {
    "kv_connector": "ExampleConnector",
    "kv_connector_extra_config": {"shared_storage_path": tempfile.mkdtemp(prefix="kvcompose-example-")},
}
DECODE_BENCH = {"kv_connector": "DecodeBenchConnector"}

test_example_connector = conformance("vllm", EXAMPLE)

#: DecodeBenchConnector claims every prompt token but the last (it stands in for a prefill
#: instance, filling the blocks with dummy KV), so "nothing matches" cannot hold for it.
test_decode_bench_connector = conformance(
    "vllm", DECODE_BENCH, contracts=tuple(c for c in CONTRACTS if c.id != "nothing-matches-is-zero")
)


def test_the_kit_reports_decode_bench_claiming_a_prompt_no_tier_holds() -> None:
    subject = Subject("vllm", scheduler_from_yaml(composition("vllm", DECODE_BENCH)))
    with pytest.raises(ContractViolation, match=r"nothing-matches-is-zero.*\n.*\n.*\n  got:      \(63, False\)"):
        nothing_matches_is_zero(subject)


def test_the_kit_reports_a_hit_pinned_by_an_abandoned_lookup() -> None:
    """A lookup that pins its hit until an allocation that never comes (the request aborted)
    answers the same each time, yet takes the hit from every later request."""
    pinning = {
        **EXAMPLE,
        "kv_connector": "PinningExampleConnector",
        "kv_connector_module_path": "tests.kit.pinning_connector",
    }
    with WorkerHarness.from_yaml(composition("vllm", pinning), block_size=32, num_blocks=64) as worker:
        subject = Subject("vllm", worker.scheduler, worker, block_size=32)
        with pytest.raises(ContractViolation, match=r"after an abandoned lookup\n  expected: the hit still there"):
            lookup_is_side_effect_free(subject)


COMPOSED_WITH_NIXL = f"""
version: 1
connectors:
  - name: disk
    type: vllm
    options:
      kv_connector: ExampleConnector
      kv_connector_extra_config: {{shared_storage_path: {EXAMPLE["kv_connector_extra_config"]["shared_storage_path"]}}}
  - name: pd
    type: nixl
    role: consumer
"""


def test_example_connector_composed_with_nixl(kvcompose_scheduler: Callable[..., Scheduler]) -> None:
    """The docs' example (docs/testing.md): a vLLM connector of one's choice first, NIXL second."""
    sched = kvcompose_scheduler(COMPOSED_WITH_NIXL, block_size=32)
    pulled = decode_request(96, block_size=32)  # with the params a prefill instance returned
    local = make_request(96, block_size=32)
    sched.add_request(pulled)
    sched.add_request(local)
    out = sched.schedule()
    # disk holds neither prompt; pd pulls the first asynchronously, the second is computed here
    assert pulled.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert out.num_scheduled_tokens == {local.request_id: 96}
    assert [type(c).__name__ for c in sched.connector.sub_connectors] == ["ExampleConnector", "NixlConnector"]
