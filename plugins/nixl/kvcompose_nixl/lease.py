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
  vLLM's handshake measured, pushes it by each heartbeat known to have arrived at least
  :data:`HEARTBEAT_MARGIN_S` before the end it knew, and when a read finishes after the end it
  reports the read failed instead of done: vLLM marks the request's blocks invalid, the request
  recomputes them or fails under ``kv_load_failure_policy``, and vLLM's
  ``vllm:nixl_num_kv_expired_reqs`` counts it, as it counts a read vLLM itself declines as
  expired. The prefill instance is not notified (it released the blocks already).

A heartbeat is a one-way NIXL notification: sent is not arrived. Across a cut link the beats
wait in the transport and reach the prefill after it reaped the lease. So a beat counts as
arrived when a read from the same prefill engine, posted after the beat, completed: the link
carried a round trip after it, and the time that read was seen done bounds the beat's arrival.
Under load reads from a prefill complete every step; a lone read that takes longer than the
lease with no other read from its prefill finishing meanwhile is refused and recomputed, the
safe side (docs/e2e.md, "A cut path between the prefill and the decode host").

The estimate errs early: the prefill's worker starts its lease after its scheduler stamped it,
and a heartbeat extends from when the prefill reads it, not when it was sent. A prefill
instance that does not stamp (not kvcompose's nixl type) leaves its reads unchecked.
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
#: A heartbeat counts only when known to have arrived this long before the lease's end known then:
#: the prefill's worker reads it at its next step, which must come before that step reaps the lease.
HEARTBEAT_MARGIN_S = 2.0


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


@dataclass
class _Beat:
    #: local time the heartbeat was sent
    sent: float
    #: local time a read from the same engine, posted after it, was seen done; None until then
    arrived_by: float | None = None


class LeaseWatch:
    """Wraps three methods of vLLM's pull-mode NIXL worker, on the instance (the class stays
    vLLM's): ``start_load_kv`` records each read's lease and when it was posted,
    ``_send_heartbeats`` when each request's heartbeats were sent, ``_pop_done_transfers`` which
    heartbeats a completed read shows arrived, and fails a read that ended after its lease."""

    def __init__(self, worker: Any, margin_s: float = HEARTBEAT_MARGIN_S) -> None:
        self._worker = worker
        self._margin_s = margin_s
        self._leases: dict[str, _Lease] = {}
        #: request -> (engine read from, local time the read was handed to vLLM's worker)
        self._posted: dict[str, tuple[str, float]] = {}
        #: (engine, remote request) -> heartbeats sent for it, oldest first
        self._beats: dict[tuple[str, str], list[_Beat]] = {}
        #: Reads reported failed because they ended after their lease.
        self.late_reads = 0
        worker.start_load_kv = self._recording(worker.start_load_kv)
        worker._send_heartbeats = self._beating(worker._send_heartbeats)
        worker._pop_done_transfers = self._checking(worker._pop_done_transfers)

    def deadline(self, request_id: str) -> float | None:
        """The end of ``request_id``'s lease in this process's ``perf_counter``, as far as known
        now; ``None`` when the prefill did not stamp it or no handshake measured the offset."""
        lease = self._leases.get(request_id)
        if lease is None:
            return None
        offset = self._worker._engine_clock_offset.get(lease.engine_id)
        if offset is None:
            return None
        end = lease.expires - offset
        extension = self._worker._lease_extension
        for beat in self._beats.get((lease.engine_id, lease.remote_request_id), ()):
            if beat.arrived_by is not None and beat.arrived_by <= end - self._margin_s:
                end = max(end, beat.sent + extension)
        return end

    def _recording(self, start_load_kv: Callable[[Any], None]) -> Callable[[Any], None]:
        def recorded(metadata: Any) -> None:
            now = time.perf_counter()
            for req_id, meta in metadata.reqs_to_recv.items():
                remote = meta.remote
                if remote is None:
                    continue
                if not any(meta.local_block_ids):  # only notifies the prefill: no round trip, nothing computed
                    vllm_log.info("%s %s (prefill request %s)", RELEASED, req_id, remote.request_id)
                    continue
                self._posted[req_id] = (remote.engine_id, now)
                if remote.blocks_expiry_time is not None:
                    self._leases[req_id] = _Lease(remote.engine_id, remote.request_id, remote.blocks_expiry_time)
            start_load_kv(metadata)

        return recorded

    def _beating(self, send_heartbeats: Callable[[Any], None]) -> Callable[[Any], None]:
        def beating(metadata: Any) -> None:
            # vLLM sends only to a peer it has handshaken with; one it has not yet is skipped.
            ready = [e for e in metadata.heartbeat_by_engine if e in self._worker._remote_agents]
            send_heartbeats(metadata)
            now = time.perf_counter()
            for engine_id in ready:
                for remote_id in metadata.heartbeat_by_engine[engine_id].req_ids:
                    self._beats.setdefault((engine_id, remote_id), []).append(_Beat(now))
            # A request vLLM stopped beating for without a read (an abort, a notify-only read)
            # leaves its beats behind: drop those no lease could still be extended by.
            stale = now - 4 * self._worker._lease_extension
            for key in [k for k, beats in self._beats.items() if beats[-1].sent < stale]:
                del self._beats[key]

        return beating

    def _arrived(self, engine_id: str, posted: float, now: float) -> None:
        """A read from ``engine_id`` posted at ``posted`` was seen done at ``now``: every beat to
        that engine sent before it had arrived by then."""
        for (engine, _), beats in self._beats.items():
            if engine != engine_id:
                continue
            for beat in beats:
                if beat.sent > posted:
                    break
                if beat.arrived_by is None:
                    beat.arrived_by = now

    def _checking(
        self, pop_done: Callable[[dict[str, list[int]]], tuple[set[str], set[str]]]
    ) -> Callable[[dict[str, list[int]]], tuple[set[str], set[str]]]:
        def checked(transfers: dict[str, list[int]]) -> tuple[set[str], set[str]]:
            done, failed = pop_done(transfers)
            if not self._posted:
                return done, failed
            now = time.perf_counter()
            for req_id in done:
                if req_id in self._posted:
                    self._arrived(*self._posted[req_id], now)
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
                self._forget(req_id)
            if len(self._posted) > len(self._worker._recving_metadata):  # reads vLLM dropped (aborts)
                for req_id in [r for r in self._posted if r not in self._worker._recving_metadata]:
                    self._forget(req_id)
            return done, failed

        return checked

    def _forget(self, request_id: str) -> None:
        self._posted.pop(request_id, None)
        lease = self._leases.pop(request_id, None)
        if lease is not None:
            self._beats.pop((lease.engine_id, lease.remote_request_id), None)
