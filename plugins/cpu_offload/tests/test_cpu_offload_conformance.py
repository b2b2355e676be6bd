"""The ``cpu-offload`` type keeps vLLM's connector contract (the kit's conformance suite)."""

from kvcompose.testing.conformance import conformance

test_cpu_offload = conformance("cpu-offload", {"cpu_bytes": "16MiB"})
