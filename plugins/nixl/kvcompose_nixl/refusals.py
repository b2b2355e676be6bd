"""The refused P/D params of one NIXL connector, scheduler side and worker side, in one owner.

A decode refuses a request's ``kv_transfer_params`` (:class:`~kvcompose_nixl.trust.Refused`)
before vLLM reads them. What happens next spans the engine's halves:

* scheduler (:meth:`Refusals.refuse`): counted by reason, told once per reason and source in the
  log, the P/D fields dropped (vLLM then computes the prompt as a local one); under
  ``kv_load_failure_policy: fail`` the request is kept, answered as a remote prefill
  (:meth:`Refusals.matched`) so that vLLM allocates its blocks and parks it, and once allocated
  (:meth:`Refusals.allocated`) named in the step's metadata (:meth:`Refusals.name_in`);
* worker: the named loads (:meth:`Refusals.take_from`) are reported finished and failed with the
  step's results (:meth:`Refusals.fail_loads`), as vLLM's worker reports a read that failed, and
  the scheduler ends the request with ``FINISHED_ERROR``.

The connector's overrides delegate here in one line each, as vLLM's delegate to their scheduler
and worker halves.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Collection
from typing import Any

from kvcompose_nixl.trust import Refused

log = logging.getLogger("kvcompose.nixl")

#: The metadata attribute naming, for the workers, the refused requests to fail (scheduler to worker).
REFUSED_ATTR = "kvcompose_refused"
#: At most this many (reason, source) pairs are told at warning level; later ones at debug.
MAX_TOLD = 1024


class Refusals:
    """One connector's refused requests (module docstring); ``fail``: the engine's
    ``kv_load_failure_policy`` is ``fail``."""

    def __init__(self, fail: bool, param_keys: Collection[str]) -> None:
        self.fail = fail
        self._param_keys = frozenset(param_keys)
        #: Refusals by reason (:data:`kvcompose_nixl.trust.REASONS`): the composite's
        #: ``vllm:kvcompose_refused_params``.
        self.counts: Counter[str] = Counter()
        self._told: set[tuple[str, str]] = set()
        #: Scheduler: requests to end with an error, by id (their reason), until allocated ...
        self._pending: dict[str, str] = {}
        #: ... then until this step's metadata names them to the workers.
        self._allocated: dict[str, str] = {}
        #: Worker: the loads the metadata named, reported failed by the next results.
        self._loads: dict[str, str] = {}

    # ---- scheduler

    def refuse(self, request_id: str, params: dict[str, Any], refused: Refused, load: bool = True) -> None:
        """Count and tell ``refused``; for a refused load (``load``), drop the P/D fields, and
        under ``fail`` keep the request to end with an error."""
        self.counts[refused.reason] += 1
        source = params.get("remote_host")
        told = (refused.reason, source if isinstance(source, str) else "?")
        if not load:
            outcome = "served without it"
        else:
            outcome = "the request fails (load_failure: fail)" if self.fail else "computed here instead"
        if told not in self._told and len(self._told) < MAX_TOLD:  # once per reason and source
            self._told.add(told)
            log.warning(
                "%s: kv_transfer_params refused (%s), %s: %s", request_id, refused.reason, outcome, refused.detail
            )
        else:
            log.debug("%s: kv_transfer_params refused (%s), %s", request_id, refused.reason, outcome)
        if not load:
            return
        for key in [k for k in params if k in self._param_keys]:
            del params[key]
        if self.fail:
            self._pending[request_id] = refused.reason

    def matched(self, request_id: str, uncomputed: int) -> tuple[int, bool] | None:
        """For a request kept to fail: what vLLM answers for a remote prefill (the rest of the
        prompt, loaded asynchronously), or nothing to load when another child loads it all;
        None for any other request."""
        if request_id not in self._pending:
            return None
        if uncomputed > 0:
            return uncomputed, True
        del self._pending[request_id]
        return 0, False

    def allocated(self, request_id: str, num_external_tokens: int) -> None:
        """A kept request got its blocks: name it to the workers with this step's metadata
        (none to load: it was loaded or computed otherwise)."""
        reason = self._pending.pop(request_id, None)
        if reason is not None and num_external_tokens > 0:
            self._allocated[request_id] = reason

    def finished(self, request_id: str) -> None:
        """The request ended (or was aborted) before it was allocated."""
        self._pending.pop(request_id, None)

    def name_in(self, meta: Any) -> None:
        """Name this step's allocated refused requests in the workers' metadata."""
        if self._allocated:
            setattr(meta, REFUSED_ATTR, self._allocated)
            self._allocated = {}

    def kept(self) -> int:
        """Refused requests still kept on the scheduler side (to end with an error): none once
        every one was allocated and named, or finished."""
        return len(self._pending) + len(self._allocated)

    # ---- worker

    def take_from(self, meta: Any) -> None:
        """The refused requests the scheduler named in this step's metadata."""
        named = getattr(meta, REFUSED_ATTR, None)
        if named:
            self._loads.update(named)

    def fail_loads(self, finished_recving: set[str], failed_recving: set[str]) -> tuple[set[str], set[str]]:
        """vLLM's finished and failed loads of this step's results, with every named load in both."""
        if not self._loads:
            return finished_recving, failed_recving
        for req_id, reason in self._loads.items():
            log.debug("%s: load reported failed: its kv_transfer_params were refused (%s)", req_id, reason)
        failed = set(self._loads)
        self._loads = {}
        return set(finished_recving) | failed, set(failed_recving) | failed
