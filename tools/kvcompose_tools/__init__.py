"""kvcompose's tools, a distribution of their own (``kvcompose-tools``): the ``demo``, ``bench``,
``soak`` and ``warmup`` commands of the ``kvcompose`` CLI (``commands``), the real-engine kit they
share (``e2e``), the benchmarks (``bench``) and the soak harness (``soak``)."""

__version__ = "0.1.0"

__all__ = ["__version__"]
