"""The one quantile the tools report (TTFT p50/p90/p99 in the e2e loads, the benchmarks and the soak)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (inclusive method: linear between the closest ranks); the
    one value, or 0 for none."""
    if len(values) < 2:
        return values[0] if values else 0.0
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]
