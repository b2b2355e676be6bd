"""The connector classes vLLM loads for a ``nixl`` child.

vLLM imports ``kv_connector_module_path`` and takes ``getattr(module, kv_connector)``
(``KVConnectorFactory.get_connector_class``), so the classes here carry vLLM's names:
``NixlConnector`` (pull) and ``NixlPushConnector`` (push). vLLM checks the literal name
"NixlConnector" with ``KVTransferConfig.has_connector`` in several places, so a different name
would silently turn those checks off.

Both subclass vLLM's connectors. The pull connector changes the five things below; the push
connector items 1 and 3, of item 5 the side channel's listener, the sealed agent metadata and
the peer allowlist of its handshakes (:class:`_SettingsMixin`), and binds the prompt its prefill
writes to the one its decode holds (:mod:`kvcompose_nixl.push`):

1. **Side channel from the config.** vLLM reads the handshake listener's host and port only from
   ``VLLM_NIXL_SIDE_CHANNEL_HOST`` / ``VLLM_NIXL_SIDE_CHANNEL_PORT`` (``base_scheduler.py``), one
   value per process. The ``kvcompose_side_channel_host`` / ``_port`` extra-config keys override
   them per connector, with vLLM's data-parallel offset (port + ``data_parallel_index``).
2. **A remote prefill with no remote blocks is computed locally** (pull mode). In vLLM 0.32, a
   decode request with ``do_remote_prefill`` and empty (or missing) ``remote_block_ids``, e.g. a
   prompt shorter than one block that a router forwards with no blocks, is reported as a full
   async hit by ``get_num_new_matched_tokens``; ``update_state_after_alloc`` then fails
   ``assert num_external_tokens == 0`` (``nixl/pull_scheduler.py:186``), which kills the engine
   core. (``[[]]``, one empty list per KV-cache group, which is what a prefill instance returns
   when it holds no block, does not assert but parks the request on a read of nothing.) Here
   such a request is "nothing to pull": no external tokens, no read, no heartbeat, no
   notification to the prefill instance, and the scheduler computes the prompt like a local
   one. A request whose ``remote_block_ids`` has blocks (a lone partial block included) is
   untouched: vLLM pulls every prompt token except the last, partial block included.

3. **Range loads** (``load: ranges``). Asked ``get_num_new_matched_tokens(request, n)`` with
   ``n`` beyond the local prefix (a host tier loads the tokens before ``n``), vLLM's scheduler
   already answers for the tokens from ``n`` on, but its ``update_state_after_alloc`` hands
   the worker *every* block without a hash, the host tier's included. Here it is handed the
   local prefix and the blocks from ``n // block_size`` on only, so the worker pulls exactly the
   range: vLLM's worker end-trims the prefill instance's ``remote_block_ids`` to the number of
   local blocks (``base_worker.py``, partial prefix hits), and a range runs to the prompt's end.
   A range of only the prompt's last token is not pulled (vLLM recomputes that token after any
   load that reaches the prompt's end); the prefill instance is still notified and frees its
   blocks at once.

4. **No read used after the prefill released its blocks, none refused that it held** (pull
   mode, :mod:`kvcompose_nixl.lease`): the prefill stamps its lease's end in the
   ``kv_transfer_params`` and answers the decode's questions about the leases its heartbeats
   renewed; the decode fails a read that ends after the last end it knows of. The prefill also
   answers each read's notification, held or not, and the decode takes a read only once it is
   answered held: a second decode's read of blocks already freed and reused counts failed.

5. **Trust** (pull mode, :mod:`kvcompose_nixl.trust`): a decode checks each request's P/D params
   on the scheduler before vLLM's code reads them (types, ranges, exactly the blocks of their
   token count, the prompt against the token count and digest the prefill stamped, the peer
   allowlist and, with a deployment key, the prefill's signature); a refused set is dropped before
   vLLM sees it, counted by reason, and nothing is connected to or read. Under
   ``kv_load_failure_policy`` ``recompute`` the prompt is computed locally; under ``fail`` (vLLM's
   default) the request ends with an error, the way vLLM ends a failed NIXL read: the scheduler
   half parks it as an asynchronous load of the prompt, the step's metadata names it
   (:data:`REFUSED_ATTR`) instead of queuing a read, and the worker half reports that load
   finished and failed, so vLLM's scheduler finishes it with ``FINISHED_ERROR``. A signing prefill
   adds the signature in ``request_finished``. Both sides answer the side channel with vLLM's
   protocol on a listener no frame can stop, seal the NIXL agent metadata they publish with the
   key, and load no peer metadata the key does not open (:mod:`kvcompose_nixl.side_channel`); no
   handshake leaves for a side channel off the list.

Before vLLM's worker creates its NIXL agent they also apply the agent settings vLLM has no
option for (the progress thread's sleep, UCX error handling), and once it exists they let it ask
a slow peer's side channel again (:mod:`kvcompose_nixl.handshake`). Every name of vLLM's or
NIXL's replaced or wrapped on the way is assigned in one module, :mod:`kvcompose_nixl.patches`,
which checks first that each exists.
Everything else is vLLM's: GPUDirect, host buffers, memory registration, and the leases
themselves (the prefill's timers and reaping, the decode's heartbeats that renew them); item 4
only asks the prefill how long it still holds them.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
    NixlPullConnector as _VllmNixlPullConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
    NixlPushConnector as _VllmNixlPushConnector,
)
from vllm.v1.core.kv_cache_manager import KVCacheBlocks

from kvcompose_nixl import (
    ACCEPT_UNSIGNED_KEY,
    HANDSHAKE_TRIES_KEY,
    INSECURE_SIDE_CHANNEL_KEY,
    KEY_ENV_KEY,
    KEY_FILE_KEY,
    PEERS_KEY,
    PROGRESS_DELAY_KEY,
    SIDE_CHANNEL_HOST_KEY,
    UCX_ERROR_HANDLING_KEY,
)
from kvcompose_nixl.lease import ANSWERING_ATTR, READ_ANSWERS_ATTR, answering_engine, answers_reads, stamp
from kvcompose_nixl.patches import (
    PULL_SCHEDULER,
    PULL_WORKER,
    PUSH_SCHEDULER,
    PUSH_WORKER,
    SCHEDULER,
    WORKER,
    ask_patiently,
    calm_progress_thread,
    check,
    guard_pushes,
    patch_scheduler,
    seal_agent_metadata,
    set_ucx_error_handling,
    watch_leases,
)
from kvcompose_nixl.plugin import (
    DEFAULT_LEASE_SECONDS,
    EXPOSED_ADVICE,
    INTERNAL_PARAM_KEYS,
    PARAM_KEYS,
    exposure_refused,
)
from kvcompose_nixl.push import PUSH_PROMPTS_ATTR, PushGuard, computed_digest, stamp_registration
from kvcompose_nixl.refusals import REFUSED_ATTR, Refusals
from kvcompose_nixl.trust import (
    Facts,
    Keyring,
    Peers,
    Policy,
    Refused,
    TrustConfigError,
    request_context,
    sign_params,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorMetadata,
        KVConnectorTransferResults,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler import (
        NixlBaseConnectorScheduler,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import NixlBaseConnectorWorker
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("kvcompose.nixl")


def trust_policy(ktc: Any) -> Policy:
    """The trust settings of a nixl child's ``kv_connector_extra_config`` (``ktc``: vLLM's
    ``KVTransferConfig``); a key the settings name and the process cannot read raises
    :class:`kvcompose_nixl.trust.TrustConfigError` at engine start."""
    keys = Keyring.load(ktc.get_from_extra_config(KEY_ENV_KEY, None), ktc.get_from_extra_config(KEY_FILE_KEY, None))
    peers = ktc.get_from_extra_config(PEERS_KEY, None)
    return Policy(
        keys,
        bool(ktc.get_from_extra_config(ACCEPT_UNSIGNED_KEY, False)),
        None if peers is None else Peers.parse(peers),
    )


def refuse_exposed(ktc: Any) -> None:
    """Raise :class:`TrustConfigError` for a keyless side channel beyond loopback, in the engine's
    own environment (``kvcompose check`` may have run in another)."""
    host = ktc.get_from_extra_config(SIDE_CHANNEL_HOST_KEY, None)
    keyed = bool(ktc.get_from_extra_config(KEY_ENV_KEY, None) or ktc.get_from_extra_config(KEY_FILE_KEY, None))
    insecure = bool(ktc.get_from_extra_config(INSECURE_SIDE_CHANNEL_KEY, False))
    why = exposure_refused(None if host is None else str(host), keyed, insecure)
    if why is not None:
        raise TrustConfigError(f"the nixl child refuses to start: {why} ({EXPOSED_ADVICE})")


def has_remote_blocks(remote_block_ids: Any) -> bool:
    """Whether a prefill instance's ``remote_block_ids`` names at least one block.

    The prefill instance returns one list per KV-cache group (``([3, 4],)``, JSON: ``[[3, 4]]``);
    routers and vLLM's own tests also send a flat list (``[3, 4]``). ``None``, ``[]`` and a list
    of empty groups (``[[]]``, what a prefill instance returns when it holds no block:
    ``pull_scheduler.py`` only delays the free when a group is non-empty) all mean none.
    """
    if not remote_block_ids:
        return False
    if not isinstance(remote_block_ids, (list, tuple)) and not isinstance(remote_block_ids, Sequence):
        return True  # not a list of blocks (the decode's check refuses it); lists first: 30 ns, not 100
    # A plain loop, lists and tuples first: the scheduler asks this up to four times per request.
    for group in remote_block_ids:
        if isinstance(group, (list, tuple)):
            if group:
                return True
        elif not isinstance(group, Sequence) or isinstance(group, str) or len(group) > 0:
            return True
    return False


def _nothing_to_pull(request: Request) -> bool:
    """A decode-side request that asks for a remote prefill the prefill instance cannot serve.

    The overrides below test ``request.kv_transfer_params`` first: most requests have none, and
    then this call (a frame, four times per request) is skipped.
    """
    params = request.kv_transfer_params
    if not params or not params.get("do_remote_prefill"):
        return False
    return not has_remote_blocks(params.get("remote_block_ids"))


def range_blocks(blocks: KVCacheBlocks, start_block: int) -> KVCacheBlocks:
    """``blocks`` without those between the local prefix and ``start_block``.

    The local prefix is the leading blocks with a hash (vLLM's own count in
    ``update_state_after_alloc``); the blocks after it that another child loads have none yet
    (vLLM caches an async load's blocks only once it completes). One KV cache group: the
    ``ranges`` rule refuses an engine with several.
    """
    (group,) = blocks.blocks
    cached = 0
    for block in group:
        if block.block_hash is None or block.is_null:
            break
        cached += 1
    if start_block <= cached:
        return blocks
    return KVCacheBlocks(([*group[:cached], *group[start_block:]],))


class _RangeLoadsMixin:
    """Loads only the range a ``ranges`` load rule offered (see the module docstring, 3)."""

    #: vLLM's block size (set here; the pull connector's checks read it too).
    _block_size: int

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[call-arg]
        self._block_size = vllm_config.cache_config.block_size
        #: request -> the ``num_computed_tokens`` its hit was answered for, until allocation.
        self._range_starts: dict[str, int] = {}

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        tokens, is_async = super().get_num_new_matched_tokens(request, num_computed_tokens)  # type: ignore[misc]
        if tokens == 1 and num_computed_tokens + 1 == request.num_tokens and request.kv_transfer_params:
            # Only the prompt's last token is left, and vLLM recomputes that token after any
            # load that reaches the prompt's end: pulling its block would be a read for nothing.
            # 0 still reaches update_state_after_alloc, which notifies the prefill instance.
            tokens, is_async = 0, False
        if tokens:
            self._range_starts[request.request_id] = num_computed_tokens
        else:
            self._range_starts.pop(request.request_id, None)
        return tokens, is_async

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        start = self._range_starts.pop(request.request_id, None)
        if start is not None and num_external_tokens > 0:
            blocks = range_blocks(blocks, start // self._block_size)
        super().update_state_after_alloc(request, blocks, num_external_tokens)  # type: ignore[misc]

    # A request aborted between lookup and allocation leaves its start behind: forget it.
    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._range_starts.pop(request.request_id, None)
        return super().request_finished(request, block_ids)  # type: ignore[misc, no-any-return]

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._range_starts.pop(request.request_id, None)
        return super().request_finished_all_groups(request, block_ids)  # type: ignore[misc, no-any-return]


class _SettingsMixin:
    """Applies the NIXL agent settings before vLLM builds its halves, the side-channel options
    once it has built the scheduler half, and the handshake's tries (:mod:`kvcompose_nixl.handshake`)
    once it has built the worker half, each by :mod:`kvcompose_nixl.patches`."""

    connector_scheduler: NixlBaseConnectorScheduler | None
    connector_worker: NixlBaseConnectorWorker | None
    #: What this child believes and connects to (:mod:`kvcompose_nixl.trust`), set here.
    trust: Policy
    #: vLLM's private names each half must have (:mod:`kvcompose_nixl.patches`): push, then pull adds.
    _scheduler_names: tuple[Mapping[str, str], ...] = (SCHEDULER,)
    _worker_names: tuple[Mapping[str, str], ...] = (WORKER,)

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        ktc = vllm_config.kv_transfer_config
        assert ktc is not None
        self.trust = trust_policy(ktc)
        if role == KVConnectorRole.SCHEDULER:  # the half that binds the side channel, before it exists
            refuse_exposed(ktc)
        # Before vLLM's worker creates its NIXL agent.
        delay = ktc.get_from_extra_config(PROGRESS_DELAY_KEY, None)
        if delay is not None:
            calm_progress_thread(int(delay))
        error_handling = ktc.get_from_extra_config(UCX_ERROR_HANDLING_KEY, None)
        if error_handling is not None:
            set_ucx_error_handling(error_handling)
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[call-arg]
        if self.connector_scheduler is not None:
            check(self.connector_scheduler, *self._scheduler_names)
            patch_scheduler(self.connector_scheduler, vllm_config)
        if self.connector_worker is not None:
            worker = self.connector_worker
            check(worker, *self._worker_names)
            seal_agent_metadata(worker.nixl_wrapper, self.trust.keys, self.trust.accept_unsigned)
            tries = int(ktc.get_from_extra_config(HANDSHAKE_TRIES_KEY, 1))
            # The scheduler checked each request's side channel; this holds whatever reaches here.
            ask_patiently(worker, tries, self.trust.handshake_allowed)


class NixlConnector(_SettingsMixin, _RangeLoadsMixin, _VllmNixlPullConnector):
    """vLLM's pull-mode NixlConnector, plus side-channel options, local compute when a remote
    prefill comes with no remote blocks, range loads, reads checked against the prefill's
    lease on their blocks, and params checked before vLLM reads them (a refused request is
    computed locally, or fails under ``kv_load_failure_policy: fail``; see the module docstring)."""

    _scheduler_names = (SCHEDULER, PULL_SCHEDULER)
    _worker_names = (WORKER, PULL_WORKER)

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        assert ktc is not None
        self._lease_s = float(ktc.get_from_extra_config("kv_lease_duration", DEFAULT_LEASE_SECONDS))
        #: The lease checks and answers (:mod:`kvcompose_nixl.lease`); None on a scheduler.
        self.leases = (
            watch_leases(self.connector_worker, self.trust.keys, self._lease_s)
            if self.connector_worker is not None
            else None
        )
        #: Prefill engines that answer lease questions, from their requests' params (scheduler).
        self._answering: set[str] = set()
        #: Requests whose prefill answers each read, until their read is queued (scheduler).
        self._reads_answered: set[str] = set()
        self._groups = len(kv_cache_config.kv_cache_groups) if kv_cache_config is not None else 1
        self._tp_size = vllm_config.parallel_config.tensor_parallel_size
        #: A consumer-only instance: ``do_remote_decode`` (a prefill leg's flag) is never a client's to set.
        self._decode_only = ktc.kv_role == "kv_consumer"
        #: The refused params, both halves (:mod:`kvcompose_nixl.refusals`). Under
        #: ``kv_load_failure_policy: fail`` a refused request ends with an error (else it is
        #: computed here); the composite hands its children the engine's policy.
        self.refusals = Refusals(ktc.kv_load_failure_policy == "fail", PARAM_KEYS)

    @property
    def refused_params(self) -> Counter[str]:
        """Refusals by reason: what the composite reports as ``vllm:kvcompose_refused_params``."""
        return self.refusals.counts

    def on_new_request(self, request: Request) -> None:
        """vLLM starts lease heartbeats to the prefill instance for every remote prefill; there
        is no lease to renew when the prefill instance holds no block. A prefill that answers
        lease questions is noted, for the workers to ask after its heartbeats."""
        params = request.kv_transfer_params
        if params:
            for marker in INTERNAL_PARAM_KEYS:  # vLLM's own bookkeeping, never a client's to set
                params.pop(marker, None)
            if params.get("do_remote_decode") and self._decode_only:
                # vLLM would hold this decode's blocks for the lease, for a reader that never comes.
                params["do_remote_decode"] = False
                refused = Refused("role", "do_remote_decode sent to a decode-only instance")
                self.refusals.refuse(request.request_id, params, refused, load=False)
            if params.get("do_remote_prefill"):  # vLLM reads the fields here already, blocks or none
                self._screen(request, params)
        super().on_new_request(request)
        params = request.kv_transfer_params
        if not params:
            return
        if _nothing_to_pull(request):
            assert self.connector_scheduler is not None
            self.connector_scheduler._stop_heartbeat(request.request_id)
            log.debug("%s: remote prefill without remote blocks; computing it locally", request.request_id)
        elif (engine := answering_engine(params)) is not None:
            self._answering.add(engine)
            if answers_reads(params):
                self._reads_answered.add(request.request_id)

    def _screen(self, request: Request, params: dict[str, Any]) -> None:
        """Refuse ``params`` unless :class:`~kvcompose_nixl.trust.Policy` takes them for this
        request: the P/D fields are dropped, and vLLM computes the prompt as a local one, or,
        under ``kv_load_failure_policy: fail``, the request is kept to end with an error (see
        :meth:`get_num_new_matched_tokens`)."""
        prompt = request.prompt_token_ids or []
        assert self.connector_scheduler is not None
        remote_tokens = self.connector_scheduler._get_remote_prefill_token_count(len(prompt))
        facts = Facts(self._block_size, self._groups, self._tp_size, remote_tokens)
        try:
            self.trust.screen(params, facts, prompt, request_context(request))
        except Refused as refused:
            self.refusals.refuse(request.request_id, params, refused)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """vLLM's metadata, naming the prefill engines of this step's heartbeats that answer
        lease questions (most steps send no heartbeat: nothing is added then), and the refused
        requests parked this step to end with an error (:data:`REFUSED_ATTR`)."""
        meta = super().build_connector_meta(scheduler_output)
        beats = getattr(meta, "heartbeat_by_engine", None)
        if beats and self._answering:
            setattr(meta, ANSWERING_ATTR, {e for e in beats if e in self._answering})
        if self._reads_answered and meta.reqs_to_recv:
            answered = {r for r in meta.reqs_to_recv if r in self._reads_answered}
            if answered:
                setattr(meta, READ_ANSWERS_ATTR, answered)
                self._reads_answered -= answered
        self.refusals.name_in(meta)
        return meta

    # ---- worker: a refused request's load, reported failed with nothing read

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """vLLM's reads of this step, and the refused requests the scheduler named: their loads
        are failed at once (no handshake, no read), in this step's results."""
        self.refusals.take_from(self._connector_metadata)
        super().start_load_kv(forward_context, **kwargs)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """vLLM's results, and each refused request's load finished and failed, as vLLM's worker
        reports a read that failed: the scheduler then ends the request with ``FINISHED_ERROR``
        (``kv_load_failure_policy: fail``)."""
        results = super().get_transfer_results(finished_req_ids)
        results.finished_recving, results.failed_recving = self.refusals.fail_loads(
            results.finished_recving, results.failed_recving
        )
        return results

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """No external tokens when there is nothing to pull; for a request refused under
        ``kv_load_failure_policy: fail``, what vLLM answers for a remote prefill.

        A refused request's answer, the rest of the prompt loaded asynchronously, makes vLLM's
        scheduler allocate its blocks and park it until its load finishes, as for any read;
        :meth:`update_state_after_alloc` queues no read for it, and the workers report the load
        failed (:meth:`get_transfer_results`). Nothing left to load (another child of a
        composition loads the whole prompt): no tokens, and the request is served without one.

        vLLM would answer ``(prompt tokens, True)``. With ``0`` the scheduler allocates and
        schedules the prompt normally, and vLLM's ``update_state_after_alloc`` takes its
        "no remote blocks" branch, where ``num_external_tokens == 0`` holds: it queues no read
        and marks the params processed (``do_remote_prefill=False``) as after any transfer.
        ``do_remote_prefill`` must stay set until then: with ``bidirectional_kv_xfer`` vLLM
        tracks a remote-prefill request there for the prefill instance's later readback.
        """
        refused = self.refusals.matched(request.request_id, request.num_tokens - num_computed_tokens)
        if refused is not None:
            return refused
        if request.kv_transfer_params and _nothing_to_pull(request):
            return 0, False
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """vLLM tells "no remote blocks" by truthiness: ``[[]]`` (one empty group, what a
        prefill instance holding nothing returns) would make it queue a notification to that
        instance, a handshake with a peer that has nothing to free. Spell it ``[]`` so vLLM
        takes its no-blocks branch. Everything else, including the bidirectional bookkeeping
        of a remote-prefill request, stays vLLM's."""
        self.refusals.allocated(request.request_id, num_external_tokens)
        if request.kv_transfer_params and _nothing_to_pull(request):
            assert request.kv_transfer_params is not None
            request.kv_transfer_params["remote_block_ids"] = []
        super().update_state_after_alloc(request, blocks, num_external_tokens)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """See :meth:`request_finished_all_groups`."""
        self.refusals.finished(request.request_id)
        if request.kv_transfer_params:  # most requests have none: no call then
            self._reads_answered.discard(request.request_id)
            self._forget_unserved_prefill(request)
        delay, params = super().request_finished(request, block_ids)
        if delay:
            self._stamp_and_sign(request, params)
        return delay, params

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """A request aborted before it was scheduled still has ``do_remote_prefill`` set, and
        vLLM then queues an empty read so the worker notifies the prefill instance to free its
        blocks, which means a handshake with it. With no remote blocks there is nothing to
        free: clear the flag first so vLLM finishes the request like a local one."""
        self.refusals.finished(request.request_id)  # refused under fail and aborted before it was allocated
        if request.kv_transfer_params:  # most requests have none: no call then
            self._reads_answered.discard(request.request_id)
            self._forget_unserved_prefill(request)
        delay, params = super().request_finished_all_groups(request, block_ids)
        if delay:
            self._stamp_and_sign(request, params)
        return delay, params

    def _stamp_and_sign(self, request: Request, params: dict[str, Any] | None) -> None:
        """On the prefill: the lease's end (:func:`~kvcompose_nixl.lease.stamp`), and with a
        key, the signature that binds the params to the prompt tokens the blocks hold."""
        assert self.connector_scheduler is not None
        stamp(self.connector_scheduler, request.request_id, params)
        if not params or not params.get("do_remote_prefill"):
            return
        expires = math.ceil(time.time() + self._lease_s)  # whole seconds: exact through JSON
        sign_params(params, request.prompt_token_ids or [], request_context(request), self.trust.keys, expires)

    @staticmethod
    def _forget_unserved_prefill(request: Request) -> None:
        if request.kv_transfer_params and _nothing_to_pull(request):
            assert request.kv_transfer_params is not None
            request.kv_transfer_params["do_remote_prefill"] = False


class NixlPushConnector(_SettingsMixin, _RangeLoadsMixin, _VllmNixlPushConnector):
    """vLLM's push-mode NixlPushConnector, plus side-channel options, range loads (the decode
    instance registers only its range's blocks; the prefill instance writes its tail into them)
    and the prompt binding (:mod:`kvcompose_nixl.push`): the decode registers its prompt's
    digest, the prefill writes only when it is the digest of what it computed, and a refused
    load is computed on the decode (or fails under ``kv_load_failure_policy: fail``).

    Push mode needs no empty-blocks fix: the decode instance never reads ``remote_block_ids``
    (the prefill instance learns the decode blocks from the registration and WRITEs them).
    """

    _scheduler_names = (SCHEDULER, PUSH_SCHEDULER)
    _worker_names = (WORKER, PUSH_WORKER)

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        #: The prompt binding's worker half; None on a scheduler.
        self.push_guard: PushGuard | None = (
            guard_pushes(self.connector_worker, self.trust.keys, self.trust.accept_unsigned)
            if self.connector_worker is not None
            else None
        )
        #: Prefill scheduler: digests of the requests finished since the last step's metadata.
        self._push_prompts: dict[str, str] = {}

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """vLLM's, then the decode's registration (if it staged one) stamped with its prompt's digest."""
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        cs = self.connector_scheduler
        assert cs is not None
        registration = cs._push_pending_registrations.get(request.request_id)
        if registration is not None:
            prompt = request.prompt_token_ids or []
            loaded = cs._get_remote_prefill_token_count(len(prompt))
            stamp_registration(registration, prompt, loaded, request_context(request))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's, then the digest of what the prefill's blocks hold, for its workers."""
        delay, params = super().request_finished(request, block_ids)
        if delay:
            self._note_computed(request)
        return delay, params

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """See :meth:`request_finished`."""
        delay, params = super().request_finished_all_groups(request, block_ids)
        if delay:
            self._note_computed(request)
        return delay, params

    def _note_computed(self, request: Request) -> None:
        cs = self.connector_scheduler
        assert cs is not None
        if request.request_id in cs._newly_finished_push_blocks:  # blocks the workers will write
            tokens = request.all_token_ids
            self._push_prompts[request.request_id] = computed_digest(
                tokens, request.num_computed_tokens, request_context(request)
            )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """vLLM's metadata, with the digests of the requests whose blocks it hands the workers
        (:data:`~kvcompose_nixl.push.PUSH_PROMPTS_ATTR`)."""
        meta = super().build_connector_meta(scheduler_output)
        if self._push_prompts:
            setattr(meta, PUSH_PROMPTS_ATTR, self._push_prompts)
            self._push_prompts = {}
        return meta


#: vLLM registers the pull connector under both names; accept ``NixlPullConnector`` too.
NixlPullConnector = NixlConnector

__all__ = [
    "NixlConnector",
    "NixlPullConnector",
    "NixlPushConnector",
    "REFUSED_ATTR",
    "refuse_exposed",
    "has_remote_blocks",
    "range_blocks",
]
