"""The ``nixl`` type keeps vLLM's connector contract (the kit's conformance suite)."""

from kvcompose.testing.conformance import conformance

test_nixl_consumer = conformance("nixl", role="consumer")
test_nixl_producer = conformance("nixl", role="producer")
