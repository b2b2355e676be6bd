"""Stop NIXL's progress thread from busy-spinning a core.

``nixl._api.nixl_agent`` hard-codes ``pthrDelay = 0`` in the agent config, so each agent's
progress thread polls without sleeping: one idle engine burns about a core, and two engines on
a 2-core machine starve the engines themselves (decode TTFT grew from about 0.1 s to 15-37 s
here). A non-zero delay keeps the thread but lets it sleep between polls; throughput measured
equal to running without a progress thread. The patch is process-wide and must be applied in
the process that creates the agent before it does: the connector applies it in ``__init__``
from the ``progress_delay_us`` option (vLLM's CPU worker is a spawned process, so a patch in
the parent would not reach it).
"""

from __future__ import annotations


def calm_progress_thread(delay_us: int) -> bool:
    """Make NIXL agents created from now on in this process sleep ``delay_us`` between polls.

    ``0`` restores NIXL's own (spinning) config. Returns False when NIXL is not installed.
    """
    try:
        import nixl._api as api
    except ImportError:
        return False
    base = getattr(api.nixlBind.nixlAgentConfig, "_kvcompose_base", api.nixlBind.nixlAgentConfig)
    if delay_us == 0:
        api.nixlBind.nixlAgentConfig = base
        return True

    class CalmAgentConfig(base):  # type: ignore[misc, valid-type]
        _kvcompose_base = base

        @property
        def pthrDelay(self) -> int:  # noqa: N802 (NIXL's name)
            return base.pthrDelay.__get__(self)

        @pthrDelay.setter
        def pthrDelay(self, _value: int) -> None:  # noqa: N802
            base.pthrDelay.__set__(self, delay_us)

    api.nixlBind.nixlAgentConfig = CalmAgentConfig
    return True
