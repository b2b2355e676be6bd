"""vLLM's ``OffloadingConnector`` with a p2p tier, spoken to by vLLM's P/D proxy and router.

vLLM's p2p tier takes each request's role from keys of its ``kv_transfer_params``
(``vllm/v1/kv_offload/tiering/p2p/manager.py``): ``remote_decoder: {kv_request_id}`` on a
prefill, ``remote_prefiller: {kv_request_id, remote_host, remote_port}`` on a decode. vLLM's
disaggregated proxy and ``vllm-router`` speak the other protocol, NixlConnector's: they send
``do_remote_decode: true`` to the prefill and hand the decode whatever ``kv_transfer_params`` the
prefill's answer carries. This class maps one onto the other, so that a composition whose
``native-offload`` child has a p2p tier runs behind them unchanged:

* a request that arrives with ``do_remote_decode`` and no role key gets ``remote_decoder`` with a
  fresh, unguessable ``kv_request_id`` (:meth:`on_new_request`, before vLLM's scheduler reads
  the request's params), unless the composition has another P/D transport (NIXL): the tier then
  carries no P/D leg and serves the pool only;
* when such a request finishes, its answer's params are ``remote_prefiller`` naming this engine's
  p2p control socket and that id (:meth:`request_finished`), which the router passes to the decode.

**Trust.** vLLM's tier believes the role keys as it finds them: a client that reaches an
instance's API chooses the peer it connects to (``remote_host``/``remote_port``), and a role
that is not a mapping raises in the scheduler. Here every role is screened in
:meth:`on_new_request`, before vLLM reads it, with the NIXL child's rules
(:mod:`kvcompose_nixl.trust`); a role refused is removed and the prompt computed here:

* ``malformed``: a role that is not a mapping of the tier's fields, of their types and sizes,
  or a combination vLLM's tier does not take;
* ``role``: beside another P/D transport, any P/D role; with a key, a ``remote_decoder`` a client
  wrote (this class gives prefills theirs);
* ``prompt``, ``unsigned``, ``signature``, ``expired``, ``replayed``: with a key, a
  ``remote_prefiller`` must carry the prefill's signature over the role, its end, and the
  digest of the prompt it computed (this prompt's), and be taken once;
* ``peer``: the peer a role names must be reachable under the NIXL child's rule: a signed
  role's, else loopback; a ``remote_kv_source`` may also name a peer of the tier's pool.

With a key the tier's connect handshake is sealed too (:func:`seal_handshake`): the NIXL agent
metadata each side sends is encrypted and authenticated with the deployment key together with
the memory it offers, so a peer that does not hold the key (one a role names, or one that dials
this engine's control socket) completes no handshake, and vLLM's tier moves no byte to or from
it.

**The fleet's pool.** With a ``pool`` on the p2p tier, the scheduler half keeps a
:class:`~kvcompose_cpu_offload.pool.PeerIndex` of what each configured peer holds, from the
peers' KV events. A request that arrives with no p2p role and is not a decode leg
(``do_remote_prefill``: its KV comes from its prefill), a prefill leg included, whose prefix (in
the tier's chunks) a peer holds further than this instance's device cache or CPU tier does, gets
``remote_kv_source`` naming that peer's p2p socket and a fresh id
(:meth:`OffloadingConnector.on_new_request`, before vLLM's tier parses the params), and vLLM's
tier looks the blocks up there and fetches the hits. A ``remote_kv_source`` that arrives naming a
peer of the pool (a router's choice, as llm-d's header) is used instead of the index. vLLM bounds
a dead peer (ZMQ heartbeat, handshake and load timeouts) but not an unanswered lookup on a live
connection (``tiering/p2p/session/client.py``: "Lookups have no timeout"); so a source's lookup
that has not answered within the pool's ``wait_ms`` is given up the way vLLM gives up a dead
peer's (the id marked failed: its lookups answer miss) and the prompt is computed here.

Everything else is vLLM's class. The class keeps vLLM's name (vLLM looks connectors up by it);
``kv_connector_module_path`` points here.
"""

