"""NIXL agent settings vLLM has no option for, applied in the process that creates the agent.

vLLM's NIXL worker builds its agent with ``nixl_agent(name, nixl_agent_config(...))`` and no
way to pass more (``base_worker.py``). Two settings matter on the hosts kvcompose is tested on,
so the connector applies them in ``__init__``, before vLLM's worker creates its agent. Both are
process-wide patches of NIXL's Python wrapper: vLLM's CPU worker is a spawned process, so a
patch in the parent would not reach it.

- **Progress-thread delay** (``progress_delay_us``). ``nixl._api.nixl_agent`` hard-codes
  ``pthrDelay = 0``, so each agent's progress thread polls without sleeping and starves the
  engines sharing its host's cores; a non-zero delay keeps the thread but lets it sleep between
  polls (docs/e2e.md, "Settings that matter on CPU-only hosts").
- **UCX error handling** (``ucx_error_handling``). NIXL creates UCX endpoints in UCX's ``peer``
  error-handling mode. Shared-memory transports cannot report a dead peer, so in that mode
  UCX carries NIXL's messages (wire-up, the READ's completion notification) over tcp even
  between two engines on one host, and that wire-up completes only when the idle prefill
  engine next steps (its lease expiry or its next request), which stalls every new pair's first
  request (docs/e2e.md, "Cold start: the first P/D request of a new pair"). ``none`` lets UCX use
  shared memory for the messages (CMA still moves the data) and the stall is gone; a dead
  peer then shows as failed reads and vLLM's lease and heartbeat handling, not as a UCX
  endpoint error.

:func:`connection_metadata` is the agent's address for a peer that only sends it notifications
(the lease answers of :mod:`kvcompose_nixl.lease`).
"""

from __future__ import annotations

import inspect
from typing import Any, Literal

#: NIXL UCX backend parameter (``nixl_ucx_err_handling_param_name`` in NIXL's UCX plugin).
UCX_ERROR_HANDLING_PARAM = "ucx_error_handling_mode"
UcxErrorHandling = Literal["peer", "none"]


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


def set_ucx_error_handling(mode: UcxErrorHandling | None) -> bool:
    """Create the UCX backend of NIXL agents made from now on in this process with ``mode``.

    ``None`` restores NIXL's own ``create_backend`` (UCX's ``peer``). Returns False when NIXL is
    not installed.
    """
    try:
        import nixl._api as api
    except ImportError:
        return False
    agent = api.nixl_agent
    base = getattr(agent.create_backend, "_kvcompose_base", agent.create_backend)
    if mode is None:
        agent.create_backend = base
        return True

    def create_backend(self: Any, backend: str, initParams: dict[str, str] | None = None) -> Any:  # noqa: N803
        params = dict(initParams or {})
        if backend == "UCX":
            params.setdefault(UCX_ERROR_HANDLING_PARAM, mode)
        return base(self, backend, params)

    create_backend._kvcompose_base = base  # type: ignore[attr-defined]
    agent.create_backend = create_backend
    return True


def missing_settings() -> list[str]:
    """What the settings above need from the installed NIXL and it lacks, each in words (empty:
    everything is there, or NIXL is not installed). The supported NIXL releases
    (``kvcompose.versions.NIXL``) have them all; a NIXL outside that range may not.

    Creates one agent without backends, to read the UCX plugin's parameters.
    """
    try:
        import nixl._api as api
    except ImportError:
        return []
    missing = []
    config = getattr(getattr(api, "nixlBind", None), "nixlAgentConfig", None)
    delay = inspect.getattr_static(config, "pthrDelay", None) if config is not None else None
    if not (isinstance(delay, property) or hasattr(delay, "__set__")):
        missing.append("progress_delay_us: nixl._api.nixlBind.nixlAgentConfig has no settable pthrDelay")
    agent_cls = getattr(api, "nixl_agent", None)
    create = getattr(agent_cls, "create_backend", None)
    if create is None or not {"backend", "initParams"} <= set(inspect.signature(create).parameters):
        missing.append("ucx_error_handling: nixl._api.nixl_agent has no create_backend(backend, initParams)")
    elif UCX_ERROR_HANDLING_PARAM not in _ucx_params(api):
        missing.append(f"ucx_error_handling: NIXL's UCX plugin takes no {UCX_ERROR_HANDLING_PARAM!r} parameter")
    return missing


def _ucx_params(api: Any) -> dict[str, str]:
    agent = api.nixl_agent("kvcompose-settings-check", api.nixl_agent_config(backends=[]))
    if "UCX" not in agent.get_plugin_list():
        return {}
    return dict(agent.get_plugin_params("UCX"))


def connection_metadata(agent: Any) -> bytes:
    """``agent``'s connection info without its memory (NIXL's partial metadata): what a peer
    loads to send it notifications, a few hundred bytes where the whole metadata of a decode
    instance's KV is kilobytes."""
    import nixl._api as api
    import numpy as np

    no_memory = api.nixlBind.nixlRegDList(agent.nixl_mems["DRAM"], np.zeros((0, 3), dtype=np.uint64))
    return agent.get_partial_agent_metadata(no_memory, True, [])  # type: ignore[no-any-return]
