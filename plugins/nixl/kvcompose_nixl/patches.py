"""Every patch of a vLLM or NIXL name this plugin makes, in one module, beside the check that
each name exists.

Where vLLM has no hook, the nixl type reads or replaces a private attribute of vLLM's NIXL halves
(``connector_scheduler``, ``connector_worker``) on the instance (the classes stay vLLM's); where
NIXL's Python wrapper has no option, it patches the wrapper process-wide. Every such assignment
is here, so one module says all the plugin changes in vLLM and NIXL; the protocol modules
(:mod:`~kvcompose_nixl.side_channel`, :mod:`~kvcompose_nixl.handshake`,
:mod:`~kvcompose_nixl.lease`, :mod:`~kvcompose_nixl.push`) build the wrappers and assign none of
them, and none imports this module (the connector does). Why each is patched, in a line:

- :func:`patch_scheduler`: vLLM reads the side channel's host and port only from the
  environment, and its listener thread dies on one malformed frame (vLLM #54757);
- :func:`seal_agent_metadata`: the agent metadata a side channel answers with lets anyone read
  this engine's memory, so with a key it is sealed, and a peer's must open;
- :func:`ask_patiently`: vLLM asks a side channel once, for 5 s, on its one handshake thread, and
  to any address a request names;
- :func:`watch_leases` (pull): vLLM's decode uses a read that ended after the prefill released
  its blocks, and parses the agent's notifications unguarded;
- :func:`guard_pushes` (push): vLLM's prefill writes into a decode's blocks whatever prompt the
  decode registered under the same request id;
- :func:`calm_progress_thread`: NIXL's agent hard-codes a progress thread that never sleeps;
- :func:`set_ucx_error_handling`: NIXL creates UCX endpoints in ``peer`` mode, which stalls a new
  pair's first request on one host.

**vLLM's names.** A vLLM that renamed one would otherwise fail later, in a request, or silently
skip a check. :func:`check` runs when the connector is built and names every missing one, with
what it is for. The same list, as a table, is in docs/versions.md ("vLLM's private names the
nixl type uses"); a test keeps the two equal.

**NIXL's names** (``nixlBind.nixlAgentConfig.pthrDelay``, ``nixl_agent.create_backend``, the UCX
plugin's ``ucx_error_handling_mode`` parameter): :func:`missing_settings` names those the
installed NIXL lacks (a test runs it against the installed NIXL), and the two setters raise
:class:`MissingName` at start for a NIXL without the name they patch. vLLM builds its agent with
``nixl_agent(name, nixl_agent_config(...))`` and no way to pass more (``base_worker.py``), so the
connector applies both settings in ``__init__``, before vLLM's worker creates its agent. Both are
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
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal

from kvcompose_nixl import SIDE_CHANNEL_HOST_KEY, SIDE_CHANNEL_PORT_KEY
from kvcompose_nixl.handshake import WaitingExecutor, ask_side_channel, only_peers, patient
from kvcompose_nixl.lease import LeaseWatch, lease_halves, notification_filter
from kvcompose_nixl.push import PushGuard
from kvcompose_nixl.side_channel import checked_load, listener, sealing_publish
from kvcompose_nixl.trust import Keyring

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler import (
        NixlBaseConnectorScheduler,
    )

#: The scheduler half, pull and push: the side channel it serves.
SCHEDULER: Mapping[str, str] = {
    "_nixl_handshake_listener": "replaced by the guarded listener (side_channel.listener, patch_scheduler)",
    "side_channel_host": "set from side_channel_host (patch_scheduler)",
    "side_channel_port": "set from side_channel_port (patch_scheduler)",
}
#: The pull scheduler half: leases, unserved prefills and the prompt's count.
PULL_SCHEDULER: Mapping[str, str] = {
    "_reqs_need_send": "a finished request's lease end, stamped in its params (lease.stamp)",
    "_stop_heartbeat": "no heartbeats for a remote prefill with no blocks (NixlConnector.on_new_request)",
    "_get_remote_prefill_token_count": "the tokens the decode counts as loaded, checked against the params",
}
#: The worker half, pull and push: handshakes and agent metadata.
WORKER: Mapping[str, str] = {
    "nixl_wrapper": "the NIXL agent: its metadata sealed and opened (seal_agent_metadata)",
    "_nixl_handshake": "wrapped: the peers check and the retries (ask_patiently)",
    "_handshake_initiation_executor": "replaced: waits for a slow side channel off vLLM's thread",
}
#: The pull worker half: the lease protocol and the read answers (watch_leases).
PULL_WORKER: Mapping[str, str] = {
    "start_load_kv": "wrapped: records each read's lease, greets the prefill's agents",
    "_send_heartbeats": "wrapped: asks the prefill how long the beaten leases run",
    "_pop_done_transfers": "wrapped: fails late or unheld reads, holds reads until answered",
    "_get_new_notifs": "wrapped: the prefill answers questions and reads after vLLM's count",
    "_send_pending_recv_notifs": "a held read's deferred notifications sent at once",
    "_reqs_to_send": "the leases the prefill holds (answers; whether a read found its blocks held)",
    "_reqs_to_process": "requests whose blocks the prefill holds before their lease is set",
    "consumer_notification_counts_by_req": "vLLM's count of a request's read notifications",
    "_remote_agents": "the prefill engine's agents a read came from",
    "_engine_clock_offset": "the prefill's clock, for a stamped lease end",
    "_recving_metadata": "reads vLLM dropped (aborts), forgotten",
    "xfer_stats.record_kv_expired_req": "a late read counted as vLLM counts an expired one",
}

#: The push scheduler half: the prompt binding's digests (kvcompose_nixl.push).
PUSH_SCHEDULER: Mapping[str, str] = {
    "_push_pending_registrations": "the decode's registration, stamped with its prompt's digest",
    "_newly_finished_push_blocks": "the prefill's finished requests, whose computed tokens' digests go to its workers",
    "_get_remote_prefill_token_count": "the tokens the decode counts as loaded, whose digest it registers",
}
#: The push worker half: the prefill writes only on a matching digest (guard_pushes).
PUSH_WORKER: Mapping[str, str] = {
    "start_load_kv": "wrapped: takes the step's digests of what the prefill computed",
    "get_transfer_results": "wrapped: forgets the digests of requests written or expired",
    "_do_start_push_kv": "wrapped: writes only when the decode's digest is the computed one",
    "_ensure_handshake": "the handshake to a refused decode (vLLM's own, as for the write)",
    "_deferred_push_inbox": "a refusal re-driven once that handshake is done",
    "_push_writer_wake": "wakes the push writer for it",
    "_handshake_lock": "guards _remote_agents, as vLLM reads it",
    "_remote_agents": "the decode agents told of a refusal; the prefill agents a refusal may come from",
    "_push_finished_blocks": "a refused request's blocks, kept for a registration that matches",
    "_pop_matching_registration": "another registration for the same request, checked in turn",
    "_recving_metadata": "the decode's waiting loads, which a refusal names",
    "_failed_recv_reqs": "a refused push fails the decode's load (recomputed, or failed under fail)",
}


class MissingName(RuntimeError):
    """A private name of vLLM's NIXL classes that this plugin needs is missing."""


