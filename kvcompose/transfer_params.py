"""Facts about vLLM's ``kv_transfer_params`` that the composite, the plugins and the tools all check.

The p2p tier (``vllm/v1/kv_offload/tiering/p2p/manager.py`` ``_parse_source``) reads one role a
request: the decode it sends to, the prefill it reads from, or a source it loads a prefix from;
each role names a ``remote_host``, which NIXL's params name too.
"""

from __future__ import annotations

#: The p2p tier's role keys.
P2P_DECODER, P2P_PREFILLER, P2P_SOURCE = "remote_decoder", "remote_prefiller", "remote_kv_source"
P2P_ROLE_KEYS = (P2P_DECODER, P2P_PREFILLER, P2P_SOURCE)
#: The longest host a role may name: a DNS name's limit (RFC 1035), which any address fits.
MAX_HOST_CHARS = 253
