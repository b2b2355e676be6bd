"""The soak harness (``kvcompose soak``): real engines behind vLLM's router under load while the
prefill and decode servers are killed and restarted, clients hang up and a child raises.

``plan`` draws a run from its seed, ``stack`` starts and replaces the servers, ``drive`` sends
the load and fires the faults, ``report`` holds the checks and the printed report, ``run`` ties
them together.
"""
