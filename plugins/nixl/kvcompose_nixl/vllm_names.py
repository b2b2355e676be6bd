"""Every private name of vLLM's NIXL classes that this plugin reads or replaces, checked at start.

The nixl type subclasses vLLM's connectors and keeps vLLM's halves (``connector_scheduler``,
``connector_worker``); where vLLM has no hook, it reads or replaces a private attribute of those
halves on the instance (the class stays vLLM's). A vLLM that renamed one would otherwise fail
later, in a request, or silently skip a check. :func:`check` runs when the connector is built
and names every missing one, with what it is for. The same list, as a table, is in
docs/versions.md ("vLLM's private names the nixl type uses"); a test keeps the two equal.

NIXL's own names (the agent config's progress-thread sleep, the UCX plugin's parameters,
``nixlBind.nixlRegDList``) are checked where they are used, by :mod:`kvcompose_nixl.agent`
(``kvcompose check`` reports them).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: The scheduler half, pull and push: the side channel it serves.
SCHEDULER: Mapping[str, str] = {
    "_nixl_handshake_listener": "replaced by the guarded listener (side_channel.listener)",
    "side_channel_host": "set from side_channel_host (connector.apply_side_channel)",
    "side_channel_port": "set from side_channel_port (connector.apply_side_channel)",
}
#: The pull scheduler half: leases, unserved prefills and the prompt's count.
PULL_SCHEDULER: Mapping[str, str] = {
    "_reqs_need_send": "a finished request's lease end, stamped in its params (lease.stamp)",
    "_stop_heartbeat": "no heartbeats for a remote prefill with no blocks (NixlConnector.on_new_request)",
    "_get_remote_prefill_token_count": "the tokens the decode counts as loaded, checked against the params",
}
#: The worker half, pull and push: handshakes and agent metadata.
WORKER: Mapping[str, str] = {
    "nixl_wrapper": "the NIXL agent: its metadata sealed and opened (side_channel.seal_agent_metadata)",
    "_nixl_handshake": "wrapped: the peers check and the retries (handshake.ask_patiently)",
    "_handshake_initiation_executor": "replaced: waits for a slow side channel off vLLM's thread",
}
#: The pull worker half: the lease protocol and the read answers (lease.watch_leases).
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
#: The push worker half: the prefill writes only on a matching digest (push.PushGuard).
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