from __future__ import annotations

import secrets
import time
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
from vllm import envs
from vllm.distributed.kv_transfer.kv_connector.v1 import offloading_connector
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.logger import init_logger
from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key

from kvcompose.api import MAX_HOST_CHARS, P2P_DECODER, P2P_PREFILLER, P2P_ROLE_KEYS, P2P_SOURCE
from kvcompose_cpu_offload.pool import Peer, PeerIndex
from kvcompose_cpu_offload.tiers import (
    P2P_KEY_ENV_KEY,
    P2P_KEY_FILE_KEY,
    P2P_PD_TRANSPORT_KEY,
    P2P_POOL_KEY,
    P2P_PROGRESS_DELAY_KEY,
)
from kvcompose_nixl.patches import calm_progress_thread
from kvcompose_nixl.trust import (
    LOOPBACK_PEERS,
    MAX_ID_CHARS,
    PROMPT_KEY,
    SIG_KEY,
    SIGNED_UNTIL_KEY,
    Keyring,
    Refused,
    Replays,
    prompt_digest,
    request_context,
    text_field,
    verify_signed,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_utils import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger(f"vllm.{__name__}")

#: The keys vLLM's proxy and router send the prefill (NixlConnector's protocol).
DO_REMOTE_DECODE = "do_remote_decode"
#: The key vLLM's proxy and router send a decode (NixlConnector's protocol): the pool leaves a
#: decode leg alone, its prompt's KV comes from its prefill.
DO_REMOTE_PREFILL = "do_remote_prefill"
#: Prefix of the ids this class gives (the p2p tier needs nothing of them but uniqueness).
REQUEST_ID_PREFIX = "kvcompose-p2p-"
#: The role combinations vLLM's tier takes (``tiering/p2p/manager.py``: only these two together).
LEGAL = ({P2P_DECODER}, {P2P_PREFILLER}, {P2P_SOURCE}, {P2P_DECODER, P2P_SOURCE})
#: vLLM's default time a prefill's p2p tier holds blocks for the decode (``unbound_store_timeout_s``).
HOLD_S = 60.0


def check_roles(params: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The p2p roles of ``params``, each checked field by field (``malformed`` otherwise)."""
    present = {key for key in P2P_ROLE_KEYS if key in params}
    if present and present not in LEGAL:
        raise Refused("malformed", f"roles {sorted(present)} together: vLLM's p2p tier takes one, or decoder + source")
    roles: dict[str, dict[str, Any]] = {}
    for name in sorted(present):
        role = params[name]
        if not isinstance(role, dict):
            raise Refused("malformed", f"{name} must be a mapping, not {type(role).__name__}")
        fields = {"kv_request_id"} if name == P2P_DECODER else {"kv_request_id", "remote_host", "remote_port"}
        if set(role) != fields:
            raise Refused("malformed", f"{name} must hold exactly {sorted(fields)}")
        text_field(role, "kv_request_id", MAX_ID_CHARS, f"{name}.")
        if name != P2P_DECODER:
            text_field(role, "remote_host", MAX_HOST_CHARS, f"{name}.")
            port = role["remote_port"]
            if type(port) is not int or not 0 < port < 65536:
                raise Refused("malformed", f"{name}.remote_port must be a whole number from 1 to 65535")
        roles[name] = role
    return roles


def signed_view(role: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
    """The role as the fields the NIXL child's signature binds (``transfer_mode: p2p`` keeps a p2p
    signature from passing for NIXL params, and the other way)."""
    return {
        "remote_request_id": role.get("kv_request_id"),
        "remote_host": role.get("remote_host"),
        "remote_port": role.get("remote_port"),
        "transfer_mode": "p2p",
        SIGNED_UNTIL_KEY: params.get(SIGNED_UNTIL_KEY),
        PROMPT_KEY: params.get(PROMPT_KEY),
        SIG_KEY: params.get(SIG_KEY),
    }


def decoder_params(
    params: Mapping[str, Any] | None, role: dict[str, Any], digest: str, keys: Keyring | None, now: float
) -> dict[str, Any]:
    """What a prefill answers for its decode: ``params`` with the ``remote_prefiller`` role, the
    digest of the prompt it computed and, with ``keys``, their signature until the tier lets the
    blocks go (:func:`screen` is the other side)."""
    answer = {**(params or {}), P2P_PREFILLER: role, PROMPT_KEY: digest}
    if keys is not None:
        answer[SIGNED_UNTIL_KEY] = int(now + HOLD_S)
        answer[SIG_KEY] = keys.sign(signed_view(role, answer))
    return answer


def screen(
    params: Mapping[str, Any],
    digest: str,
    keys: Keyring | None,
    replays: Replays,
    now: float,
    clock_skew_s: float = 10.0,
    peers: Collection[tuple[str, int]] = (),
    transport: str | None = None,
) -> None:
    """Raise :class:`Refused` unless this engine may act on the p2p roles of ``params`` for a
    prompt of ``digest`` (:func:`prompt_digest`); ``peers``: the pool's (host, p2p port), which a
    ``remote_kv_source`` may name; ``transport``: the composition's P/D transport where it is
    another child (no P/D role is then taken). The checks run in this order, each reason pinned
    by a test beside a control that passes the checks before it."""
    roles = check_roles(params)
    if transport is not None and roles.keys() & {P2P_DECODER, P2P_PREFILLER}:
        raise Refused("role", f"a P/D role for the p2p tier: P/D is {transport}'s in this composition")
    if keys is not None and P2P_DECODER in roles:
        raise Refused("role", "a remote_decoder role from a client: this engine gives a prefill its own")
    prefiller = roles.get(P2P_PREFILLER)
    signed = False
    if prefiller is not None and keys is not None:
        read = (f"{prefiller['remote_host']}:{prefiller['remote_port']}", prefiller["kv_request_id"])
        verify_signed(signed_view(prefiller, params), keys, replays, read, now, clock_skew_s, digest)
        signed = True
    for name in (P2P_PREFILLER, P2P_SOURCE):
        role = roles.get(name)
        if role is None or signed or (name == P2P_SOURCE and (role["remote_host"], role["remote_port"]) in peers):
            continue
        if not LOOPBACK_PEERS.allows(role["remote_host"], role["remote_port"]):
            raise Refused(
                "peer", f"{name} names {role['remote_host']}:{role['remote_port']}, which no signature vouches for"
            )


#: What a sealed p2p handshake's plaintext starts with: it never opens as the nixl child's metadata.
HANDSHAKE = b"kvcompose-p2p-handshake-v1:"


def seal_handshake(transport: Any, keys: Keyring) -> None:
    """On vLLM's p2p tier's NIXL transport (``tiering/p2p/data/nixl.py``): the agent metadata it
    sends in its ``ConnectMsg`` is sealed with the deployment key together with the memory it
    offers (base address, blocks, block length), and a peer's is loaded only if it opens with the
    key and names the memory its message names; else ``ValueError`` saying why, which vLLM's
    session takes as a rejected connect (``session.py`` ``_on_connect``: logged, the connection
    marked dead, no ``add_remote_agent``). So a peer without the key completes no handshake in
    either direction, and a sealed metadata cannot be moved to another layout."""
    publish = transport.get_agent_metadata

    def get_agent_metadata() -> bytes:
        offered = [publish(), transport.base_addr, transport.num_blocks, transport.block_len]
        return keys.seal(HANDSHAKE + msgspec.msgpack.encode(offered))

    def opened(agent_metadata: bytes, base_addr: int, num_blocks: int, block_len: int) -> bytes:
        """The peer's NIXL metadata out of its sealed handshake; ValueError saying why not."""
        try:
            plain = keys.open(agent_metadata)
        except Refused as refused:
            raise ValueError(f"p2p handshake refused ({refused.reason}): {refused.detail}") from None
        try:
            if not plain.startswith(HANDSHAKE):
                raise ValueError("sealed metadata that is not a p2p handshake")
            metadata, *offered = msgspec.msgpack.decode(plain[len(HANDSHAKE) :], type=tuple[bytes, int, int, int])
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ValueError(f"p2p handshake refused (malformed): {exc}") from None
        if offered != [base_addr, num_blocks, block_len]:
            raise ValueError(
                f"p2p handshake refused (layout): the message offers {[base_addr, num_blocks, block_len]}, "
                f"the sealed metadata {offered}"
            )
        return metadata

    transport.get_agent_metadata = get_agent_metadata
    # vLLM 0.33 registers a peer with add_remote_peer_async (its add_remote_peer calls it); 0.32
    # has add_remote_peer only. One of the two is wrapped, so a metadata is opened once.
    name = "add_remote_peer_async" if hasattr(transport, "add_remote_peer_async") else "add_remote_peer"
    load = getattr(transport, name)

    def add_remote_peer(peer_id: str, agent_metadata: bytes, base_addr: int, num_blocks: int, block_len: int) -> Any:
        metadata = opened(agent_metadata, base_addr, num_blocks, block_len)
        return load(peer_id, agent_metadata=metadata, base_addr=base_addr, num_blocks=num_blocks, block_len=block_len)

    setattr(transport, name, add_remote_peer)


def p2p_address(extra_config: dict[str, Any], dp_index: int) -> tuple[str, int] | None:
    """The control socket of the config's p2p tier as its peers dial it (``host``, base port +
    ``dp_index``; vLLM's defaults from the environment, as the tier resolves them); None
    without a p2p tier."""
    for tier in extra_config.get("secondary_tiers") or ():
        if isinstance(tier, dict) and tier.get("type") == "p2p":
            host = tier.get("host") or envs.VLLM_P2P_SIDE_CHANNEL_HOST
            port = int(tier.get("port") or envs.VLLM_P2P_SIDE_CHANNEL_PORT) + dp_index
            return str(host), port
    return None


class OffloadingConnector(offloading_connector.OffloadingConnector):
    """vLLM's ``OffloadingConnector``, answering NixlConnector's P/D protocol through its p2p tier."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        delay = extra.get(P2P_PROGRESS_DELAY_KEY)
        if delay:  # before vLLM's tier makes its NIXL agent (process-wide, as the nixl child's)
            calm_progress_thread(int(delay))
        super().__init__(vllm_config, role, kv_cache_config)
        self._address = p2p_address(extra, vllm_config.parallel_config.data_parallel_index)
        self._keys = Keyring.load(extra.get(P2P_KEY_ENV_KEY), extra.get(P2P_KEY_FILE_KEY), owner="native-offload")
        self._replays = Replays()
        #: request id -> the kv_request_id this engine gave it as a prefill for a remote decode
        self._to_decoder: dict[str, str] = {}
        self._unlinger()
        self._seal()
        #: roles refused, by reason (the log says each): the composite reports them as
        #: ``vllm:kvcompose_refused_params`` (its loadstats.py), as it does the nixl child's
        self.refused_params: Counter[str] = Counter()
        #: the composition's P/D transport where it is another child: the tier then takes no P/D leg
        self._transport: str | None = extra.get(P2P_PD_TRANSPORT_KEY)
        pool = extra.get(P2P_POOL_KEY) if self._address is not None else None
        peers = [Peer(**peer) for peer in pool["peers"]] if pool else []
        self._peers = frozenset((peer.host, peer.p2p_port) for peer in peers)
        self._wait_s = pool["wait_ms"] / 1000 if pool else 0.0
        #: the peers' blocks; the scheduler half only (the worker never chooses a source)
        self.pool: PeerIndex | None = None
        if peers and role == KVConnectorRole.SCHEDULER:
            self.pool = PeerIndex(peers, max_blocks=pool["max_blocks"], silent_s=pool["silent_s"])
        #: request id -> (kv_request_id, the time its source's lookup is given up)
        self._waiting: dict[str, tuple[str, float]] = {}
        #: sources used, by who chose them ("index", "router") and lookups given up ("gave_up"): the
        #: composite reports them as ``vllm:kvcompose_pool_sources`` (its loadstats.py)
        self.pool_sources: Counter[str] = Counter()

    def on_new_request(self, request: Request) -> None:
        """Screen the request's p2p roles; else give a prefill asked for a remote decode the NIXL way
        the tier's producer role (where the tier carries P/D) and, with a pool, a source for its
        prefix (on any request but a decode leg); then vLLM's."""
        params = request.kv_transfer_params
        if self._address is not None and params and any(key in params for key in P2P_ROLE_KEYS):
            self._screen(request, params)
            source = params.get(P2P_SOURCE)
            if source is not None and (source["remote_host"], source["remote_port"]) in self._peers:
                self._wait(request, source["kv_request_id"], "router")
        # What the roles left: a prefill leg of vLLM's proxy and router, a decode leg, neither.
        params = request.kv_transfer_params or {}
        carries_pd = self._address is not None and self._transport is None
        if carries_pd and params.get(DO_REMOTE_DECODE) is True and not params.keys() & {P2P_DECODER, P2P_PREFILLER}:
            kv_request_id = REQUEST_ID_PREFIX + secrets.token_hex(16)
            params[P2P_DECODER] = {"kv_request_id": kv_request_id}  # vLLM's tier takes a source beside it
            self._to_decoder[request.request_id] = kv_request_id
        decode_leg = params.get(DO_REMOTE_PREFILL) is True or P2P_PREFILLER in params
        if self.pool is not None and not decode_leg and P2P_SOURCE not in params:
            self._choose_source(request)
        super().on_new_request(request)

    def _choose_source(self, request: Request) -> None:
        """Name the peer that holds the request's prefix further than this instance does as its
        ``remote_kv_source`` (vLLM's tier then looks the blocks up there and fetches the hits)."""
        assert self.pool is not None
        if request.skip_reading_prefix_cache:
            return
        group = self.connector_scheduler.config.kv_group_configs[0]
        per_chunk = group.hashes_per_chunk
        # A chunk is named by its last block's hash (vLLM's OffloadKey), in its events as here.
        keys = request.block_hashes[per_chunk - 1 :: per_chunk]
        found = self.pool.longest(keys)
        if found is None:
            return
        peer, chunks = found
        if chunks <= self._local_chunks(request, keys, per_chunk, group.group_idx):
            return
        kv_request_id = REQUEST_ID_PREFIX + secrets.token_hex(16)
        role = {"kv_request_id": kv_request_id, "remote_host": peer.host, "remote_port": peer.p2p_port}
        if request.kv_transfer_params is None:
            request.kv_transfer_params = {}
        request.kv_transfer_params[P2P_SOURCE] = role
        self._wait(request, kv_request_id, "index")

    def _local_chunks(self, request: Request, keys: Sequence[bytes], per_chunk: int, group_idx: int) -> int:
        """How many of the request's chunks this instance holds from the start: the longer of its
        device prefix (vLLM's own longest hit, which has no side effect) and its CPU tier's run of
        chunks (the eviction policy's ``get``, which touches nothing)."""
        device_blocks = 0
        kv_cache_manager = self._kv_cache_manager
        if kv_cache_manager is not None and kv_cache_manager.enable_caching:
            # (blocks, hit tokens, ...): the tuple's length is not the same in every vLLM.
            hit = kv_cache_manager.coordinator.find_longest_cache_hit(request.block_hashes, request.num_tokens - 1)
            device_blocks = hit[1] // self.connector_scheduler.config.tokens_per_hash
        manager = self.connector_scheduler.manager
        primary = getattr(manager, "primary_tier", manager)
        context = ReqContext(req_id=request.request_id)
        host = 0
        for key in keys:
            if primary.lookup(make_offload_key(key, group_idx), context) is LookupResult.MISS:
                break
            host += 1
        return max(device_blocks // per_chunk, host)

    def _wait(self, request: Request, kv_request_id: str, chosen_by: str) -> None:
        self.pool_sources[chosen_by] += 1
        self._waiting[request.request_id] = (kv_request_id, time.monotonic() + self._wait_s)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """vLLM's answer; for a request whose source's lookup has not answered within the pool's
        ``wait_ms``, the source given up (its lookups then miss) and vLLM's answer without it."""
        count, load_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        waiting = self._waiting.get(request.request_id)
        if waiting is None:
            return count, load_async
        if count is not None or time.monotonic() < waiting[1]:
            if count is not None:
                del self._waiting[request.request_id]
            return count, load_async
        del self._waiting[request.request_id]
        self._give_up(request, waiting[0])
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def _give_up(self, request: Request, kv_request_id: str) -> None:
        """Mark the source's id failed in vLLM's p2p tier, as vLLM does for a dead peer's requests
        (``P2PSecondaryTierManager._failed_req_ids``: its ``lookup`` then answers miss)."""
        for tier in self._p2p_tiers():
            tier._failed_req_ids.add(kv_request_id)
        self.pool_sources["gave_up"] += 1
        logger.warning(
            "p2p pool: request %s: its source did not answer the lookup within %.0f ms; its prompt is computed here",
            request.request_id,
            self._wait_s * 1000,
        )

    def shutdown(self) -> None:
        """Close the pool's index, then vLLM's."""
        if self.pool is not None:
            self.pool.close()
        super().shutdown()

    def _unlinger(self) -> None:
        """No linger for the p2p tier's control sockets (the context's default for every socket
        it makes): vLLM closes a dead peer's connection with ZMQ's default, forever
        (``tiering/p2p/control/zmq.py`` ``ZmqConnection.close``), and at shutdown destroys the
        context, which then waits forever for what was queued to a peer that never connected (a
        source or a prefill that died): the engine would hang at shutdown."""
        import zmq

        manager = getattr(getattr(self, "connector_scheduler", None), "manager", None)
        for tier in getattr(manager, "secondary_tiers", ()):
            context = getattr(getattr(tier, "_control", None), "_zmq_ctx", None)
            if isinstance(context, zmq.Context):
                context.setsockopt(zmq.LINGER, 0)

    def _p2p_tiers(self) -> list[Any]:
        """vLLM's p2p tier managers of this connector (the scheduler half's; none in a worker)."""
        from vllm.v1.kv_offload.tiering.p2p.manager import P2PSecondaryTierManager

        manager = getattr(getattr(self, "connector_scheduler", None), "manager", None)
        return [t for t in getattr(manager, "secondary_tiers", ()) if isinstance(t, P2PSecondaryTierManager)]

    def _seal(self) -> None:
        """With the deployment key, seal the tier's handshake (:func:`seal_handshake`)."""
        if self._keys is not None:
            for tier in self._p2p_tiers():
                seal_handshake(tier._data, self._keys)

    def _screen(self, request: Request, params: dict[str, Any]) -> None:
        digest = prompt_digest(list(request.prompt_token_ids or ()), request_context(request))
        try:
            screen(params, digest, self._keys, self._replays, time.time(), peers=self._peers, transport=self._transport)
        except Refused as refused:
            for key in P2P_ROLE_KEYS:
                params.pop(key, None)
            self.refused_params[refused.reason] += 1
            logger.warning(
                "p2p roles refused (%s) for request %s: %s; its prompt is computed here",
                refused.reason,
                request.request_id,
                refused.detail,
            )

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        done, params = super().request_finished(request, block_ids)
        return done, self._answer(request, params)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        done, params = super().request_finished_all_groups(request, block_ids)
        return done, self._answer(request, params)

    def _answer(self, request: Request, params: dict[str, Any] | None) -> dict[str, Any] | None:
        """The decode's params for a request this engine prefilled for it: the p2p consumer role."""
        self._waiting.pop(request.request_id, None)
        kv_request_id = self._to_decoder.pop(request.request_id, None)
        if kv_request_id is None or self._address is None:
            return params
        host, port = self._address
        role = {"kv_request_id": kv_request_id, "remote_host": host, "remote_port": port}
        digest = prompt_digest(list(request.prompt_token_ids or ()), request_context(request))
        return decoder_params(params, role, digest, self._keys, time.time())