def _has(obj: Any, dotted: str) -> bool:
    for part in dotted.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def check(obj: Any, *tables: Mapping[str, str]) -> None:
    """Raise :class:`MissingName` naming each name of ``tables`` that ``obj`` (a vLLM NIXL
    scheduler or worker half) lacks, and what it is for."""
    missing = [f"{name} ({why})" for table in tables for name, why in table.items() if not _has(obj, name)]
    if missing:
        import vllm

        raise MissingName(
            f"the nixl type needs these names of vLLM's {type(obj).__name__}, which vLLM {vllm.__version__} "
            f"lacks: {'; '.join(missing)}. docs/versions.md lists the vLLM versions this plugin runs on"
        )


def every_name() -> set[str]:
    """Every name the tables hold (for the docs' table and its test)."""
    return {
        name
        for table in (SCHEDULER, PULL_SCHEDULER, PUSH_SCHEDULER, WORKER, PULL_WORKER, PUSH_WORKER)
        for name in table
    }


# ---- vLLM's halves, on the instance


def patch_scheduler(scheduler: NixlBaseConnectorScheduler, vllm_config: VllmConfig) -> None:
    """Point the scheduler's handshake listener at the configured host and port, and make it
    the listener no frame can stop (:func:`kvcompose_nixl.side_channel.listener`).

    Must run before the listener thread starts, which vLLM does later, in
    ``set_xfer_handshake_metadata``; the push scheduler also reads these attributes when it
    stages a registration for the prefill instance, and ``request_finished`` returns them to
    the router as ``remote_host`` / ``remote_port``.
    """
    ktc = vllm_config.kv_transfer_config
    assert ktc is not None
    host = ktc.get_from_extra_config(SIDE_CHANNEL_HOST_KEY, None)
    port = ktc.get_from_extra_config(SIDE_CHANNEL_PORT_KEY, None)
    if host is not None:
        scheduler.side_channel_host = str(host)
    if port is not None:
        # Same meaning as VLLM_NIXL_SIDE_CHANNEL_PORT: a base port, one listener per DP rank.
        scheduler.side_channel_port = int(port) + vllm_config.parallel_config.data_parallel_index
    # vLLM starts it as self._nixl_handshake_listener in set_xfer_handshake_metadata.
    scheduler._nixl_handshake_listener = listener


def seal_agent_metadata(wrapper: Any, keys: Keyring | None, accept_unsealed: bool) -> None:
    """On vLLM's NIXL worker's agent (``nixl_wrapper``): with ``keys``, the metadata it publishes
    is sealed (``get_agent_metadata``); every peer metadata it loads (``add_remote_agent``: a
    prefill's from the side channel, a decode's lease hello) must open with ``keys``, or be
    unsealed and ``accept_unsealed``. Without keys, sealed metadata is refused by name (NIXL
    would fail on it with a parse error)."""
    wrapper.get_agent_metadata = sealing_publish(wrapper.get_agent_metadata, keys)
    wrapper.add_remote_agent = checked_load(wrapper.add_remote_agent, keys, accept_unsealed)


