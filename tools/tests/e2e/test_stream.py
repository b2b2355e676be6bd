"""The kit's HTTP client's parts that need no server (its requests: tools/tests/soak/test_soak_harness.py,
tools/tests/bench/test_bench_load_failure.py, tools/tests/bench/test_bench_serve.py)."""

from __future__ import annotations

import pytest

from kvcompose_tools.e2e.stream import address


def test_a_servers_url_is_its_address() -> None:
    assert address("http://127.0.0.1:8000") == ("127.0.0.1", 8000)
    assert address("http://10.0.0.2:9100/") == ("10.0.0.2", 9100)


@pytest.mark.parametrize("url", ["http://127.0.0.1", "127.0.0.1:8000", ""])
def test_a_url_without_host_or_port_is_refused_by_name(url: str) -> None:
    with pytest.raises(ValueError, match="expected http://host:port"):
        address(url)
