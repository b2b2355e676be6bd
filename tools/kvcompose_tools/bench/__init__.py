"""``kvcompose bench``: every figure a ratio against a baseline run side by side in the same process.

One module per benchmark (``scheduler_step``, ``worker_hooks``, ``dispatch``, ``cpu_copy``,
``nixl_read``, ``pd_ttft``, ``pd_ranges``, ``cold_start``); ``measure`` interleaves repeats,
``report`` prints tables and writes JSON, ``plot`` draws PNGs, ``runner`` ties them to the CLI.
"""
