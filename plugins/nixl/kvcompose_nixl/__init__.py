"""kvcompose connector type ``nixl``: vLLM's NixlConnector as a child of a composition.

Two modules, kept apart on purpose:

- :mod:`kvcompose_nixl.plugin` describes the type to kvcompose (options, vLLM config,
  checks). It never imports vLLM, so ``kvcompose check`` runs where vLLM is not installed.
- :mod:`kvcompose_nixl.connector` holds the connector classes vLLM loads
  (``kv_connector_module_path = "kvcompose_nixl.connector"``): vLLM's own NIXL connectors plus
  the side-channel options and a fix for an upstream scheduler assert.
"""

from __future__ import annotations

__version__ = "0.1.0"

#: The module vLLM imports the connector classes from.
CONNECTOR_MODULE = "kvcompose_nixl.connector"

#: ``kv_connector_extra_config`` keys read by :mod:`kvcompose_nixl.connector` (vLLM itself only
#: reads the side channel from ``VLLM_NIXL_SIDE_CHANNEL_HOST``/``_PORT``). Prefixed so they can
#: never collide with a key a later vLLM adds.
SIDE_CHANNEL_HOST_KEY = "kvcompose_side_channel_host"
SIDE_CHANNEL_PORT_KEY = "kvcompose_side_channel_port"
#: Microseconds NIXL's progress thread sleeps between polls (kvcompose_nixl.patches).
PROGRESS_DELAY_KEY = "kvcompose_progress_delay_us"
#: UCX endpoint error-handling mode of the NIXL agent's UCX backend (kvcompose_nixl.patches).
UCX_ERROR_HANDLING_KEY = "kvcompose_ucx_error_handling"
#: How many times the worker asks a peer's side channel for its agent metadata (kvcompose_nixl.handshake).
HANDSHAKE_TRIES_KEY = "kvcompose_handshake_tries"
#: Seconds vLLM's worker waits for a peer's side channel to answer one handshake request
#: (``sock.setsockopt(zmq.RCVTIMEO, 5000)`` in ``NixlBaseConnectorWorker._nixl_handshake``;
#: pinned by the plugin's tests).
HANDSHAKE_TRY_S = 5
#: Trust (kvcompose_nixl.trust): where the deployment key is read from (an environment
#: variable's name, or a file's path; never the key itself), whether a decode takes params and
#: agent metadata that no key signed, and the side channels a decode may connect to.
KEY_ENV_KEY = "kvcompose_key_env"
KEY_FILE_KEY = "kvcompose_key_file"
ACCEPT_UNSIGNED_KEY = "kvcompose_accept_unsigned"
PEERS_KEY = "kvcompose_peers"
#: Without a key, whether the side channel may bind beyond loopback all the same (refused otherwise).
INSECURE_SIDE_CHANNEL_KEY = "kvcompose_insecure_side_channel"
#: The ``kv_transfer_params`` key a prefill instance of this type returns: it answers the lease
#: questions of decode instances (kvcompose_nixl.lease; the value is the protocol's version).
LEASE_ANSWERS_KEY = "kvcompose_lease_answers"

__all__ = [
    "ACCEPT_UNSIGNED_KEY",
    "CONNECTOR_MODULE",
    "HANDSHAKE_TRIES_KEY",
    "HANDSHAKE_TRY_S",
    "INSECURE_SIDE_CHANNEL_KEY",
    "KEY_ENV_KEY",
    "KEY_FILE_KEY",
    "LEASE_ANSWERS_KEY",
    "PEERS_KEY",
    "PROGRESS_DELAY_KEY",
    "SIDE_CHANNEL_HOST_KEY",
    "SIDE_CHANNEL_PORT_KEY",
    "UCX_ERROR_HANDLING_KEY",
    "__version__",
]
