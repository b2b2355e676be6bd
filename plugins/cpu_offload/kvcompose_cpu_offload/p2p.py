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
  the request's params);
* when such a request finishes, its answer's params are ``remote_prefiller`` naming this engine's
  p2p control socket and that id (:meth:`request_finished`), which the router passes to the decode.

**Trust.** vLLM's tier believes the role keys as it finds them: a client that reaches an
instance's API chooses the peer it connects to (``remote_host``/``remote_port``), and a role
that is not a mapping raises in the scheduler. Here every role is screened in
:meth:`on_new_request`, before vLLM reads it, with the NIXL child's rules
(:mod:`kvcompose_nixl.trust`); a role refused is removed and the prompt computed here:

* ``malformed``: a role that is not a mapping of the tier's fields, of their types and sizes,
  or a combination vLLM's tier does not take;
* ``role``: with a key, a ``remote_decoder`` a client wrote (this class gives prefills theirs);
* ``prompt``, ``unsigned``, ``signature``, ``expired``, ``replayed``: with a key, a
  ``remote_prefiller`` must carry the prefill's signature over the role, its end, and the
  digest of the prompt it computed (this prompt's), and be taken once;
* ``peer``: the peer a role names must be reachable under the NIXL child's rule: a signed
  role's, else loopback (``remote_kv_source`` is never signed: it names loopback only).

Everything else is vLLM's class. The class keeps vLLM's name (vLLM looks connectors up by it);
``kv_connector_module_path`` points here.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from vllm import envs
from vllm.distributed.kv_transfer.kv_connector.v1 import offloading_connector
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.logger import init_logger

from kvcompose_cpu_offload.tiers import P2P_KEY_ENV_KEY, P2P_KEY_FILE_KEY
from kvcompose_nixl.trust import (
    LOOPBACK_PEERS,
    MAX_HOST_CHARS,
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

#: The p2p tier's role keys (``tiering/p2p/manager.py``).
DECODER, PREFILLER, SOURCE = "remote_decoder", "remote_prefiller", "remote_kv_source"
ROLE_KEYS = (DECODER, PREFILLER, SOURCE)
#: The keys vLLM's proxy and router send the prefill (NixlConnector's protocol).
DO_REMOTE_DECODE = "do_remote_decode"
#: Prefix of the ids this class gives (the p2p tier needs nothing of them but uniqueness).
REQUEST_ID_PREFIX = "kvcompose-p2p-"
#: The role combinations vLLM's tier takes (``tiering/p2p/manager.py``: only these two together).
LEGAL = ({DECODER}, {PREFILLER}, {SOURCE}, {DECODER, SOURCE})
#: vLLM's default time a prefill's p2p tier holds blocks for the decode (``unbound_store_timeout_s``).
HOLD_S = 60.0


def check_roles(params: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The p2p roles of ``params``, each checked field by field (``malformed`` otherwise)."""
    present = {key for key in ROLE_KEYS if key in params}
    if present and present not in LEGAL:
        raise Refused("malformed", f"roles {sorted(present)} together: vLLM's p2p tier takes one, or decoder + source")
    roles: dict[str, dict[str, Any]] = {}
    for name in sorted(present):
        role = params[name]
        if not isinstance(role, dict):
            raise Refused("malformed", f"{name} must be a mapping, not {type(role).__name__}")
        fields = {"kv_request_id"} if name == DECODER else {"kv_request_id", "remote_host", "remote_port"}
        if set(role) != fields:
            raise Refused("malformed", f"{name} must hold exactly {sorted(fields)}")
        text_field(role, "kv_request_id", MAX_ID_CHARS, f"{name}.")
        if name != DECODER:
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
    answer = {**(params or {}), PREFILLER: role, PROMPT_KEY: digest}
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
) -> None:
    """Raise :class:`Refused` unless this engine may act on the p2p roles of ``params`` for a
    prompt of ``digest`` (:func:`prompt_digest`). The checks run in this order, each reason
    pinned by a test beside a control that passes the checks before it."""
    roles = check_roles(params)
    if keys is not None and DECODER in roles:
        raise Refused("role", "a remote_decoder role from a client: this engine gives a prefill its own")
    prefiller = roles.get(PREFILLER)
    signed = False
    if prefiller is not None and keys is not None:
        read = (f"{prefiller['remote_host']}:{prefiller['remote_port']}", prefiller["kv_request_id"])
        verify_signed(signed_view(prefiller, params), keys, replays, read, now, clock_skew_s, digest)
        signed = True
    for name in (PREFILLER, SOURCE):
        role = roles.get(name)
        if role is not None and not signed and not LOOPBACK_PEERS.allows(role["remote_host"], role["remote_port"]):
            raise Refused(
                "peer", f"{name} names {role['remote_host']}:{role['remote_port']}, which no signature vouches for"
            )


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
        super().__init__(vllm_config, role, kv_cache_config)
        extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        self._address = p2p_address(extra, vllm_config.parallel_config.data_parallel_index)
        self._keys = Keyring.load(extra.get(P2P_KEY_ENV_KEY), extra.get(P2P_KEY_FILE_KEY), owner="native-offload")
        self._replays = Replays()
        #: request id -> the kv_request_id this engine gave it as a prefill for a remote decode
        self._to_decoder: dict[str, str] = {}
        #: roles refused, by reason (the log says each; tests and operators read the counts)
        self.refused: dict[str, int] = {}

    def on_new_request(self, request: Request) -> None:
        """Screen the request's p2p roles, or give a prefill asked for a remote decode the NIXL way
        the tier's producer role; then vLLM's."""
        params = request.kv_transfer_params
        if self._address is not None and params:
            if any(key in params for key in ROLE_KEYS):
                self._screen(request, params)
            elif params.get(DO_REMOTE_DECODE) is True:
                kv_request_id = REQUEST_ID_PREFIX + secrets.token_hex(16)
                params[DECODER] = {"kv_request_id": kv_request_id}
                self._to_decoder[request.request_id] = kv_request_id
        super().on_new_request(request)

    def _screen(self, request: Request, params: dict[str, Any]) -> None:
        digest = prompt_digest(list(request.prompt_token_ids or ()), request_context(request))
        try:
            screen(params, digest, self._keys, self._replays, time.time())
        except Refused as refused:
            for key in ROLE_KEYS:
                params.pop(key, None)
            self.refused[refused.reason] = self.refused.get(refused.reason, 0) + 1
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
        kv_request_id = self._to_decoder.pop(request.request_id, None)
        if kv_request_id is None or self._address is None:
            return params
        host, port = self._address
        role = {"kv_request_id": kv_request_id, "remote_host": host, "remote_port": port}
        digest = prompt_digest(list(request.prompt_token_ids or ()), request_context(request))
        return decoder_params(params, role, digest, self._keys, time.time())
