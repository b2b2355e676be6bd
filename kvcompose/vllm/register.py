"""The ``vllm.general_plugins`` entry point: registers the composed connector under its own name.

vLLM runs general plugins once in every process it starts (front end, engine core, workers), and
``KVConnectorFactory.register_connector`` raises for a name it already has, so this is idempotent.
"""

from __future__ import annotations

#: Use ``kv_connector: KVCompose`` to load the composite by name (``vllm-args`` uses the
#: module-path form instead, which keeps vLLM's ``MultiConnector`` checks working).
REGISTERED_NAME = "KVCompose"


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvcompose.vllm.args import MODULE

    if REGISTERED_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(REGISTERED_NAME, MODULE, "KVComposeConnector")