def ask_patiently(worker: Any, tries: int, allowed: Callable[[str, int], bool] = lambda host, port: True) -> None:
    """Make vLLM's NIXL ``worker`` wait for a peer's side channel, up to ``tries`` requests, off
    its handshake thread (:class:`~kvcompose_nixl.handshake.WaitingExecutor`), then run vLLM's
    handshake there; neither connects to a side channel ``allowed`` refuses.

    vLLM submits ``self._nixl_handshake`` to ``self._handshake_initiation_executor`` by attribute
    at each new peer (``_ensure_handshake``), so both are replaced on the instance; the class
    stays vLLM's. The handshake itself keeps vLLM's one request, with the clearer error."""
    worker._nixl_handshake = only_peers(patient(worker._nixl_handshake, 1), allowed)
    worker._handshake_initiation_executor = WaitingExecutor(
        worker._handshake_initiation_executor, only_peers(patient(ask_side_channel, tries), allowed)
    )


def watch_leases(worker: Any, keys: Keyring | None = None, lease_s: float = 30.0) -> LeaseWatch:
    """Both halves on vLLM's pull-mode NIXL worker (its class stays vLLM's; a worker may serve and
    read), and the filter that hands them the protocol's notifications before vLLM reads its own.
    ``keys``: the deployment key, if any; ``lease_s``: the most seconds an answer may grant."""
    watch, desk = lease_halves(worker, keys, lease_s)
    worker.start_load_kv = watch.recording(worker.start_load_kv)
    worker._send_heartbeats = watch.asking(worker._send_heartbeats)
    worker._pop_done_transfers = watch.checking(worker._pop_done_transfers)
    worker._get_new_notifs = desk.answering(worker._get_new_notifs)
    worker.nixl_wrapper.get_new_notifs = notification_filter(worker.nixl_wrapper.get_new_notifs, watch, desk)
    return watch


def guard_pushes(worker: Any, keys: Keyring | None, accept_unsigned: bool) -> PushGuard:
    """:class:`~kvcompose_nixl.push.PushGuard` on vLLM's push-mode NIXL worker ``worker``: with
    ``keys`` and not ``accept_unsigned`` a registration without a digest is refused."""
    guard = PushGuard(worker, keys, keys is not None and not accept_unsigned)
    worker._do_start_push_kv = guard.checked_write
    worker.start_load_kv = guard.taking_digests(worker.start_load_kv)
    worker.get_transfer_results = guard.forgetting(worker.get_transfer_results)
    worker.nixl_wrapper.get_new_notifs = guard.filtering(worker.nixl_wrapper.get_new_notifs)
    return guard


# ---- NIXL's Python wrapper, process-wide

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
    if delay_us and not _settable_delay(base):  # else the subclass would take the option and do nothing
        raise MissingName(f"progress_delay_us: {_PTHR_DELAY_MISSING}")
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
    if mode is not None and not _takes_params(base):
        raise MissingName(f"ucx_error_handling: {_CREATE_BACKEND_MISSING}")
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
    if not _settable_delay(getattr(getattr(api, "nixlBind", None), "nixlAgentConfig", None)):
        missing.append(f"progress_delay_us: {_PTHR_DELAY_MISSING}")
    if not _takes_params(getattr(getattr(api, "nixl_agent", None), "create_backend", None)):
        missing.append(f"ucx_error_handling: {_CREATE_BACKEND_MISSING}")
    elif UCX_ERROR_HANDLING_PARAM not in _ucx_params(api):
        missing.append(f"ucx_error_handling: NIXL's UCX plugin takes no {UCX_ERROR_HANDLING_PARAM!r} parameter")
    return missing


_PTHR_DELAY_MISSING = "nixl._api.nixlBind.nixlAgentConfig has no settable pthrDelay"
_CREATE_BACKEND_MISSING = "nixl._api.nixl_agent has no create_backend(self, backend, initParams)"


def _settable_delay(config: Any) -> bool:
    delay = inspect.getattr_static(config, "pthrDelay", None) if config is not None else None
    return isinstance(delay, property) or hasattr(delay, "__set__")


def _takes_params(create_backend: Any) -> bool:
    """Whether ``create_backend`` takes (self, backend, params), as the patch calls it."""
    try:
        inspect.signature(create_backend).bind(None, "UCX", {})
    except (TypeError, ValueError):  # None, or another signature
        return False
    return True


def _ucx_params(api: Any) -> dict[str, str]:
    agent = api.nixl_agent("kvcompose-settings-check", api.nixl_agent_config(backends=[]))
    if "UCX" not in agent.get_plugin_list():
        return {}
    return dict(agent.get_plugin_params("UCX"))
