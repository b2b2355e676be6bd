"""Engine metrics as flat ``name{labels}`` keys, from an offline engine or an API server's ``/metrics``."""

from __future__ import annotations

from typing import Any


def flatten_metrics(metrics: list[Any]) -> dict[str, float]:
    """``name{labels}`` -> value for counters and gauges; histograms as ``name_sum``/``name_count``.

    The ``engine`` and ``model_name`` labels are dropped; the HTTP variant parses ``/metrics``
    into the same keys.
    """
    out: dict[str, float] = {}
    for m in metrics:
        if hasattr(m, "sum") and hasattr(m, "count"):
            out[metric_key(m.name + "_sum", m.labels)] = float(m.sum)
            out[metric_key(m.name + "_count", m.labels)] = float(m.count)
        elif isinstance(getattr(m, "value", None), (int, float)):
            out[metric_key(m.name, m.labels)] = float(m.value)
    return out


def metric_key(name: str, labels: dict[str, str]) -> str:
    """``name{k=v,...}`` with sorted labels, less the per-instance ``engine``/``model_name``."""
    kept = ",".join(f"{k}={v}" for k, v in sorted(labels.items()) if k not in ("engine", "model_name"))
    return f"{name}{{{kept}}}" if kept else name


def parse_metrics(text: str, prefix: str = "vllm:") -> dict[str, float]:
    """Prometheus text from ``/metrics`` -> the keys ``flatten_metrics`` gives offline: counters
    without ``_total``, gauges, histograms and summaries as ``_sum``/``_count``; the metrics whose
    name starts with ``prefix`` only (vLLM's; ``vllm_router_`` for the router's)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        # The text parser files a counter's or histogram's ``_created`` timestamp apart, as a
        # metric of its own; get_metrics() drops them.
        if not fam.name.startswith(prefix) or fam.name.endswith("_created"):
            continue
        for s in fam.samples:
            if fam.type == "counter" and s.name == fam.name + "_total":
                name = fam.name
            elif fam.type == "gauge" and s.name == fam.name:
                name = fam.name
            elif fam.type in ("histogram", "summary") and s.name in (fam.name + "_sum", fam.name + "_count"):
                name = s.name
            else:  # histogram buckets, summary quantiles
                continue
            out[metric_key(name, s.labels)] = float(s.value)
    return out
