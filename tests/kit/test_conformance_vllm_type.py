"""The generic ``vllm`` type keeps vLLM's connector contract, on two connectors vLLM ships that run
on CPU: ExampleConnector (KV in safetensors files) and DecodeBenchConnector (fills the KV cache
with dummy values). This is how a user tests a connector of their own: name it in the options."""

import tempfile

import pytest

from kvcompose.testing.conformance import (
    CONTRACTS,
    ContractViolation,
    Subject,
    composition,
    conformance,
    nothing_matches_is_zero,
)
from kvcompose.testing.harness import scheduler_from_yaml

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
