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

Everything else is vLLM's class. The class keeps vLLM's name (vLLM looks connectors up by it);
``kv_connector_module_path`` points here.
"""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING, Any

from vllm import envs
from vllm.distributed.kv_transfer.kv_connector.v1 import offloading_connector
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.logger import init_logger

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
        #: request id -> the kv_request_id this engine gave it as a prefill for a remote decode
        self._to_decoder: dict[str, str] = {}

    def on_new_request(self, request: Request) -> None:
        """A prefill asked for a remote decode the NIXL way: give it the p2p tier's producer role."""
        params = request.kv_transfer_params
        if self._address is not None and params and params.get(DO_REMOTE_DECODE) is True:
            if not any(key in params for key in ROLE_KEYS):
                kv_request_id = REQUEST_ID_PREFIX + secrets.token_hex(16)
                params[DECODER] = {"kv_request_id": kv_request_id}
                self._to_decoder[request.request_id] = kv_request_id
        super().on_new_request(request)

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
        return {**(params or {}), PREFILLER: role}
