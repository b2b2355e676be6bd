"""A decode instance never computes from KV it finished reading after the prefill's lease ended.

vLLM's prefill instance keeps a finished request's blocks for the decode instance's read until
a lease ends: ``kv_lease_duration`` (30 s) after the request finished, renewed by the decode's
heartbeats (sent every lease/6 while the request waits, each extending the lease to 2/3 of it
from the moment the prefill reads it). When the lease ends first, the prefill frees the blocks
(``Releasing expired KV blocks ...``) and may give them to another request; a read that ends
later (``Potentially invalid KV blocks ... were retrieved by a decode worker``) may have copied
that other request's KV, and vLLM's decode computes from it without a sign.

Both halves of the nixl child keep the lease in view:

* the prefill's scheduler (:func:`stamp`) adds the lease's end to the ``kv_transfer_params`` it
  returns, as vLLM's own ``remote_blocks_expiry_time`` (its scheduler's ``perf_counter``; vLLM
  fills that field only for a decode instance's blocks, for bidirectional transfers);
* the decode's worker (:class:`LeaseWatch`) turns that end into its own clock with the offset
  vLLM's handshake measured, and when a read finishes after the end it reports the read failed
  instead of done: vLLM marks the request's blocks invalid, the request recomputes them or fails
  under ``kv_load_failure_policy``, and vLLM's ``vllm:nixl_num_kv_expired_reqs`` counts it, as it
  counts a read vLLM itself declines as expired. The prefill instance is not notified (it released
  the blocks already).

The decode's heartbeats do not move that end. A heartbeat is a one-way NIXL notification that the
prefill answers with nothing: sent is not arrived. Across a cut link the beats wait in the
transport and reach the prefill after it reaped the lease, and no other traffic proves they
arrived (UCX over tcp carries notifications and reads on lanes of their own, whose connections
recover at different times after a cut). So a read that ends more than the lease after the
prefill finished is refused even when heartbeats did keep its blocks: it is recomputed or fails,
never computed from other KV. Decodes that queue requests that long need a longer
``lease_seconds`` on both sides (docs/e2e.md, "A cut path between the prefill and the decode host").

The estimate errs early: the prefill's worker starts its lease after its scheduler stamped it. A
prefill instance that does not stamp (not kvcompose's nixl type) leaves its reads unchecked.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("kvcompose.nixl")
#: Under vLLM's logger, whose INFO lines reach the server's log.
vllm_log = logging.getLogger("vllm.kvcompose.nixl")

#: vLLM's ``kv_transfer_params`` key for the end of a lease on the sender's blocks
#: (``nixl/metadata.py``: read into ``RemoteMeta.blocks_expiry_time``).
EXPIRY_KEY = "remote_blocks_expiry_time"
#: How the decode's log starts the line of a read it refused (the soak matches it with the
#: prefill's ``Potentially invalid KV blocks`` line for the same request).
REFUSED = "NIXL read refused:"
#: How the decode's log starts the line of a read vLLM did not make but notified the prefill of
#: (an abort before the read, a full local hit): a late notification of it freed nothing read.
RELEASED = "NIXL release without a read:"


def stamp(scheduler: Any, request_id: str, params: dict[str, Any] | None) -> None:
    """On the prefill instance: add the lease's end of ``request_id``'s blocks to the
    ``kv_transfer_params`` vLLM's ``request_finished`` returned for a decode instance."""
    if not params or not params.get("do_remote_prefill") or params.get(EXPIRY_KEY) is not None:
        return
    expires = scheduler._reqs_need_send.get(request_id)
    if expires is not None:
        params[EXPIRY_KEY] = expires


@dataclass
class _Lease:
    engine_id: str
    remote_request_id: str
    #: the lease's end in the prefill scheduler's clock
    expires: float


class LeaseWatch:
    """Wraps two methods of vLLM's pull-mode NIXL worker, on the instance (the class stays
    vLLM's): ``start_load_kv`` records each read's lease (and logs a release made without a read),
    ``_pop_done_transfers`` fails a read that ended after its lease."""

    def __init__(self, worker: Any) -> None:
        self._worker = worker
        self._leases: dict[str, _Lease] = {}
        #: Reads reported failed because they ended after their lease.
        self.late_reads = 0
        worker.start_load_kv = self._recording(worker.start_load_kv)
        worker._pop_done_transfers = self._checking(worker._pop_done_transfers)

    def deadline(self, request_id: str) -> float | None:
        """The end of ``request_id``'s lease in this process's ``perf_counter``; ``None`` when the
        prefill did not stamp it or no handshake measured the offset."""
        lease = self._leases.get(request_id)
        if lease is None:
            return None
        offset = self._worker._engine_clock_offset.get(lease.engine_id)
        return None if offset is None else lease.expires - offset

    def _recording(self, start_load_kv: Callable[[Any], None]) -> Callable[[Any], None]:
        def recorded(metadata: Any) -> None:
            for req_id, meta in metadata.reqs_to_recv.items():
                remote = meta.remote
                if remote is None:
                    continue
                if not any(meta.local_block_ids):  # only notifies the prefill: nothing read, nothing computed
                    vllm_log.info("%s %s (prefill request %s)", RELEASED, req_id, remote.request_id)
                elif remote.blocks_expiry_time is not None:
                    self._leases[req_id] = _Lease(remote.engine_id, remote.request_id, remote.blocks_expiry_time)
            start_load_kv(metadata)

        return recorded

    def _checking(
        self, pop_done: Callable[[dict[str, list[int]]], tuple[set[str], set[str]]]
    ) -> Callable[[dict[str, list[int]]], tuple[set[str], set[str]]]:
        def checked(transfers: dict[str, list[int]]) -> tuple[set[str], set[str]]:
            done, failed = pop_done(transfers)
            if not self._leases:
                return done, failed
            now = time.perf_counter()
            for req_id in list(done):
                end = self.deadline(req_id)
                if end is not None and now > end:
                    done.discard(req_id)
                    failed.add(req_id)
                    self.late_reads += 1
                    self._worker.xfer_stats.record_kv_expired_req()
                    lease = self._leases[req_id]
                    log.warning(
                        "%s %s (prefill request %s) ended %.1f s after the prefill instance's lease on its "
                        "blocks; the blocks may hold another request's KV: the load counts as failed",
                        REFUSED,
                        req_id,
                        lease.remote_request_id,
                        now - end,
                    )
            for req_id in done | failed:
                self._leases.pop(req_id, None)
            if len(self._leases) > len(self._worker._recving_metadata):  # reads vLLM dropped (aborts)
                for req_id in [r for r in self._leases if r not in self._worker._recving_metadata]:
                    del self._leases[req_id]
            return done, failed

        return checked
